"""``tether demo --nodes N``: the demo's job across N simulated nodes (network namespaces on one
machine, each with its own hostname, address and dump directory), ``tether run`` on each node as
on a cluster; the event is read from node 0's directory alone. ``tether demo --fault node
--elastic``: the elastic job on three such nodes with an etcd member on each; one node is killed
whole and started again on an empty disk. Needs root."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from tether._exceptions import ClusterUnavailableError
from tether.analyze import Diagnosis, analyze, render
from tether.events.layout import elastic_timeline_file
from tether.events.load import load_event
from tether.job.nodes import span
from tether.testing.nodes import IFNAME, Node, SimCluster

__all__ = ["elastic_nodes_demo", "nodes_demo"]

MASTER_PORT = 29500
_TORCH_LOG = re.compile(r"^\[?[WIE]\d{4} ")
"""torch's glog lines (warnings about hostnames, the agent's own failure lines): not the demo's."""
_LAUNCHER_TIMEOUT_S = 180.0


def nodes_demo(args: argparse.Namespace, judge: Callable[[Diagnosis, str, int], str]) -> int:
    """Run it; ``judge`` says whether the diagnosis names the injected fault ("ok: ...")."""
    nodes, world = args.nodes, args.world_size
    if world % nodes:
        print(f"tether demo: --world-size {world} does not split evenly over {nodes} nodes")
        return 2
    per_node = world // nodes
    host = args.culprit // per_node
    print(
        f"tether demo: {world} ranks on {nodes} simulated nodes ({per_node} each: network "
        f"namespaces with their own hostname, address and dump directory; gloo on {IFNAME}); "
        f"rank {args.culprit} on node{host}: {args.fault} at step {args.fault_step}; "
        f"hang timeout {args.hang_timeout:g}s",
        flush=True,
    )
    cluster = _build(nodes, args.dump_dir, "--nodes")
    if cluster is None:
        return 2
    started = time.monotonic()
    try:
        codes = _run(cluster, args, per_node)
        head = cluster.nodes[0].dump_dir
        events = _events(head)
        if not events:
            print(f"tether demo: the job ended (exits {codes}) and no event is on node0")
            return 1
        event = events[-1]
        dumps, _ = load_event(event)
        print(
            f"\nthe job ended with exits {codes}; {len(dumps)} of {world} ranks' dumps in node0's "
            f"directory {event} in {time.monotonic() - started:.1f}s",
            flush=True,
        )
        diagnosis: Diagnosis = analyze(event)
        print(f"\n$ tether analyze {event}\n{render(diagnosis)}", flush=True)
        verdict = judge(diagnosis, args.fault, args.culprit)
        where = diagnosis.hosts.get(args.culprit)
        on = f"; rank {args.culprit} ran on {where}" if where else ""
        print(f"\ntether demo: {verdict}{on}", flush=True)
        return 0 if verdict.startswith("ok") else 1
    finally:
        cluster.close()


def _build(nodes: int, dump_dir: str, option: str) -> SimCluster | None:
    """``nodes`` simulated nodes, their disks under ``dump_dir``; None (said why) where this
    machine cannot make them (no root, no ``ip``)."""
    cluster = SimCluster(nodes, root=Path(dump_dir).resolve())
    try:
        cluster.build()
    except ClusterUnavailableError as exc:
        print(f"tether demo: {option} cannot run here: {exc}", file=sys.stderr)
        return None
    return cluster


