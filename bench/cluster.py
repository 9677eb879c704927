"""A job across simulated nodes: how fast an event is whole on node 0, how fast a lost node is
detected, what it costs a training step.

Run from the repository root, as root (simulated nodes are network namespaces)::

    python bench/cluster.py                 # 2, 4 and 8 nodes, 3 repetitions each: ~9 minutes
    python bench/cluster.py --reps 1 --nodes 2
    python bench/cluster.py --parts step --reps 5   # one part alone (events, gather, step)

Each repetition is a fresh set of nodes (``tether.testing.nodes``: a namespace per node on a
bridge, its own hostname and dump directory) with ``tether run`` on every node, as on a cluster
(2 ranks per node where the machine's 2 cores allow: up to 4 nodes; 1 beyond). The job is the
multi-node tests' (``tests/workers/cluster_job.py``: DDP on a small model, gloo).

- **hang**: the last rank hangs at step 3 (hang timeout 3 s). From the hang alarm (its
  ``time_ns``) to the moment the last rank's dump is in node 0's directory (the files' times),
  then ``tether analyze`` on that directory (the verdict must name the culprit and its host);
  bytes brought from the other nodes.
- **node lost**: every process of the last node (its launcher included) is SIGKILLed mid-training.
  From the kill to the node-fault alarm (detection), and to the last survivor's dump in node 0's
  directory; the verdict must be ``node_lost`` naming that node.
- **gather**: what bringing an event costs at 64 ranks: 8 nodes of 8 ranks' 2,000-entry dumps
  (synthetic, ``bench/analyze_speed.py``'s), the 7 other nodes sending their parts to node 0's
  event port at once, as their launchers do; from the release to the last part written.
- **step**: the same 2-node job's mean step (600 steps, after the first) under ``tether run``
  and under plain torchrun (``tether run --no-tether``), in pairs; the overhead is each pair's
  ratio, reported with its spread.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, env, spread

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tether.analyze import analyze
from tether.events.layout import rank_file
from tether.testing.nodes import SimCluster

JOB = REPO / "tests" / "workers" / "cluster_job.py"
MASTER_PORT = 29500
TIMEOUT_S = 180.0
STEPS = 600


def launch(cluster: SimCluster, per_node: int, job_args: list[str], *extra: str) -> list[Any]:
    head = cluster.nodes[0]
    procs = []
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "tether.cli.main", "run",
            f"--nnodes={len(cluster.nodes)}", f"--node-rank={node.index}",
            f"--master-addr={head.address}", f"--master-port={MASTER_PORT}",
            f"--nproc-per-node={per_node}", "--monitor-interval=0.1",
            f"--dump-dir={node.dump_dir}", *extra, str(JOB), *job_args,
        ]  # fmt: skip
        log = open(cluster.root / f"{node.hostname}.log", "wb")  # noqa: SIM115 (closed with the proc)
        procs.append((cluster.start(node, argv, env=env(), stdout=log, stderr=log), log))
    return procs


def finish(procs: list[Any], cluster: SimCluster) -> list[int]:
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            logs = "".join(
                (cluster.root / f"{n.hostname}.log").read_text()[-2000:] for n in cluster.nodes
            )
            raise SystemExit(f"a launcher did not end:\n{logs}") from None
        finally:
            log.close()
    return codes


def wait_ready(ready: Path, world: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while len(list(ready.glob("ready_*"))) < world:
        if time.monotonic() > deadline:
            raise SystemExit("the job did not start on every node")
        time.sleep(0.02)


def the_event(cluster: SimCluster) -> Path:
    head = cluster.nodes[0].dump_dir
    events = sorted(p for p in head.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not events:
        raise SystemExit("no event on node 0")
    return events[-1]


def alarm_ns(event: Path) -> int:
    data = pickle.loads(rank_file(event, 0).read_bytes())  # written by this run
    return int(data["tether"]["alarm"]["time_ns"])


def whole_ns(event: Path, world: int) -> int:
    files = [rank_file(event, r) for r in range(world) if rank_file(event, r).exists()]
    return max(p.stat().st_mtime_ns for p in files)


def hang(nodes: int, per_node: int) -> dict[str, Any]:
    world = nodes * per_node
    with SimCluster(nodes) as cluster:
        ready = cluster.root / "ready"
        ready.mkdir()
        args = ["--steps=20", "--fault=hang", f"--culprit={world - 1}", f"--ready={ready}"]
        finish(launch(cluster, per_node, args, "--hang-timeout=3"), cluster)
        event = the_event(cluster)
        whole = (whole_ns(event, world) - alarm_ns(event)) / 1e9
        started = time.perf_counter()
        d = analyze(event)
        verdict_s = time.perf_counter() - started
        host = f"node{nodes - 1}"
        right = (d.verdict, d.culprit_ranks, d.hosts.get(world - 1)) == ("hang", [world - 1], host)
        moved = sum(
            rank_file(event, r).stat().st_size
            for r in range(per_node, world)
            if rank_file(event, r).exists()
        )
    return {"whole_s": whole, "verdict_s": whole + verdict_s, "bytes": moved, "right": right}


def node_lost(nodes: int, per_node: int) -> dict[str, Any]:
    world = nodes * per_node
    with SimCluster(nodes) as cluster:
        ready = cluster.root / "ready"
        ready.mkdir()
        procs = launch(cluster, per_node, ["--steps=1000000", f"--ready={ready}"])
        wait_ready(ready, world)
        killed = time.time_ns()
        cluster.kill(cluster.nodes[-1])
        finish(procs[:-1], cluster)
        procs[-1][1].close()
        event = the_event(cluster)
        d = analyze(event)
        right = d.verdict == "node_lost" and [n.host for n in d.nodes] == [f"node{nodes - 1}"]
        return {
            "detected_s": (alarm_ns(event) - killed) / 1e9,
            "whole_s": (whole_ns(event, world) - killed) / 1e9,
            "right": right,
        }


GATHER_NODES, GATHER_RANKS, GATHER_ENTRIES = 8, 8, 2000
_RECEIVER = """
import json, sys, time
from pathlib import Path
from tether.launcher.gather import EventPort
port = EventPort(Path(sys.argv[1]), node=0, host="node0", address=sys.argv[2])
print(json.dumps({"port": port.port, "token": port.token}), flush=True)
release = float(sys.stdin.readline())
parts = port.wait_parts(sys.argv[3], range(1, int(sys.argv[4])), 120.0)
print(json.dumps({"s": time.time() - release, "parts": len(parts)}), flush=True)
port.close()
"""
_SENDER = """
import json, sys, time
from pathlib import Path
from tether.job.nodes import NodeInfo
from tether.launcher.gather import send_part
to = NodeInfo(**json.loads(sys.argv[1]))
release = float(sys.argv[3])
time.sleep(max(release - time.time(), 0))
send_part(Path(sys.argv[2]), to, node=int(sys.argv[4]))
"""


def gather() -> dict[str, Any]:
    from analyze_speed import build_event

    event_id = "20260101T000000.000000Z-hang"
    with tempfile.TemporaryDirectory(prefix="tether-bench-gather-") as tmp:
        source = Path(tmp, "all")
        build_event(source, GATHER_NODES * GATHER_RANKS, GATHER_ENTRIES)
        with SimCluster(GATHER_NODES) as cluster:
            for node in cluster.nodes[1:]:
                part = node.dump_dir / event_id
                part.mkdir(parents=True)
                for r in range(node.index * GATHER_RANKS, (node.index + 1) * GATHER_RANKS):
                    os.link(rank_file(source, r), rank_file(part, r))
            head = cluster.nodes[0]
            receiver = cluster.start(
                head,
                [
                    sys.executable,
                    "-c",
                    _RECEIVER,
                    str(head.dump_dir),
                    head.address,
                    event_id,
                    str(GATHER_NODES),
                ],
                env=env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert receiver.stdin is not None and receiver.stdout is not None
            port = json.loads(receiver.stdout.readline())
            info = {
                "node": 0, "host": "node0", "address": head.address, "port": port["port"],
                "token": port["token"], "ranks": [], "pid": receiver.pid, "dump_dir": "",
            }  # fmt: skip
            release = time.time() + 2.0  # every sender started and waiting
            receiver.stdin.write(f"{release}\n")
            receiver.stdin.flush()
            senders = [
                cluster.start(
                    node,
                    [
                        sys.executable,
                        "-c",
                        _SENDER,
                        json.dumps(info),
                        str(node.dump_dir / event_id),
                        str(release),
                        str(node.index),
                    ],
                    env=env(),
                )
                for node in cluster.nodes[1:]
            ]
            for sender in senders:
                sender.wait(timeout=TIMEOUT_S)
            got = json.loads(receiver.stdout.readline())
            receiver.wait(timeout=30)
            moved = sum(
                rank_file(head.dump_dir / event_id, r).stat().st_size
                for r in range(GATHER_RANKS, GATHER_NODES * GATHER_RANKS)
            )
    return {"s": got["s"], "parts": got["parts"], "bytes": moved}


def step_time(tether: bool) -> float:
    with SimCluster(2) as cluster:
        extra = () if tether else ("--no-tether",)
        finish(launch(cluster, 2, [f"--steps={STEPS}", "--timing"], *extra), cluster)
        out = (cluster.root / "node0.log").read_text()
    line = next(x for x in out.splitlines() if x.startswith("STEP_TIME "))
    return float(line.split()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nodes", default="2,4,8", help="node counts, comma-separated")
    parser.add_argument("--parts", default="events,gather,step", help="which parts to run")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    counts = [int(n) for n in args.nodes.split(",")] if "events" in parts else []
    rows = []
    hangs: dict[int, list[dict[str, Any]]] = {}
    losses: dict[int, list[dict[str, Any]]] = {}
    for n in counts:
        per_node = 2 if n <= 4 else 1
        hangs[n] = [hang(n, per_node) for _ in range(args.reps)]
        losses[n] = [node_lost(n, per_node) for _ in range(args.reps)]
        h, lost = hangs[n], losses[n]
        rows.append(
            (
                f"{n} nodes x {per_node}",
                spread([x["whole_s"] for x in h]),
                spread([x["verdict_s"] for x in h]),
                f"{statistics.median(x['bytes'] for x in h) / 1e6:.2f}",
                spread([x["detected_s"] for x in lost]),
                spread([x["whole_s"] for x in lost]),
                f"{sum(x['right'] for x in h + lost)}/{len(h + lost)}",
            )
        )
    gathers = [gather() for _ in range(args.reps)] if "gather" in parts else []
    plain, under = [], []
    for _ in range(args.reps if "step" in parts else 0):
        plain.append(step_time(False))
        under.append(step_time(True))
    overheads = [100 * (u / p - 1) for p, u in zip(plain, under, strict=True)]

    if rows:
        head = ("nodes", "hang->whole s", "hang->verdict s", "MB moved", "loss->detected s",
                "loss->whole s", "right")  # fmt: skip
        print(" | ".join(head))
        for row in rows:
            print(" | ".join(row))
    figures: dict[str, Any] = {"reps": args.reps}

    def median(values: Any) -> float:
        return round(statistics.median(values), 3)

    if counts:
        figures.update(
            nodes=counts,
            hang_to_whole_event_s={n: median(x["whole_s"] for x in hangs[n]) for n in counts},
            hang_to_verdict_s={n: median(x["verdict_s"] for x in hangs[n]) for n in counts},
            node_loss_detected_s={n: median(x["detected_s"] for x in losses[n]) for n in counts},
            node_loss_to_whole_event_s={n: median(x["whole_s"] for x in losses[n]) for n in counts},
            bytes_moved_hang={n: int(median(x["bytes"] for x in hangs[n])) for n in counts},
            right=sum(x["right"] for n in counts for x in hangs[n] + losses[n]),
            runs=sum(len(hangs[n]) + len(losses[n]) for n in counts),
        )
    if gathers:
        print(
            f"\ngather {GATHER_NODES} nodes x {GATHER_RANKS} ranks x {GATHER_ENTRIES} entries "
            f"({statistics.median(x['bytes'] for x in gathers) / 1e6:.1f} MB from 7 nodes): "
            f"{spread([x['s'] for x in gathers])} s to whole on node 0"
        )
        figures["gather_64_ranks_2000_entries_s"] = median(x["s"] for x in gathers)
        figures["gather_64_ranks_2000_entries_s_spread"] = [
            round(min(x["s"] for x in gathers), 3), round(max(x["s"] for x in gathers), 3),
        ]  # fmt: skip
    if overheads:
        print(
            f"step (2 nodes x 2 ranks, {STEPS} steps): plain torchrun {spread(plain, '{:.5f}')} "
            f"s, tether run {spread(under, '{:.5f}')} s: overhead "
            f"{spread(overheads, '{:+.2f}')} % (each pair's ratio)"
        )
        figures["step_overhead_pct"] = round(statistics.median(overheads), 2)
        figures["step_overhead_pct_spread"] = [round(min(overheads), 2), round(max(overheads), 2)]
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
