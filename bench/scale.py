"""The job's protocol at 64 to 16,384 ranks, simulated on this machine: what the job's store sees
in steady state, and how long an alarm takes to reach every rank.

    python bench/scale.py [--ranks 64,512] [--per-node 16] [--steady 5] [--reps 1]

Simulated ranks are threads, ``--per-node`` to a node, the nodes spread over a few processes: no
torch training, no process group; but each runs tether's own protocol code, the modules a real
rank and a real ``tether run`` agent run: each rank a :class:`~tether.watchdog.responder.Responder`
(its dump writes a synthetic file of :data:`DUMP_BYTES` into its node's own directory), each
node's agent the :class:`~tether.job.relay.AlarmLook` and :class:`~tether.job.relay.RelayServer`
that ``tether run``'s alarm watch runs. The store is a real TCPStore, hosted by a process of its
own, whose CPU time is read from ``/proc``. Every store request the simulated processes make is
counted (``tether.testing.stores.CountingStore`` around the TCPStore client; a simulated
node's ranks share one connection).

Two protocols in the same run, each on a fresh store:

- ``store``: every rank looks for alarms in the store itself (what a rank does without
  ``tether run``, and what every rank did before the relay): every
  :func:`~tether.watchdog.responder.poll_period`;
- ``relay``: each node's agent looks, and tells its ranks over the node's relay.

For each: store requests a second per node and the store host's CPU over ``--steady`` seconds of
nothing happening; then one alarm raised, and the time until every rank's dump is on its node's
disk and its part marked in the store (``alarm_to_all_dumped_s``), and how many answered
within 300 s. Not simulated yet: a dead rank's and a dead node's detection (tether run's
beats, 4 store requests a second per node on a job of several nodes), and analyze at 16k ranks
(``bench/analyze_speed.py --ranks 16384`` measures it). A thread per rank does not reach 4,096
ranks on 2 cores (``--ranks 4096``: the threads of one interpreter queue for its lock, and
ranks go unanswered); a lighter model of a rank is the next step. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import env, spread

DUMP_BYTES = 64 << 10
"""A simulated rank's dump (a real 2,000-entry dump is ~360 KB; all simulated nodes share this
machine's one disk, where a real node writes to its own)."""
MODES = ("store", "relay")
SWITCH_S = 1e-3
READY_TIMEOUT_S = 600.0

_STORE_HOST = r"""
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()
"""


def simulate(mode: str, port: int, nodes: range, per_node: int, world: int, root: Path) -> None:
    """One process's share of the simulated nodes: their ranks (``store``: looking in the store
    themselves; ``relay``: hearing from their agents), or their agents (``agents``: each node's
    look and relay, in processes of their own as a real agent is); commands on stdin, answers
    on stdout."""
    from datetime import timedelta

    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard
    from tether.job.relay import AlarmLook, RelayServer
    from tether.job.stacks import agent_key
    from tether.testing.stores import CountingStore
    from tether.watchdog import responder as responder_module
    from tether.watchdog.responder import Responder

    # Thousands of threads share one interpreter's lock here, where real ranks each have their
    # own: a thread back from a blocking call waits at most this long for it (5 ms by default,
    # which made an alarm's answers queue for minutes behind one another).
    sys.setswitchinterval(SWITCH_S)
    # A real rank's responder wakes every RELAY_WAIT_S to see whether it must stop: harmless for
    # one process, thousands of wake-ups a second for the thousands of threads of one here.
    responder_module.RELAY_WAIT_S = 3600.0
    stores: list[CountingStore] = []
    blob = b"\0" * DUMP_BYTES
    responders: list[Responder] = []
    agents: list[tuple[AlarmLook, RelayServer]] = []
    heard: list[float] = []
    dumped: list[float] = []
    relayed: list[float] = []

    def dump_into(node_dir: Path, rank: int) -> Any:
        def dump(alarm: Any) -> Path:
            heard.append(time.time())
            event = node_dir / alarm.event_id
            event.mkdir(parents=True, exist_ok=True)
            path = event / f"rank_{rank}"
            path.write_bytes(blob)
            dumped.append(time.time())
            return path

        return dump

    for node in nodes:
        host = f"sim-node{node:05d}"
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, 1, False, timeout=timedelta(seconds=120), use_libuv=True
        )
        store = CountingStore(client)
        stores.append(store)
        board = AlarmBoard(store)  # type: ignore[arg-type]
        name = f"tether-scale-{port}-{node}" if mode != "store" else ""
        if mode == "agents":
            # As tether run's watch says it: its agent reads this host's silent ranks' stacks.
            client.set(agent_key(host), json.dumps({"pid": os.getpid(), "tool": "py-spy"}))
            server = RelayServer(name)

            def found(alarm: Any, server: RelayServer = server) -> None:
                server.send(alarm)
                relayed.append(time.time())

            look = AlarmLook(board, epoch=1, found=found)
            look.start()
            agents.append((look, server))
            continue
        if mode == "store":
            client.set(agent_key(host), json.dumps({"pid": os.getpid(), "tool": "py-spy"}))
        node_dir = root / host
        for local in range(per_node):
            rank = node * per_node + local
            responder = Responder(
                board,
                rank=rank,
                world_size=world,
                host=host,
                dump=dump_into(node_dir, rank),
                event_dir=lambda event_id, d=node_dir: d / event_id,
                abort_on=lambda alarm: False,
                relay=name,
            )
            responder.start()
            responders.append(responder)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while mode == "relay" and any(r.alarm_source != "agent" for r in responders):
        if time.monotonic() > deadline:
            raise SystemExit("the simulated ranks did not reach their agents")
        time.sleep(0.05)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "count":
            print(json.dumps(sum(store.total() for store in stores)), flush=True)
        elif command[0] == "answered":
            deadline = time.monotonic() + float(command[1])
            for responder in responders:
                responder.wait_answered(0, max(deadline - time.monotonic(), 0.0))
            while agents and len(relayed) < len(agents) and time.monotonic() < deadline:
                time.sleep(0.01)
            done = sum(r.answered > 0 for r in responders)
            print(
                json.dumps(
                    {
                        "answered": done,
                        "heard": max(heard, default=None),
                        "dumped": max(dumped, default=None),
                        "relayed": max(relayed, default=None),
                    }
                ),
                flush=True,
            )
        elif command[0] == "exit":
            break
    for responder in responders:
        responder.close(timeout=0.0)
    for look, server in agents:
        look.close()
        server.close()
    os._exit(0)  # 16,384 threads' teardown is not what is measured


