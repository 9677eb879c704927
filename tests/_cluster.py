"""Jobs on simulated nodes (:mod:`tether.testing.nodes`): ``tether run`` on every node, as a user
runs it on a cluster, and what each node's launcher said and left on its disk."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests._jobs import WORKERS, worker_env
from tether.testing.nodes import Node, SimCluster

MASTER_PORT = 29500
"""Node 0's store port: every cluster has namespaces of its own, so no two runs collide."""
JOB = str(WORKERS / "cluster_job.py")


@dataclasses.dataclass
class ClusterJob:
    cluster: SimCluster
    procs: list[subprocess.Popen[Any]]
    logs: list[Path]
    ready: Path

    def wait(self, timeout: float) -> list[int]:
        """Every launcher's exit status (a launcher still running after ``timeout`` fails the
        test; the cluster's teardown kills it)."""
        deadline = time.monotonic() + timeout
        codes = []
        for k, proc in enumerate(self.procs):
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"node{k}'s launcher still runs after {timeout:g}s:\n{self.output(k)}"
                ) from None
        return codes

    def output(self, k: int) -> str:
        return self.logs[k].read_text(errors="replace")

    def wait_ready(self, world: int, timeout: float = 60.0) -> None:
        """Until every rank has finished its first step."""
        deadline = time.monotonic() + timeout
        while len(list(self.ready.glob("ready_*"))) < world:
            dead = [k for k, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                outs = "\n".join(f"--- node{k}\n{self.output(k)}" for k in range(len(self.procs)))
                raise AssertionError(f"the job did not start on every node:\n{outs}")
            time.sleep(0.05)

    def lose_node(self, k: int, *, world: int, timeout: float = 90.0) -> list[int]:
        """Once every rank runs, kill node ``k`` whole (launcher and workers); every launcher's
        exit status."""
        self.wait_ready(world)
        self.cluster.kill(self.cluster.nodes[k])
        return self.wait(timeout)

    def wait_said(self, k: int, text: str, timeout: float = 60.0) -> None:
        """Until node k's launcher has said ``text`` (bounded)."""
        deadline = time.monotonic() + timeout
        while text not in self.output(k):
            if time.monotonic() > deadline or self.procs[k].poll() is not None:
                raise AssertionError(f"node{k} never said {text!r}:\n{self.output(k)}")
            time.sleep(0.05)

    def events(self, node: Node) -> list[Path]:
        root = node.dump_dir
        return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def start_job(
    cluster: SimCluster,
    *,
    per_node: int = 2,
    fault: str = "none",
    culprit: int = -1,
    fault_step: int = 3,
    steps: int = 10,
    hang_timeout: float = 3.0,
    extra: tuple[str, ...] = (),
) -> ClusterJob:
    ready = cluster.root / "ready"
    ready.mkdir(exist_ok=True)
    head = cluster.nodes[0]
    procs, logs = [], []
    for node in cluster.nodes:
        log = cluster.root / f"launcher-{node.hostname}.log"
        argv = [
            sys.executable, "-m", "tether.cli.main", "run",
            f"--nnodes={len(cluster.nodes)}", f"--node-rank={node.index}",
            f"--master-addr={head.address}", f"--master-port={MASTER_PORT}",
            f"--nproc-per-node={per_node}", "--monitor-interval=0.1",
            f"--dump-dir={node.dump_dir}", f"--hang-timeout={hang_timeout}", *extra,
            JOB, f"--steps={steps}", f"--fault={fault}", f"--culprit={culprit}",
            f"--fault-step={fault_step}", f"--ready={ready}",
        ]  # fmt: skip
        with open(log, "wb") as out:
            procs.append(
                cluster.start(node, argv, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)
            )
        logs.append(log)
    return ClusterJob(cluster, procs, logs, ready)
