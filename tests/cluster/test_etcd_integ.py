"""The job's store on a real 3-member etcd cluster, one member per simulated node: it outlives
any one node (node 0 included), a member that restarts rejoins, and a node cut off from the
majority can decide nothing (its calls fail, bounded and typed) while the majority goes on.

These tests need root (network namespaces) and Debian's etcd (``make`` installs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests._jobs import WORKERS, worker_env
from tether.testing.etcd import EtcdCluster
from tether.testing.nodes import Node

pytestmark = [pytest.mark.timeout(120), pytest.mark.root]

CLIENT = str(WORKERS / "etcd_client.py")


def _start(etcd: EtcdCluster, node: Node, prefix: str, *op: str, timeout: float = 5.0) -> Any:
    assert etcd.nodes is not None
    return etcd.nodes.start(
        node, [sys.executable, CLIENT, etcd.url, prefix, str(timeout), *op],
        env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _result(proc: Any, timeout: float = 60.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    assert lines, f"the client printed nothing (exit {proc.returncode}):\n{err[-2000:]}"
    return dict(json.loads(lines[-1]))


def _run(etcd: EtcdCluster, node: Node, prefix: str, *op: str, timeout: float = 5.0) -> Any:
    return _result(_start(etcd, node, prefix, *op, timeout=timeout))


@pytest.mark.slow
def test_a_group_forms_through_etcd_across_nodes_with_node_0_lost(etcd: EtcdCluster) -> None:
    assert etcd.nodes is not None
    nodes = etcd.nodes.nodes
    etcd.nodes.kill(nodes[0])  # node 0 whole: its etcd member (the first endpoint) with it
    procs = [_start(etcd, n, "/job-a/", "group", str(i), "2") for i, n in enumerate(nodes[1:])]
    results = [_result(p) for p in procs]
    assert [r.get("ok") for r in results] == [1.0, 1.0], results


def test_a_partitioned_node_decides_nothing_and_the_majority_goes_on(etcd: EtcdCluster) -> None:
    assert etcd.nodes is not None
    nodes = etcd.nodes.nodes
    etcd.nodes.link_down(nodes[2])
    try:
        # Both sides try to decide the same step's outcome at once.
        minority = _start(etcd, nodes[2], "/job-b/", "cas", "step/7", "", "minority", timeout=3)
        majority = _run(etcd, nodes[0], "/job-b/", "cas", "step/7", "", "majority")
        lost = _result(minority)
    finally:
        etcd.nodes.link_up(nodes[2])
    assert majority.get("ok") == "majority", majority
    assert lost.get("error") == "StoreUnreachableError", lost
    # It gave up at its own deadline (3 s), not at a test's timeout.
    assert "did not compare and set a key within 3s" in lost["text"], lost
    assert "no member reachable from this host has a quorum" in lost["text"], lost
    # Healed, the node that was cut off reads the majority's decision, and cannot overwrite it.
    etcd.wait_healthy(etcd.members)
    assert _run(etcd, nodes[2], "/job-b/", "get", "step/7").get("ok") == "majority"
    again = _run(etcd, nodes[2], "/job-b/", "cas", "step/7", "", "minority")
    assert again.get("ok") == "majority", again


@pytest.mark.slow
def test_a_member_that_restarts_rejoins_and_catches_up(etcd: EtcdCluster) -> None:
    assert etcd.nodes is not None
    nodes = etcd.nodes.nodes
    member = etcd.members[1]
    etcd.kill(member)
    written = _run(etcd, nodes[1], "/job-c/", "cas", "decision/1", "", "ranks 0-3")
    assert written.get("ok") == "ranks 0-3", written
    etcd.restart(member)
    # The restarted member alone (the others down) would have no quorum: ask it while all run,
    # through an address list that names it alone.
    alone = EtcdCluster([member], nodes=etcd.nodes, root=etcd.root)
    read = _start(alone, nodes[1], "/job-c/", "get", "decision/1")
    assert _result(read).get("ok") == "ranks 0-3"