def _run(cluster: SimCluster, args: argparse.Namespace, per_node: int) -> list[int]:
    head = cluster.nodes[0]
    procs, pumps = [], []
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "tether.cli.main", "run",
            f"--nnodes={len(cluster.nodes)}", f"--node-rank={node.index}",
            f"--master-addr={head.address}", f"--master-port={MASTER_PORT}",
            f"--nproc-per-node={per_node}", f"--dump-dir={node.dump_dir}",
            f"--hang-timeout={args.hang_timeout}",
            "-m", "tether.demo.job", f"--steps={args.steps}", f"--fault={args.fault}",
            f"--culprit={args.culprit}", f"--fault-step={args.fault_step}",
        ]  # fmt: skip
        proc = cluster.start(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        assert proc.stdout is not None
        pump = threading.Thread(
            target=_echo, args=(proc.stdout, node), name="tether-demo-output", daemon=True
        )
        pump.start()
        pumps.append(pump)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=_LAUNCHER_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            codes.append(-1)  # the cluster's teardown kills it
    for pump in pumps:
        pump.join(timeout=5)
    return codes


def _echo(stream: IO[bytes], node: Node, heard: Callable[[str], None] | None = None) -> None:
    """Each node's launcher output, its lines marked with the node (torch's own log and the
    workers' lines left out: all of it is in the node's ``launcher.log``); ``heard``: told each
    line shown."""
    with open(node.dump_dir.parent / "launcher.log", "ab") as log:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            line = raw.decode(errors="replace").rstrip()
            if line and not _TORCH_LOG.match(line) and not line.startswith("[rank"):
                print(f"[{node.hostname}] {line}", flush=True)
                if heard is not None:
                    heard(line)


PER_NODE = 2
"""Ranks per node in the elastic demo."""
_STEP_WAIT_S = 120.0
"""The longest the demo waits for the job to reach a stage (every rank at the fault's step, the
node declared lost): a launcher's start, torch's imports and the group's formation come first."""


def elastic_nodes_demo(args: argparse.Namespace) -> int:
    """Kill the node of ``--culprit`` whole once every rank reached ``--fault-step``, start it
    again once the others have dropped it, and check the job's losses and replicas."""
    from tether.cli.elastic_demo import check
    from tether.demo.elastic_job import GLOBAL_BATCH
    from tether.testing.etcd import etcd_on_nodes

    count = max(args.nodes, 3)  # an etcd majority survives one node
    world, lost = count * PER_NODE, args.culprit // PER_NODE
    if GLOBAL_BATCH % world or GLOBAL_BATCH % (world - PER_NODE):
        print(f"tether demo: a global batch of {GLOBAL_BATCH} has no equal shards on {count} nodes")
        return 2
    if lost == 0:
        print(
            "tether demo: node0 (ranks 0-1) runs torchrun's own store, which a replacement node0 "
            "cannot take back; name a rank of another node with --culprit"
        )
        return 2
    print(
        f"tether demo: {world} ranks on {count} simulated nodes ({PER_NODE} each, an etcd member "
        f"on each) under `tether run --elastic --store etcd://...`: DDP training on a global "
        f"batch of {GLOBAL_BATCH} re-sharded over the ranks alive; node{lost} is killed whole at "
        f"step {args.fault_step}, then started again on an empty disk",
        flush=True,
    )
    cluster = _build(count, args.dump_dir, "--fault node")
    if cluster is None:
        return 2
    started = time.monotonic()
    try:
        with etcd_on_nodes(cluster) as etcd, tempfile.TemporaryDirectory(prefix="tether-") as tmp:
            out, progress = Path(tmp, "out"), Path(tmp, "progress")
            out.mkdir()
            progress.mkdir()
            dropped = threading.Event()

            def heard(line: str) -> None:
                if "declared dead" in line:
                    dropped.set()

            def launch(node: Node) -> subprocess.Popen[bytes]:
                argv = [
                    sys.executable, "-m", "tether.cli.main", "run", "--elastic",
                    f"--store={etcd.url}", f"--nnodes={count}", f"--node-rank={node.index}",
                    f"--master-addr={cluster.nodes[0].address}", f"--master-port={MASTER_PORT}",
                    f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.1",
                    f"--dump-dir={node.dump_dir}",
                    "-m", "tether.demo.elastic_job", f"--out={out}", f"--steps={args.steps}",
                    "--culprit=-1", f"--fault-step={args.fault_step}", f"--progress-dir={progress}",
                ]  # fmt: skip
                proc = cluster.start(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                assert proc.stdout is not None
                threading.Thread(
                    target=_echo,
                    args=(proc.stdout, node, heard),
                    name="tether-demo-output",
                    daemon=True,
                ).start()
                return proc

            procs = {node.index: launch(node) for node in cluster.nodes}
            victim = cluster.nodes[lost]
            if not _until(lambda: len(list(progress.iterdir())) >= world, procs.values()):
                print(f"tether demo: the job did not reach step {args.fault_step}")
                return 1
            cluster.kill(victim)
            print(
                f"\n[demo] {victim.hostname} killed at step {args.fault_step}: its launcher, its "
                f"{PER_NODE} workers and its etcd member\n",
                flush=True,
            )
            if not _until(dropped.is_set, [p for k, p in procs.items() if k != lost]):
                print(f"tether demo: {victim.hostname} was never declared lost")
                return 1
            shutil.rmtree(victim.dump_dir, ignore_errors=True)  # a fresh host's disk
            victim.dump_dir.mkdir(parents=True)
            print(
                f"\n[demo] {victim.hostname} started again on an empty disk: the same "
                f"`tether run ... --node-rank {lost}`\n",
                flush=True,
            )
            procs[lost] = launch(victim)
            codes = [_wait(p) for p in procs.values()]
            outputs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
        took = time.monotonic() - started
        print(f"\nthe job ended with exits {codes} in {took:.1f}s", flush=True)
        head = cluster.nodes[0].dump_dir
        events = [e for e in _events(head) if elastic_timeline_file(e).exists()]
        problems = [] if events else ["no event with the job's elastic timeline is on node0"]
        if events:
            print(f"\n$ tether analyze {events[-1]}\n{render(analyze(events[-1]))}", flush=True)
        ranks = list(range(lost * PER_NODE, (lost + 1) * PER_NODE))
        problems += check(outputs, world, ranks, f"{victim.hostname} ({span(ranks)}) was lost")
        if any(codes):
            problems.insert(0, f"a launcher exited non-zero ({codes})")
        if problems:
            logs = ", ".join(str(n.dump_dir.parent / "launcher.log") for n in cluster.nodes)
            print(f"\ntether demo: MISMATCH: {'; '.join(problems)} (every line: {logs})")
            return 1
        return 0
    finally:
        cluster.close()


def _until(done: Callable[[], bool], procs: Iterable[subprocess.Popen[bytes]]) -> bool:
    """Wait for ``done()`` while every one of ``procs`` runs (bounded); whether it came."""
    deadline = time.monotonic() + _STEP_WAIT_S
    while not done():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.05)
    return True


def _wait(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=_LAUNCHER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1  # the cluster's teardown kills it


def _events(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