def latest(answers: list[dict[str, Any]], key: str) -> float:
    """The last time any simulated process says ``key`` happened."""
    return max(a[key] for a in answers if a[key] is not None)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(mode: str, world: int, per_node: int, steady: float) -> dict[str, Any]:
    """One protocol at one size: a fresh store, the simulated nodes, the figures."""
    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard

    nodes = world // per_node
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env(),
    )  # fmt: skip
    sims: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="tether-scale-") as tmp:
        try:
            assert host.stdout is not None
            port = int(host.stdout.readline())
            share = max(1, min(16, world // 512))
            bounds = [nodes * k // share for k in range(share + 1)]
            roles = ["agents", "relay"] if mode == "relay" else ["store"]
            for role in roles:
                started = []
                for a, b in itertools.pairwise(bounds):
                    started.append(subprocess.Popen(
                        [sys.executable, __file__, "--simulate", role, "--port", str(port),
                         "--nodes", f"{a}:{b}", "--per-node", str(per_node), "--world",
                         str(world), "--root", tmp],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(),
                    ))  # fmt: skip
                sims += started
                for sim in started:  # the agents listen before their ranks start
                    assert sim.stdout is not None and sim.stdout.readline().strip() == "ready"

            def ask(command: str) -> list[Any]:
                for sim in sims:
                    assert sim.stdin is not None
                    sim.stdin.write(command + "\n")
                    sim.stdin.flush()
                return [json.loads(sim.stdout.readline()) for sim in sims]  # type: ignore[union-attr]

            time.sleep(1.0)  # past start-up: each rank's first looks
            ops0, cpu0, t0 = sum(ask("count")), cpu_s(host.pid), time.monotonic()
            time.sleep(steady)  # the window measured: nothing happens in it
            ops1, cpu1, t1 = sum(ask("count")), cpu_s(host.pid), time.monotonic()
            board = AlarmBoard(
                dist.TCPStore("127.0.0.1", port, 1, False, use_libuv=True)  # type: ignore[attr-defined]
            )
            raised_at = time.time()
            board.raise_alarm("manual", origin="bench/scale.py")
            answers = ask("answered 300")
        finally:
            for proc in [*sims, host]:
                proc.kill()
                proc.wait(30)
    answered = sum(a["answered"] for a in answers)
    if answered < world:
        print(f"  {mode} {world}: only {answered} ranks answered in 300 s", file=sys.stderr)
    return {
        "answered": answered,
        "store_ops_per_s_per_node": (ops1 - ops0) / (t1 - t0) / nodes,
        "store_host_cpu": (cpu1 - cpu0) / (t1 - t0),
        "alarm_to_all_relayed_s": (
            latest(answers, "relayed") - raised_at if mode == "relay" else None
        ),
        "alarm_to_all_heard_s": latest(answers, "heard") - raised_at,
        "alarm_to_all_dumped_s": latest(answers, "dumped") - raised_at,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", default="64,512")
    ap.add_argument("--per-node", type=int, default=16)
    ap.add_argument("--steady", type=float, default=5.0, help="seconds of steady state measured")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--simulate", choices=(*MODES, "agents"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.simulate:
        a, b = map(int, args.nodes.split(":"))
        simulate(args.simulate, args.port, range(a, b), args.per_node, args.world, args.root)
        return 0
    sizes = [int(n) for n in args.ranks.split(",")]
    modes = args.modes.split(",")
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(m, n): [] for m in modes for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            for mode in modes:
                runs[mode, n].append(one(mode, n, args.per_node, args.steady))
                print(f"  {mode} {n}: {runs[mode, n][-1]}", file=sys.stderr, flush=True)

    def col(mode: str, n: int, key: str) -> list[float]:
        return [r[key] for r in runs[mode, n]]

    print(
        f"{'ranks':>6} {'protocol':>8} {'store ops/s/node':>18} {'store host CPU':>16} "
        f"{'alarm -> all heard, s':>22} {'-> all dumped, s':>18}"
    )
    for n in sizes:
        for mode in modes:
            print(
                f"{n:>6} {mode:>8} "
                f"{spread(col(mode, n, 'store_ops_per_s_per_node'), '{:.2f}'):>18} "
                f"{spread([100 * v for v in col(mode, n, 'store_host_cpu')], '{:.1f}%'):>16} "
                f"{spread(col(mode, n, 'alarm_to_all_heard_s'), '{:.2f}'):>22} "
                f"{spread(col(mode, n, 'alarm_to_all_dumped_s'), '{:.2f}'):>18}"
            )
    figures: dict[str, Any] = {"bench": "scale", "reps": args.reps, "per_node": args.per_node}
    for key in ("store_ops_per_s_per_node", "store_host_cpu", "alarm_to_all_heard_s",
                "alarm_to_all_dumped_s"):  # fmt: skip
        for mode in modes:
            name = key if mode == "relay" else f"{key}_before"
            figures[name] = {str(n): round(statistics.median(col(mode, n, key)), 4) for n in sizes}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
