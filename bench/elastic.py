"""A rank's death mid-training, survived three ways: tether --elastic, torchft 0.2, torchelastic.

Run from the repository root::

    python bench/elastic.py            # about 4-6 minutes on 2 cores
    python bench/elastic.py --reps 1   # one repetition of each
    python bench/elastic.py --nodes    # a whole node lost instead (root, etcd), about 15 minutes
    python bench/elastic.py --nodes --cases hsdp:node2,hsdp:node0   # some of those cases
    python bench/elastic.py --overhead --reps 10  # the fault-free overhead alone, about 17 minutes

The same small DDP job (``bench/workers/elastic_job.py``: 4 ranks, gloo, CPU, an MLP of 4.7 M
parameters) runs under each, and rank 2 sends itself SIGKILL in the middle of step 25 (after its
forward, while the others are in the gradient allreduce):

- **tether**: ``tether run --elastic`` (defaults: 2 s heartbeat timeout) with
  ``tether.elastic.Manager`` / ``DistributedDataParallel``; the launcher starts a replacement for
  rank 2 alone, healed from a survivor over ``tether.transport``.
- **torchft** 0.2.0 (the release that installs beside torch 2.13): one replica group per process,
  a lighthouse in this process (``min_replicas=3``, ``join_timeout_ms=1000``), each replica group's
  store hosted here, torchft's ``ProcessGroupGloo``, ``DistributedDataParallel`` and optimizer
  wrapper, ``timeout=5 s`` (a common setting); this script restarts the dead replica at once,
  as its own torchelastic would.
- **torchelastic**: ``torchrun --max-restarts 1``, torch's DDP, a checkpoint every 10 steps;
  every worker restarts from the last checkpoint.

Measured from the job's own event log (each process appends ``start``/``step``/``kill`` lines
with wall-clock times; one host, one clock):

- ``kill_to_next_step_s``: from the kill to the moment every surviving rank (torchelastic: every
  restarted rank) has committed a step again;
- ``steps_lost``: steps committed before the kill and committed again after it;
- ``join_to_first_step_s``: from the replacement process's start (before its imports) to its
  first committed step in the full world; healing bytes and seconds (tether);
- **overhead** in a fault-free run, median step time, interleaved repetitions: plain DDP under
  ``tether run`` against the same under ``tether run --elastic`` (the heartbeat alone:
  ``heartbeat_overhead_pct``), against tether's elastic DDP in a plain loop (its comm hook and
  ``find_unused_parameters``: ``elastic_ddp_overhead_pct``) and against the ``tether.elastic``
  loop (Manager, commit vote, elastic DDP: ``elastic_overhead_pct``); what the loop adds to the
  elastic DDP is ``elastic_loop_overhead_pct``. And, since those differences are near this
  machine's noise, the loop's own CPU measured inside that job from step 10 on, as a percentage
  of its time (``elastic_loop_cpu_pct``: the training thread's CPU clock inside the Manager's
  calls, ``elastic_loop_main_cpu_pct``, plus the heartbeat thread's, ``heartbeat_cpu_pct``;
  mean of the ranks).

With ``--nodes``, the job runs on 3 simulated nodes of 2 ranks (network namespaces,
:mod:`tether.testing.nodes`), one member of a real etcd cluster on each, and a whole node is killed
(its launcher, workers and etcd member) once every rank has committed step 20: node 2, then node 0
(torchrun's store and the rendezvous with it, and, handed to it before the job starts, etcd's
leader: the worst case, etcd elects another before anything is decided). tether: ``tether run
--elastic --store etcd://...``; against it, torchelastic as a user would run it across nodes:
``torchrun --nnodes 2:3 --max-restarts 1`` with torch's c10d rendezvous (hosted on node 0), a
checkpoint every 10 steps. Measured: ``kill_to_next_step_s`` and ``steps_lost`` as above, the
kill's time taken by this process (one machine, one clock). With tether, once the survivors have
stepped again, node 2's ``tether run`` starts again on an empty disk (a replacement node):
``join_to_first_step_s`` runs from that launcher's start to its ranks' first step in the full
world, and ``join_heal_bytes``/``_s`` is their healing over tcp. The same faults again with HSDP
(``how`` ``hsdp``: FSDP2 sharded over each node's ranks, replicated across the nodes,
``tether.elastic.hsdp_mesh``): a node lost is one replica, its replacement healed shard by shard
(``hsdp_node2_kill_to_next_step_s``, ``hsdp_join_heal_bytes``...). Last, node 2's link is taken
down (a 2 | 1 partition): ``partition_kill_to_next_step_s`` for the majority, and
``partition_minority_stop_s`` until node 2's workers are gone (ended by their launcher, cut off:
they can commit nothing meanwhile, having no quorum), ``partition_minority_exit_s`` until its
launcher has exited (with a failure, after waiting up to 30 s for the link to come back so that its
half of the event joins the other). Then node 2 is frozen (every process of it stopped but its etcd
member, thawed once the others went on): ``frozen_kill_to_next_step_s``.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import REPO, env, spread

from tether.testing.etcd import ELECTION_MS

WORKER = REPO / "bench" / "workers" / "elastic_job.py"
WORLD = 4
KILL_RANK, KILL_STEP = 2, 25
STEPS = 120
CKPT_EVERY = 10
JOB_TIMEOUT_S = 300
RESTART_TIMEOUT_S = 90
"""A torchelastic job (30 s of steps here) that has not ended by then hangs in its restart."""
NODES, PER_NODE = 3, 2
NODE_STEPS, NODE_KILL_STEP = 60, 20
NODE_PORT = 29500


def events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summarize(
    evs: list[dict[str, Any]],
    *,
    restart_all: bool = False,
    dead: frozenset[str] = frozenset({str(KILL_RANK)}),
    world: int = WORLD,
) -> dict[str, Any]:
    """The figures of one faulty run; ``dead``: the ranks killed (their replacements are not
    survivors), ``world``: the ranks launched."""
    kill = next(e for e in evs if e["what"] == "kill")
    steps = [e for e in evs if e["what"] == "step"]
    # A step lost is one a surviving rank (torchelastic: a restarted one) commits again after
    # the kill; the dead rank's replacement is not counted (torchft logs a commit of step 0 for a
    # replica still healing in its first quorum).
    before = {
        (e["who"].rstrip("+"), e["step"])
        for e in steps
        if e["t"] < kill["t"] and e["who"].rstrip("+") not in dead
    }
    if restart_all:  # every rank starts again, from the last checkpoint
        after = [e for e in steps if e["t"] > kill["t"]]
        survivors = {e["who"] for e in after}
    else:  # the survivors' next step is the one the kill interrupted (a step they may have been
        # committing as the kill came is not it)
        after = [e for e in steps if e["t"] > kill["t"] and e["step"] >= kill["step"]]
        survivors = {str(r) for r in range(world)} - dead
    firsts = [min(e["t"] for e in after if e["who"] == w) for w in survivors]
    out: dict[str, Any] = {
        "kill_to_next_step_s": max(firsts) - kill["t"],
        "steps_lost": len(
            {
                s
                for w, s in before
                & {(e["who"].rstrip("+"), e["step"]) for e in steps if e["t"] > kill["t"]}
            }
        ),
    }
    replacements = {e["who"] for e in evs if e["what"] == "start" and e["who"].endswith("+")}
    rejoin = [e["t"] for e in evs if e["what"] == "rejoin"]  # a replacement node's launcher
    joins, own = [], []
    for who in replacements:
        start = min(e["t"] for e in evs if e["who"] == who and e["what"] == "start")
        full = [e["t"] for e in steps if e["who"] == who and e.get("world") == world]
        if full:
            joins.append(min(full) - (rejoin[0] if rejoin else start))
            own.append(min(full) - start)
    out["join_to_first_step_s"] = max(joins) if joins else None
    if rejoin:  # the part after the replacement's workers started (their imports included)
        out["join_worker_to_first_step_s"] = max(own) if own else None
    # One survivor's step time before the kill: the redone step is part of the time to the next.
    watched = min(survivors).rstrip("+")
    one = sorted(e["t"] for e in steps if e["who"] == watched and e["t"] < kill["t"])
    gaps = [b - a for a, b in itertools.pairwise(one)]
    out["step_s"] = statistics.median(gaps) if gaps else None
    heals = [e for e in evs if e["what"] == "heal"]
    out["heal_bytes"] = heals[0]["bytes"] if heals else None
    out["heal_s"] = heals[0]["seconds"] if heals else None
    return out


def job_env(**extra: str) -> dict[str, str]:
    return env(("TETHER_", "TORCHFT_"), **extra)


def tether_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "tether.cli.main", "run", "--standalone", *flags]


def run_job(cmd: list[str], out: Path, timeout: float = JOB_TIMEOUT_S) -> None:
    try:
        proc = subprocess.run(
            cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"RuntimeError: the job did not end within {timeout:g}s") from exc
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{tail}")


def fault_args(out: Path, mode: str) -> list[str]:
    return [
        str(WORKER),
        f"--mode={mode}",
        f"--out={out}",
        f"--steps={STEPS}",
        f"--kill-rank={KILL_RANK}",
        f"--kill-step={KILL_STEP}",
        f"--ckpt-every={CKPT_EVERY}",
    ]


def tether_fault(tmp: Path) -> dict[str, Any]:
    out = tmp / "tether"
    out.mkdir()
    run_job(
        tether_cmd("--elastic", f"--nproc-per-node={WORLD}", f"--dump-dir={tmp / 'dumps'}")
        + fault_args(out, "tether"),
        out,
    )
    return summarize(events(out))


def torchelastic_fault(tmp: Path) -> dict[str, Any]:
    out = tmp / "torchelastic"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        *fault_args(out, "plain"),
    ]
    try:
        run_job(cmd, out, timeout=RESTART_TIMEOUT_S)
    except RuntimeError as exc:  # the restart itself can fail (gloo "Connection refused")
        lines = [x for x in str(exc).splitlines() if "Error" in x] or [str(exc)]
        return {"failed": lines[-1][:200]}
    return summarize(events(out), restart_all=True)


def torchft_fault(tmp: Path) -> dict[str, Any]:
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    out = tmp / "torchft"
    out.mkdir()
    # 3 of 4: the job goes on without the dead replica, as tether's does; 1 s for stragglers
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=WORLD - 1, join_timeout_ms=1000)
    stores = [
        TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(WORLD)
    ]

    def start(replica: int, again: bool) -> subprocess.Popen[bytes]:
        e = job_env(BENCH_STORE_PORT=str(stores[replica].port), OMP_NUM_THREADS="1")
        if again:
            e["BENCH_REPLACEMENT"] = "1"
        args = [
            *fault_args(out, "torchft"),
            f"--replica={replica}",
            f"--lighthouse={lighthouse.address()}",
        ]
        log = (out / f"replica_{replica}{'+' if again else ''}.log").open("wb")
        return subprocess.Popen([sys.executable, *args], env=e, stdout=log, stderr=log)

    procs = {r: start(r, False) for r in range(WORLD)}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    restarted = False
    try:
        while time.monotonic() < deadline:
            codes = {r: p.poll() for r, p in procs.items()}
            if not restarted and codes[KILL_RANK] is not None and codes[KILL_RANK] != 0:
                procs[KILL_RANK] = start(KILL_RANK, True)  # what its torchelastic would do
                restarted = True
                continue
            done = {e["who"].rstrip("+") for e in events(out) if e.get("step") == STEPS - 1}
            if all(c is not None for c in codes.values()) or len(done) == WORLD:
                break  # (a torchft replica may linger in its exit: its steps are what count)
            time.sleep(0.05)
        else:
            raise RuntimeError(f"torchft replicas did not finish within {JOB_TIMEOUT_S}s")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    return summarize(events(out))


def node_fault(
    tmp: Path, *, lost: int, how: str, fault: str = "kill", election_ms: int = ELECTION_MS
) -> dict[str, Any]:
    """The job on NODES simulated nodes of PER_NODE ranks, one etcd member each, etcd's leader on
    node 0 when node 0 is lost (the worst case: rank 0's host and etcd's leader at once) and
    on node 1 otherwise; once every rank has committed NODE_KILL_STEP, node ``lost`` is
    (``fault``) ``kill``-ed whole (launcher, workers, etcd member), its link taken down
    (``partition``: its launcher must stop, the others go on), or ``freeze``-d (every
    process but its etcd member stopped, thawed once the others went on: then it must stop).
    ``how``: ``tether`` (``--elastic``, the job's store on etcd), ``hsdp`` (the same with
    FSDP2 sharded within each node, replicated across nodes) or ``torchelastic`` (``torchrun
    --nnodes 2:3 --max-restarts 1``, torch's c10d rendezvous on node 0, a checkpoint every
    CKPT_EVERY steps)."""
    from tether.launcher.stackread import stacks_or_why
    from tether.testing.etcd import etcd_on_nodes
    from tether.testing.nodes import SimCluster

    partition = fault == "partition"
    out = tmp / f"{how}-node{lost}-{fault}"
    out.mkdir()
    cluster = SimCluster(NODES).build()
    try:
        with etcd_on_nodes(cluster, election_ms=election_ms) as etcd:
            head = cluster.nodes[0]
            procs, argvs = {}, {}
            # node 0's replacement cannot join; a node cut off stops and stays out
            tethered = how in ("tether", "hsdp")
            rejoin = tethered and lost != 0 and fault == "kill"
            if tethered:
                etcd.lead(etcd.members[0 if lost == 0 else 1])
            for node in cluster.nodes:
                if tethered:
                    launcher = [
                        sys.executable, "-m", "tether.cli.main", "run", "--elastic",
                        f"--nnodes={NODES}",
                        f"--node-rank={node.index}", f"--master-addr={head.address}",
                        f"--master-port={NODE_PORT}", f"--store={etcd.url}",
                        f"--dump-dir={node.dump_dir}",
                    ]  # fmt: skip
                else:
                    launcher = [
                        sys.executable, "-m", "torch.distributed.run", f"--nnodes=2:{NODES}",
                        "--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-id=bench",
                        f"--rdzv-endpoint={head.address}:{NODE_PORT}",
                        # (torch finds the host, and the workers their store, by the hostname:
                        # the simulated nodes have no DNS)
                        f"--rdzv-conf=is_host={int(node is head)}", f"--local-addr={node.address}",
                    ]  # fmt: skip
                argv = [
                    *launcher, f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.1",
                    str(WORKER), f"--mode={'tether' if tethered else 'plain'}",
                    *(["--hsdp"] if how == "hsdp" else []),
                    f"--out={out}", f"--steps={NODE_STEPS}", f"--ckpt-every={CKPT_EVERY}",
                    f"--until-world={NODES * PER_NODE if rejoin else 0}",
                ]  # fmt: skip
                with (out / f"{node.hostname}.log").open("wb") as log:
                    procs[node.index] = cluster.start(
                        node, argv, env=job_env(), stdout=log, stderr=subprocess.STDOUT
                    )
                argvs[node.index] = argv
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while len(_past(out, NODE_KILL_STEP)) < NODES * PER_NODE:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    raise RuntimeError(f"{how}: the job did not reach step {NODE_KILL_STEP}")
                time.sleep(0.02)
            committed = max(e["step"] for e in events(out) if e["what"] == "step")
            # Where the lost node's etcd member leads, etcd elects another before it can revoke
            # the node's lease: said beside the time it explains (led as asked, unless etcd
            # elected another meanwhile).
            leader = etcd.leader() if how != "torchelastic" else None
            held_leader = leader is not None and leader.node is cluster.nodes[lost]
            killed = time.time()
            stopped: dict[str, float] = {}
            if partition:  # when the minority's workers are gone, and when its launcher is
                cluster.link_down(cluster.nodes[lost])
                minority = procs[lost]
                workers = [
                    int(e["pid"])
                    for e in events(out)
                    if e["what"] == "start" and int(e["rank"]) // PER_NODE == lost
                ]

                def stop() -> None:
                    limit = time.monotonic() + RESTART_TIMEOUT_S
                    while any(_alive(pid) for pid in workers) and time.monotonic() < limit:
                        time.sleep(0.02)
                    stopped["workers"] = time.time()
                    minority.wait(RESTART_TIMEOUT_S)
                    stopped["launcher"] = time.time()

                threading.Thread(target=stop, name="bench-minority", daemon=True).start()
            elif fault == "freeze":  # thawed once the others went on, it must stop
                member = etcd.members[lost].proc
                assert member is not None
                cluster.freeze(cluster.nodes[lost], spare=[member.pid])

                def thaw() -> None:
                    _stepped_again(out, committed + 1, time.monotonic() + RESTART_TIMEOUT_S)
                    cluster.thaw(cluster.nodes[lost])

                threading.Thread(target=thaw, name="bench-thaw", daemon=True).start()
            else:
                cluster.kill(cluster.nodes[lost])
            kill = {"who": "bench", "what": "kill", "t": killed, "step": committed + 1}
            with (out / "events.jsonl").open("a") as f:
                f.write(json.dumps(kill) + "\n")
            if rejoin:  # once the survivors go on, the lost node's launcher starts again
                if not _stepped_again(out, committed + 1, deadline):
                    raise RuntimeError(f"{how}: the survivors never stepped again")
                node = cluster.nodes[lost]
                shutil.rmtree(node.dump_dir)  # a fresh host
                node.dump_dir.mkdir(parents=True)
                again = {"who": "bench", "what": "rejoin", "t": time.time()}
                with (out / "events.jsonl").open("a") as f:
                    f.write(json.dumps(again) + "\n")
                with (out / f"{node.hostname}-replacement.log").open("wb") as log:
                    procs[lost] = cluster.start(
                        node, argvs[lost], env=job_env(), stdout=log, stderr=subprocess.STDOUT
                    )
            codes: list[int | None] = []
            for k, proc in procs.items():
                if k == lost and not rejoin:
                    continue  # killed, or cut off (its exit is timed above)
                try:
                    codes.append(proc.wait(timeout=RESTART_TIMEOUT_S))
                except subprocess.TimeoutExpired:
                    codes.append(None)
                    (out / f"node{k}.stacks").write_text(  # a hang: what each process does
                        "\n".join(
                            f"--- pid {pid}\n{stacks_or_why(pid)}"
                            for pid in cluster.pids(cluster.nodes[k])
                        )
                    )
            for node in cluster.nodes:  # their dumps, before the nodes go (for a failure)
                shutil.copytree(node.dump_dir, out / f"{node.hostname}-dumps")
    finally:
        cluster.close()
    dead = frozenset(str(lost * PER_NODE + i) for i in range(PER_NODE))
    try:
        if any(code != 0 for code in codes):
            raise RuntimeError(f"exit codes {codes} (None: still running)")
        if fault == "freeze":
            if procs[lost].wait(RESTART_TIMEOUT_S) == 0:
                raise RuntimeError("the node frozen, then thawed, did not stop with a failure")
            return summarize(events(out), dead=dead, world=NODES * PER_NODE)
        if partition:
            procs[lost].wait(RESTART_TIMEOUT_S)
            if "launcher" not in stopped or procs[lost].returncode == 0:
                raise RuntimeError("the node cut off did not stop with a failure")
            result = summarize(events(out), dead=dead, world=NODES * PER_NODE)
            return {
                **result,
                "partition_minority_stop_s": stopped["workers"] - killed,
                "partition_minority_exit_s": stopped["launcher"] - killed,
            }
        if tethered:
            result = summarize(events(out), dead=dead, world=NODES * PER_NODE)
            return {**result, "etcd_leader_lost": held_leader}
        return summarize(events(out), restart_all=True, dead=frozenset(), world=NODES * PER_NODE)
    except (RuntimeError, ValueError) as exc:  # failed, or a survivor never stepped again
        logs = {k: (out / f"node{k}.log").read_text(errors="replace") for k in procs if k != lost}
        said = [x for text in logs.values() for x in text.splitlines() if "RuntimeError: " in x]
        why = said[-1][:200] if said else str(exc)
        kept = Path(tempfile.mkdtemp(prefix=f"tether-bench-failed-{how}-node{lost}-"))
        shutil.copytree(out, kept, dirs_exist_ok=True)
        return {"failed": f"{why} (logs, dumps and the stacks of a hang in {kept})"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stepped_again(out: Path, step: int, until: float) -> bool:
    """Wait until every survivor of a node's loss has committed ``step`` or a later one (True),
    or the monotonic time ``until`` has passed (False)."""
    while len(_past(out, step)) < NODES * PER_NODE - PER_NODE:
        if time.monotonic() > until:
            return False
        time.sleep(0.02)
    return True


def _past(out: Path, step: int) -> set[str]:
    """The ranks that have committed ``step`` or a later one."""
    return {e["who"] for e in events(out) if e["what"] == "step" and e["step"] >= step}


HOWS = ("tether", "hsdp", "torchelastic")


def nodes_main(reps: int, only: set[str], election_ms: int = ELECTION_MS) -> None:
    """``--nodes``: a whole node lost (node 2, then node 0), tether (DDP, and HSDP) against
    torchelastic; node 2's link taken down (a 2 | 1 partition), then node 2 frozen, tether.
    ``only``: the cases to run (``how:fault``; empty: all)."""
    fault = {
        "node2": (2, "kill"),
        "node0": (0, "kill"),
        "partition": (2, "partition"),
        "frozen": (2, "freeze"),
    }
    cases = [(how, f) for f in ("node2", "node0") for how in HOWS]
    cases += [("tether", "partition"), ("tether", "frozen")]
    cases = [case for case in cases if not only or ":".join(case) in only]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {case: [] for case in cases}
    for rep in range(reps):
        for how, f in cases:
            lost, what = fault[f]
            with tempfile.TemporaryDirectory(prefix=f"tether-bench-{how}-{f}-") as tmp:
                try:
                    result = node_fault(
                        Path(tmp), lost=lost, how=how, fault=what, election_ms=election_ms
                    )
                except RuntimeError as exc:
                    result = {"failed": str(exc)[:200]}
            results[(how, f)].append(result)
            print(f"rep {rep} {how} {f}: {result}", flush=True)

    def col(case: tuple[str, str], key: str) -> list[float]:
        return [float(r[key]) for r in results.get(case, []) if r.get(key) is not None]

    print(
        f"\n{NODES} simulated nodes x {PER_NODE} ranks, one etcd member each "
        f"(election timeout {election_ms} ms)"
    )
    print(
        "| fault | | tether --elastic --store etcd:// | the same, HSDP "
        "| torchelastic (c10d, --nnodes 2:3) |"
    )
    print("| --- | --- | --- | --- | --- |")
    rows = [
        ("node2", "step_s", "a step before the fault (s)"),
        ("node2", "kill_to_next_step_s", "node2 killed -> survivors' next step (s)"),
        ("node2", "etcd_leader_lost", "... runs where node2 held etcd's leader"),
        ("node2", "steps_lost", "steps lost (recomputed)"),
        ("node2", "join_to_first_step_s", "node2 started again -> its first full-world step (s)"),
        ("node2", "join_worker_to_first_step_s", "... of which from its workers' start (s)"),
        ("node2", "heal_s", "its healing over tcp (s)"),
        ("node0", "kill_to_next_step_s", "node0 killed -> survivors' next step (s)"),
        ("node0", "etcd_leader_lost", "... runs where node0 held etcd's leader"),
        ("node0", "steps_lost", "steps lost (recomputed)"),
        ("partition", "kill_to_next_step_s", "link down -> majority's next step (s)"),
        ("partition", "partition_minority_stop_s", "link down -> minority's workers stopped (s)"),
        ("partition", "partition_minority_exit_s", "... its launcher exited (s)"),
        ("frozen", "kill_to_next_step_s", "node2 frozen -> survivors' next step (s)"),
        ("frozen", "steps_lost", "steps lost (recomputed)"),
    ]
    for f, key, label in rows:
        cells = []
        for how in HOWS:
            if (how, f) not in results:
                cells.append("-")
                continue
            failed = sum("failed" in r for r in results[(how, f)])
            if key == "etcd_leader_lost":  # a count, not a time
                flags = col((how, f), key)
                cells.append(f"{int(sum(flags))} of {len(flags)}" if flags else "-")
                continue
            cells.append(spread(col((how, f), key)) + (f" ({failed} failed)" if failed else ""))
        print(f"| {f} | {label} | {' | '.join(cells)} |")
    for (how, f), runs in results.items():
        for r in runs:
            if "failed" in r:
                print(f"{how}, {f}: {r['failed']}")

    def median(case: tuple[str, str], key: str) -> float | None:
        values = col(case, key)
        return round(float(statistics.median(values)), 3) if values else None

    figures: dict[str, Any] = {}
    for how, f in cases:
        name = f"{'' if how == 'tether' else how + '_'}{f}"
        figures[f"{name}_kill_to_next_step_s"] = median((how, f), "kill_to_next_step_s")
        figures[f"{name}_steps_lost"] = median((how, f), "steps_lost")
        figures[f"{name}_failed"] = sum("failed" in r for r in results[(how, f)])
    figures["node_kill_to_next_step_s"] = figures.get("node2_kill_to_next_step_s")
    minority = median(("tether", "partition"), "partition_minority_stop_s")
    figures["partition_minority_stop_s"] = minority
    figures["partition_minority_exit_s"] = median(
        ("tether", "partition"), "partition_minority_exit_s"
    )
    figures["join_to_first_step_s"] = median(("tether", "node2"), "join_to_first_step_s")
    figures["join_worker_to_first_step_s"] = median(
        ("tether", "node2"), "join_worker_to_first_step_s"
    )
    figures["join_heal_bytes"] = median(("tether", "node2"), "heal_bytes")
    figures["join_heal_s"] = median(("tether", "node2"), "heal_s")
    figures["hsdp_join_to_first_step_s"] = median(("hsdp", "node2"), "join_to_first_step_s")
    figures["hsdp_join_heal_bytes"] = median(("hsdp", "node2"), "heal_bytes")
    figures["etcd_election_ms"] = election_ms
    figures["reps"] = reps
    print(json.dumps(figures))


def step_time(tmp: Path, name: str, cmd_flags: list[str], mode: str, *job_flags: str) -> float:
    out = tmp / name
    out.mkdir()
    steps = 60
    args = [str(WORKER), f"--mode={mode}", f"--out={out}", f"--steps={steps}", "--ckpt-every=0"]
    args += job_flags
    run_job(
        tether_cmd(*cmd_flags, f"--nproc-per-node={WORLD}", f"--dump-dir={tmp / 'dumps'}") + args,
        out,
    )
    times = sorted(e["t"] for e in events(out) if e["what"] == "step" and e["who"] == "0")
    gaps = [b - a for a, b in itertools.pairwise(times[10:])]
    return statistics.median(gaps)


def loop_cpu_pct(out: Path) -> dict[str, float]:
    """The ``tether.elastic`` loop's CPU as a percentage of the run's time, mean of the ranks:
    the training thread's inside the Manager's calls, and the heartbeat thread's."""
    costs = [e for e in events(out) if e["what"] == "loop_cost" and e.get("wall_s")]
    if not costs:
        raise RuntimeError(f"no rank reported its loop's cost in {out}")
    return {
        part: statistics.mean(100 * e[f"{part}_cpu_s"] / e["wall_s"] for e in costs)
        for part in ("main", "heartbeat")
    }


