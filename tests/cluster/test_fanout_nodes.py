"""``tether.transport.fanout`` across simulated nodes whose links run at a set rate: the
publisher on node 0 (hosting the store), a subscriber on each other node; a subscriber's link
taken down in the middle of a version and brought up again."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._jobs import until, worker_env
from tests.transport.test_fanout import LINE, WORKER
from tether.testing.nodes import SimCluster, simulated_cluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.root]

PORT = 29500
"""The store's port on node 0 (every cluster has namespaces of its own)."""
RATE = 100e6
"""Bits a second on every link: a 16 MB version takes 1.3 s a hop, time to act in the middle."""


@pytest.fixture
def three_nodes() -> Iterator[SimCluster]:
    with simulated_cluster(3) as cluster:
        for node in cluster.nodes:
            cluster.limit_rate(node, RATE)
        yield cluster


def start(
    cluster: SimCluster, tmp_path: Path, k: int, *argv: str
) -> tuple[subprocess.Popen[bytes], Path]:
    node = cluster.nodes[k]
    log = tmp_path / f"node{k}.log"
    store = f"--store={cluster.nodes[0].address}:{PORT}"
    role = (
        ["--role=publisher", "--host-store"]
        if k == 0
        else ["--role=subscriber", f"--index={k - 1}"]
    )
    argv_ = [sys.executable, str(WORKER), store, f"--host={node.address}", *role, *argv]
    with log.open("wb") as sink:
        proc = cluster.start(node, argv_, env=worker_env(), stdout=sink, stderr=subprocess.STDOUT)
    return proc, log


def test_a_link_down_mid_version_is_gone_round_and_its_node_catches_up_once_up(
    three_nodes: SimCluster, tmp_path: Path
) -> None:
    cluster, mark = three_nodes, tmp_path / "mark"
    common = ("--subscribers=2", "--mb=16", "--io-timeout=2", "--timeout=60")
    runs = [start(cluster, tmp_path, 0, *common)]
    runs.append(
        start(cluster, tmp_path, 1, *common, "--mark-at=8", f"--mark-file={mark}", "--retries=5")
    )
    runs.append(start(cluster, tmp_path, 2, *common))
    logs = [log for _, log in runs]
    until(mark.exists, "subscriber 0 never got half way through version 2", timeout=60)
    cluster.link_down(cluster.nodes[1])
    try:
        # Subscriber 1 stops hearing from subscriber 0, goes round it to the publisher, and
        # has version 2 whole while subscriber 0 is still cut off.
        until(
            lambda: "subscriber 1 version 2 " in logs[2].read_text(),
            "subscriber 1 did not get version 2 round the cut link",
            timeout=30,
        )
    finally:
        cluster.link_up(cluster.nodes[1])
    for proc, log in runs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name} still runs:\n{log.read_text()}")
    texts = [log.read_text() for log in logs]
    digests = {role_index: {} for role_index in ("publisher 0", "subscriber 0", "subscriber 1")}
    for text in texts:
        for role, index, version, digest in LINE.findall(text):
            digests[f"{role} {index}"][int(version)] = digest
    assert sorted(digests["publisher 0"]) == [1, 2], texts[0]
    for who in ("subscriber 0", "subscriber 1"):
        assert digests[who] == digests["publisher 0"], texts
    assert "cannot pull from subscriber 0" in texts[2]
    # Cut off, subscriber 0's pull failed with its tensors whole at version 1, then it caught up.
    failed = re.search(r"subscriber 0 failed: (\w+): .*\nsubscriber 0 holds sha256 (\w+)", texts[1])
    assert failed and failed[2] == digests["publisher 0"][1], texts[1]
    assert [proc.returncode for proc, _ in runs] == [0, 0, 0], texts
