"""``tether.transport.fanout`` across simulated nodes whose links run at a set rate: the
publisher on node 0 (hosting the store), a subscriber on each other node; a subscriber's link
taken down in the middle of a version and brought up again."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests._jobs import REPO, until, worker_env
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
    texts = finish(runs)
    digests = by_side(texts)
    assert sorted(digests["publisher 0"]) == [1, 2], texts[0]
    for who in ("subscriber 0", "subscriber 1"):
        assert digests[who] == digests["publisher 0"], texts
    assert "cannot pull from subscriber 0" in texts[2]
    # Cut off, subscriber 0's pull failed with its tensors whole at version 1, then it caught up.
    failed = re.search(r"subscriber 0 failed: (\w+): .*\nsubscriber 0 holds sha256 (\w+)", texts[1])
    assert failed and failed[2] == digests["publisher 0"][1], texts[1]
    assert [proc.returncode for proc, _ in runs] == [0, 0, 0], texts


def test_a_version_published_mid_pull_replaces_it_and_no_pull_mixes_two(
    three_nodes: SimCluster, tmp_path: Path
) -> None:
    """The publisher publishes each next version while subscriber 0 is 4 chunks into the one
    before (a version takes 1.3 s a hop here): pulls are superseded, none returns a mix."""
    runs = chain(three_nodes, tmp_path, "--versions=4", "--supersede")
    texts = finish(runs)
    digests = by_side(texts)
    published = digests["publisher 0"]
    assert sorted(published) == [1, 2, 3, 4], texts[0]
    for k, text in ((0, texts[1]), (1, texts[2])):
        pulled = digests[f"subscriber {k}"]
        assert max(pulled) == 4, text
        # Whatever versions a subscriber got, each is one version whole, never a mix.
        assert all(published[v] == digest for v, digest in pulled.items()), text
    superseded = re.search(r"subscriber 0 superseded (\d+)", texts[1])
    assert superseded and int(superseded[1]) >= 1, texts[1]  # published under its pull
    assert [proc.returncode for proc, _ in runs] == [0, 0, 0], texts


@pytest.mark.slow
def test_a_subscriber_killed_mid_read_costs_the_others_nothing(
    three_nodes: SimCluster, tmp_path: Path
) -> None:
    """Subscriber 0 (node 1, first in the chain) killed in the middle of version 2: subscriber 1
    goes round it to the publisher, and has every version."""
    runs = chain(three_nodes, tmp_path, first=["--die-at-chunk=8"])
    texts = finish(runs)
    died = re.search(r"subscriber 0 dies holding (\d+) of (\d+)", texts[1])
    assert died and int(died[1]) < int(died[2]), texts[1]
    digests = by_side(texts)
    assert sorted(digests["publisher 0"]) == [1, 2], texts[0]
    assert digests["subscriber 1"] == digests["publisher 0"], texts[2]
    assert "cannot pull from subscriber 0" in texts[2], texts[2]
    assert [runs[0][0].returncode, runs[2][0].returncode] == [0, 0], texts


@pytest.mark.slow
def test_the_publisher_killed_mid_version_no_subscriber_returns_it(
    three_nodes: SimCluster, tmp_path: Path
) -> None:
    runs = chain(three_nodes, tmp_path, first=["--kill-publisher-at=8"])
    texts = finish(runs)
    assert "publisher killed at" in texts[1], texts
    first = by_side(texts)["publisher 0"][1]
    for k, text in ((0, texts[1]), (1, texts[2])):
        assert by_side([text])[f"subscriber {k}"] == {1: first}, text
        assert re.search(rf"subscriber {k} failed: PeerDiedError: .*the publisher", text), text
        assert f"subscriber {k} holds sha256 {first}" in text, text  # version 1, whole
    assert [proc.returncode for proc, _ in runs[1:]] == [3, 3], texts


@pytest.mark.slow
def test_the_weight_sync_example_across_nodes(three_nodes: SimCluster, tmp_path: Path) -> None:
    example = str(REPO / "examples" / "weight_sync.py")
    store = f"{three_nodes.nodes[0].address}:{PORT}"
    procs = []
    for k, node in enumerate(three_nodes.nodes):
        role = (
            ["--role=trainer", "--host-store"]
            if k == 0
            else ["--role=inference", f"--index={k - 1}"]
        )
        argv = [sys.executable, example, *role, "--hosts=2", "--steps=3", f"--store={store}"]
        log = tmp_path / f"node{k}.log"
        with log.open("wb") as sink:
            proc = three_nodes.start(
                node, [*argv, f"--host={node.address}"], env=worker_env(), stdout=sink,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs.append((proc, log))
    texts = finish(procs)
    seen: dict[int, dict[int, str]] = {}
    for text in texts:
        for rank, step, sha in re.findall(r"rank (\d) step (\d+) sha256 (\w+)", text):
            seen.setdefault(int(step), {})[int(rank)] = sha
    assert sorted(seen) == [1, 2, 3], texts
    for by_rank in seen.values():
        assert sorted(by_rank) == [0, 1, 2] and len(set(by_rank.values())) == 1, texts


def chain(
    cluster: SimCluster, tmp_path: Path, *extra: str, first: Sequence[str] = ()
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """The publisher on node 0 and a subscriber on each other node, 16 MB versions; ``first``:
    subscriber 0's own flags."""
    common = ("--subscribers=2", "--mb=16", "--timeout=60", *extra)
    return [start(cluster, tmp_path, k, *common, *(first if k == 1 else ())) for k in range(3)]


def finish(runs: list[tuple[subprocess.Popen[bytes], Path]]) -> list[str]:
    """Every process's log once all have exited (one still running after 60 s fails)."""
    for proc, log in runs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name} still runs:\n{log.read_text()}")
    return [log.read_text() for _, log in runs]


def by_side(texts: list[str]) -> dict[str, dict[int, str]]:
    """``role index`` -> version -> digest, from the sides' lines."""
    digests: dict[str, dict[int, str]] = {}
    for text in texts:
        for role, index, version, digest in LINE.findall(text):
            digests.setdefault(f"{role} {index}", {})[int(version)] = digest
    return digests
