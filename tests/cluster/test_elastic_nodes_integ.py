"""`tether run --elastic --store etcd://...` across simulated nodes, one etcd member on each: the
job's membership decisions, heartbeats and regroups go through etcd, and the training must still
commit every step once, equal to a single-process run of the same global batch, with every
replica identical at the end (tests/workers/elastic_train.py; the checks are the one-host
elastic tests').

These tests need root (network namespaces) and Debian's etcd (``make etcd``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._cluster import MASTER_PORT
from tests._elastic import Run, check_training
from tests._jobs import WORKERS, worker_env
from tether.testing.etcd import EtcdCluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.root]

PER_NODE = 2
JOB_TIMEOUT_S = 180.0


def run_on_nodes(
    etcd: EtcdCluster, tmp_path: Path, *worker_args: str, lose: int | None = None
) -> Run:
    """The elastic training job on every node (PER_NODE ranks each), to its end; ``lose``: the
    node killed whole (launcher, workers, etcd member) once every rank has taken a step."""
    nodes = etcd.nodes
    assert nodes is not None
    out, ready = tmp_path / "out", tmp_path / "ready"
    out.mkdir()
    ready.mkdir()
    head = nodes.nodes[0]
    procs, logs = [], []
    for node in nodes.nodes:
        log = tmp_path / f"launcher-{node.hostname}.log"
        argv = [
            sys.executable, "-m", "tether.cli.main", "run", "--elastic",
            f"--nnodes={len(nodes.nodes)}", f"--node-rank={node.index}",
            f"--master-addr={head.address}", f"--master-port={MASTER_PORT}",
            f"--nproc-per-node={PER_NODE}", "--monitor-interval=0.1",
            f"--dump-dir={node.dump_dir}", f"--store={etcd.url}",
            str(WORKERS / "elastic_train.py"), f"--out={out}", f"--ready-dir={ready}",
            "--step-sleep=0.01", *worker_args,
        ]  # fmt: skip
        with open(log, "wb") as sink:
            procs.append(
                nodes.start(node, argv, env=worker_env(), stdout=sink, stderr=subprocess.STDOUT)
            )
        logs.append(log)

    def log() -> str:
        return "\n".join(
            f"--- {n.hostname}\n{lg.read_text(errors='replace')}"
            for n, lg in zip(nodes.nodes, logs, strict=True)
        )

    if lose is not None:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < PER_NODE * len(nodes.nodes):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log()
            time.sleep(0.05)
        nodes.kill(nodes.nodes[lose])
    codes = [p.wait(timeout=JOB_TIMEOUT_S) for k, p in enumerate(procs) if k != lose]
    outputs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return Run(max(codes, key=abs), log(), outputs, head.dump_dir)


@pytest.mark.slow
def test_a_rank_dying_on_one_node_is_survived_across_nodes(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    world = PER_NODE * 3
    result = run_on_nodes(
        etcd, tmp_path, "--steps=8", f"--until-world={world}", "--fault=3:3:SIGKILL"
    )
    check_training(result, members=set(range(world)))
    assert "rank 3 (signal SIGKILL) declared dead; epoch 1: 5 rank(s) [0, 1, 2, 4, 5]" in result.log
    assert (3, 1) in result.by_rank(), "the replacement on node1 did not finish"


@pytest.mark.parametrize(
    "lost", [pytest.param(2, marks=pytest.mark.slow), 0], ids=["node2", "node0"]
)
def test_a_lost_node_is_dropped_whole_and_the_others_go_on(
    etcd: EtcdCluster, tmp_path: Path, lost: int
) -> None:
    # Node 0 hosts torchrun's store and an etcd member: the job must not need either.
    result = run_on_nodes(etcd, tmp_path, "--steps=8", "--until-epoch=1", lose=lost)
    ranks = {lost * PER_NODE + i for i in range(PER_NODE)}
    survivors = set(range(PER_NODE * 3)) - ranks
    check_training(result, members=survivors)
    host = f"node{lost}"
    assert f"{host} (ranks {min(ranks)}-{max(ranks)}) lost: its lease expired" in result.log
    declared = ", ".join(f"rank {r} ({host} lost)" for r in sorted(ranks))
    members = sorted(survivors)
    assert f"{declared} declared dead; epoch 1: 4 rank(s) {members}" in result.log, result.log