class Overhead:
    """Fault-free step times, the three ways interleaved in each repetition (a slow minute of a
    shared machine slows all three); and the elastic loop's own CPU, measured inside the job
    (the step times' difference is within this machine's noise)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {
            "plain": [],
            "heartbeat": [],
            "elastic_ddp": [],
            "elastic": [],
        }
        self.cpu: dict[str, list[float]] = {"main": [], "heartbeat": []}

    def measure(self, rep: int) -> None:
        with tempfile.TemporaryDirectory(prefix="tether-bench-overhead-") as tmp:
            self.times["plain"].append(step_time(Path(tmp), "plain", [], "plain"))
            self.times["heartbeat"].append(step_time(Path(tmp), "hb", ["--elastic"], "plain"))
            self.times["elastic_ddp"].append(
                step_time(Path(tmp), "ddp", ["--elastic"], "tether", "--no-manager")
            )
            self.times["elastic"].append(step_time(Path(tmp), "el", ["--elastic"], "tether"))
            for part, pct in loop_cpu_pct(Path(tmp, "el")).items():
                self.cpu[part].append(pct)
        print(
            f"rep {rep} step times: { {k: v[-1] for k, v in self.times.items()} }; loop CPU % "
            f"{ {k: round(v[-1], 3) for k, v in self.cpu.items()} }",
            flush=True,
        )

    def _pct(self, name: str, against: str = "plain") -> list[float]:
        pairs = zip(self.times[name], self.times[against], strict=True)
        return [100 * (t / p - 1) for t, p in pairs]

    def print(self) -> None:
        plain = statistics.median(self.times["plain"])
        print(
            f"\nstep time, fault-free: plain {plain * 1e3:.1f} ms; --elastic heartbeat alone "
            f"{spread(self._pct('heartbeat'))} %; tether's elastic DDP, no Manager "
            f"{spread(self._pct('elastic_ddp'))} %; tether.elastic loop "
            f"{spread(self._pct('elastic'))} %, which adds to the elastic DDP "
            f"{spread(self._pct('elastic', 'elastic_ddp'))} % (median [min-max] of "
            f"{len(self.times['plain'])})"
        )
        loop = [m + h for m, h in zip(self.cpu["main"], self.cpu["heartbeat"], strict=True)]
        print(
            f"the elastic loop's own CPU, % of the run's time: {spread(loop)} (training thread "
            f"in the Manager's calls {spread(self.cpu['main'])}, heartbeat thread "
            f"{spread(self.cpu['heartbeat'])})"
        )

    def figures(self) -> dict[str, float]:
        return {
            "plain_step_s": round(statistics.median(self.times["plain"]), 4),
            "heartbeat_overhead_pct": round(statistics.median(self._pct("heartbeat")), 2),
            "elastic_ddp_overhead_pct": round(statistics.median(self._pct("elastic_ddp")), 2),
            "elastic_overhead_pct": round(statistics.median(self._pct("elastic")), 2),
            "elastic_loop_overhead_pct": round(
                statistics.median(self._pct("elastic", "elastic_ddp")), 2
            ),
            "elastic_loop_cpu_pct": round(
                statistics.median(m + h for m, h in zip(*self.cpu.values(), strict=True)), 3
            ),
            "elastic_loop_main_cpu_pct": round(statistics.median(self.cpu["main"]), 3),
            "heartbeat_cpu_pct": round(statistics.median(self.cpu["heartbeat"]), 3),
        }


def overhead_main(reps: int) -> None:
    overhead = Overhead()
    for rep in range(reps):
        overhead.measure(rep)
    overhead.print()
    print(json.dumps({**overhead.figures(), "reps": reps}))


def ensure_torchft() -> None:
    """torchft 0.2.0 beside this torch (it asks for torch>=2.7: the installed one stays)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("installing torchft==0.2.0 (the release that installs beside torch 2.13)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "torchft==0.2.0"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--nodes", action="store_true", help="a whole node lost instead (root, etcd: `make etcd`)"
    )
    parser.add_argument(
        "--cases",
        default="",
        help="with --nodes, the cases to run, comma-separated how:fault (how: "
        f"{', '.join(HOWS)}; fault: node2, node0, partition, frozen); default all",
    )
    parser.add_argument(
        "--etcd-election-ms",
        type=int,
        default=ELECTION_MS,
        help=f"with --nodes, etcd's election timeout (default {ELECTION_MS}; etcd's own: 1000)",
    )
    parser.add_argument(
        "--overhead", action="store_true", help="the fault-free overhead alone (no fault, no peer)"
    )
    args = parser.parse_args()
    if args.nodes:
        nodes_main(args.reps, {c for c in args.cases.split(",") if c}, args.etcd_election_ms)
        return
    if args.overhead:
        overhead_main(args.reps)
        return
    ensure_torchft()
    results: dict[str, list[dict[str, Any]]] = {"tether": [], "torchft": [], "torchelastic": []}
    overhead = Overhead()
    runs = {"tether": tether_fault, "torchft": torchft_fault, "torchelastic": torchelastic_fault}
    for rep in range(args.reps):
        for name, run in runs.items():
            with tempfile.TemporaryDirectory(prefix=f"tether-bench-{name}-") as tmp:
                results[name].append(run(Path(tmp)))
                print(f"rep {rep} {name}: {results[name][-1]}", flush=True)
        overhead.measure(rep)

    def col(name: str, key: str) -> list[float]:
        return [r[key] for r in results[name] if r.get(key) is not None]

    print("\n| | tether --elastic | torchft 0.2 (5 s timeout) | torchelastic (--max-restarts 1) |")
    print("| --- | --- | --- | --- |")
    for key, label in (
        ("kill_to_next_step_s", "kill -> survivors' next step (s)"),
        ("steps_lost", "steps lost (recomputed)"),
        ("join_to_first_step_s", "replacement start -> first step in the full world (s)"),
    ):
        cells = [spread([float(v) for v in col(n, key)]) for n in runs]
        print(f"| {label} | {' | '.join(cells)} |")
    print(
        f"| healing (bytes, s) | {spread(col('tether', 'heal_bytes'))} B, "
        f"{spread(col('tether', 'heal_s'))} s | from a live peer | checkpoint file |"
    )
    overhead.print()

    def median(name: str, key: str) -> float | None:
        values = col(name, key)
        return round(float(statistics.median(values)), 3) if values else None

    failed = {n: sum("failed" in r for r in results[n]) for n in runs}
    for name, count in failed.items():
        if count:
            why = next(r["failed"] for r in results[name] if "failed" in r)
            print(f"{name}: the job failed to recover in {count} of {args.reps} runs: {why}")
    print(
        json.dumps(
            {
                "kill_to_next_step_s": median("tether", "kill_to_next_step_s"),
                "torchft_kill_to_next_step_s": median("torchft", "kill_to_next_step_s"),
                "torchelastic_kill_to_next_step_s": median("torchelastic", "kill_to_next_step_s"),
                "steps_lost": median("tether", "steps_lost"),
                "torchft_steps_lost": median("torchft", "steps_lost"),
                "torchelastic_steps_lost": median("torchelastic", "steps_lost"),
                "join_to_first_step_s": median("tether", "join_to_first_step_s"),
                "torchft_join_to_first_step_s": median("torchft", "join_to_first_step_s"),
                "heal_bytes": median("tether", "heal_bytes"),
                "heal_s": median("tether", "heal_s"),
                **overhead.figures(),
                "recoveries_failed": failed,
                "reps": args.reps,
            }
        )
    )


if __name__ == "__main__":
    main()
