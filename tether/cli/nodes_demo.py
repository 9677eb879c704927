"""``tether demo --nodes N``: the demo's job across N simulated nodes (network namespaces on one
machine, each with its own hostname, address and dump directory), ``tether run`` on each node as
on a cluster; the event is read from node 0's directory alone. Needs root."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tether._exceptions import ClusterUnavailableError
from tether.analyze import Diagnosis, analyze, render
from tether.events.load import load_event
from tether.testing.nodes import IFNAME, SimCluster

__all__ = ["nodes_demo"]

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
    root = Path(args.dump_dir).resolve()
    cluster = SimCluster(nodes, root=root)
    try:
        cluster.build()
    except ClusterUnavailableError as exc:
        print(f"tether demo: --nodes cannot run here: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        codes = _run(cluster, args, per_node)
        head = cluster.nodes[0].dump_dir
        events = sorted(p for p in head.iterdir() if p.is_dir() and not p.name.startswith("."))
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
            target=_echo, args=(proc.stdout, node.hostname), name="tether-demo-output", daemon=True
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


def _echo(stream: IO[bytes], hostname: str) -> None:
    """Each node's launcher output, its lines marked with the node (torch's own log left out)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        if line and not _TORCH_LOG.match(line) and not line.startswith("[rank"):
            print(f"[{hostname}] {line}", flush=True)
