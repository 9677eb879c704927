"""Jobs across simulated nodes: one network namespace per node, each with its own hostname,
address and dump directory (its local disk), ``tether run`` on each as a user runs it on a
cluster. Faults are injected at node level; every event must be whole in node 0's directory and
its verdict name the culprit and its host.

These tests need root (network namespaces): without it they fail, saying so.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests._cluster import ClusterJob, start_job
from tests._jobs import until
from tether.analyze import analyze
from tether.events.layout import rank_file
from tether.job.alarm import HANG_EXIT_CODE
from tether.launcher.stackread import proc_state
from tether.testing.nodes import SimCluster, simulated_cluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.root]


@pytest.fixture
def two_nodes() -> Iterator[SimCluster]:
    with simulated_cluster(2) as cluster:
        yield cluster


@pytest.fixture
def three_nodes() -> Iterator[SimCluster]:
    with simulated_cluster(3) as cluster:
        yield cluster


def _whole(job: ClusterJob, event_id: str, world: int) -> None:
    head = job.cluster.nodes[0].dump_dir / event_id
    missing = [r for r in range(world) if not rank_file(head, r).exists()]
    assert not missing, f"ranks {missing} missing from node 0's event:\n{job.output(0)}"


@pytest.mark.slow
def test_a_hang_on_the_second_node_is_whole_on_the_first_and_names_the_host(
    two_nodes: SimCluster,
) -> None:
    job = start_job(two_nodes, fault="hang", culprit=3)
    codes = job.wait(120)
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], job.output(0) + job.output(1)
    [event] = job.events(two_nodes.nodes[0])
    _whole(job, event.name, 4)
    head = job.output(0)
    assert f"4 of 4 ranks' dumps in {event}; ranks 2-3 from node1" in head, head
    # Node 1 says what it holds and where the whole event is; its last line points there.
    tail = job.output(1)
    assert f"ranks 2-3 dumped into {two_nodes.nodes[1].dump_dir / event.name}" in tail, tail
    assert f"the whole event on node0 (10.97.0.1): {event}" in tail, tail
    # The aborting ranks there count what is where too, never "every rank's dump is in" a
    # directory that holds half of them.
    assert "every rank's dump is in" not in tail, tail
    assert f"ranks dumped, this node's (ranks 2-3) into {two_nodes.nodes[1].dump_dir}" in tail
    d = analyze(event)
    assert (d.verdict, d.culprit_ranks) == ("hang", [3]), d.evidence
    assert d.hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    assert "cluster_job.py" in d.culprit_stacks[3]


@pytest.mark.slow
def test_a_desync_across_three_nodes(three_nodes: SimCluster) -> None:
    job = start_job(three_nodes, per_node=1, fault="desync", culprit=2)
    job.wait(120)
    events = job.events(three_nodes.nodes[0])
    assert events, job.output(0)
    event = events[-1]
    _whole(job, event.name, 3)
    d = analyze(event)
    assert (d.verdict, d.culprit_ranks) == ("desync", [2]), d.evidence
    assert d.hosts[2] == "node2"
    assert "cluster_job.py" in d.culprit_stacks[2]


def test_a_lost_node_is_named_with_its_ranks_and_the_survivors_dump(
    two_nodes: SimCluster,
) -> None:
    job = start_job(two_nodes, steps=1_000_000)
    code = job.lose_node(1, world=4)[0]
    assert code == 1, job.output(0)
    [event] = job.events(two_nodes.nodes[0])
    head = job.output(0)
    assert "node1 (ranks 2-3) lost at " in head.splitlines()[-1], head
    assert rank_file(event, 0).exists() and rank_file(event, 1).exists(), head
    d = analyze(event)
    assert d.verdict == "node_lost", d.evidence
    assert d.culprit_ranks == [2, 3]
    assert [(n.host, n.state, n.ranks) for n in d.nodes] == [("node1", "lost", [2, 3])]
    assert set(d.consequences) == {0, 1}  # they failed, or waited, because of it


@pytest.mark.slow
def test_a_nodes_tether_run_killed_its_ranks_stop_saying_so_and_the_node_is_lost(
    two_nodes: SimCluster,
) -> None:
    job = start_job(two_nodes, steps=1_000_000)
    job.wait_ready(4)
    node1 = [int((job.ready / f"ready_{r}").read_text()) for r in (2, 3)]
    job.procs[1].kill()  # SIGKILL: the OOM killer, an operator's kill -9
    assert job.wait(90)[0] == 1, job.output(0)
    until(lambda: not any(map(_alive, node1)), "node 1's ranks outlived their agent")
    tail = job.output(1)
    for rank in (2, 3):
        assert f"[rank {rank}] tether: this node's tether run is gone" in tail, tail
    [event] = job.events(two_nodes.nodes[0])
    d = analyze(event)
    assert d.verdict == "node_lost", d.evidence
    assert [(n.host, n.ranks) for n in d.nodes] == [("node1", [2, 3])]


def _alive(pid: int) -> bool:
    return proc_state(pid).state not in (None, "zombie")  # a zombie has exited


@pytest.mark.slow
def test_a_lost_node_of_three_leaves_the_others_whole_on_node_0(
    three_nodes: SimCluster,
) -> None:
    job = start_job(three_nodes, per_node=1, steps=1_000_000)
    codes = job.lose_node(2, world=3)
    assert codes[:2] == [1, 1], job.output(0) + job.output(1)
    [event] = job.events(three_nodes.nodes[0])
    _whole(job, event.name, 2)  # node 1's survivor's dump came over the network
    d = analyze(event)
    assert d.verdict == "node_lost", d.evidence
    assert [(n.host, n.ranks) for n in d.nodes] == [("node2", [2])]
    assert d.hosts[1] == "node1"


@pytest.mark.slow
def test_a_link_down_is_a_partition_and_the_halves_join_when_it_comes_back(
    two_nodes: SimCluster,
) -> None:
    job = start_job(two_nodes, steps=1_000_000, hang_timeout=30.0)
    job.wait_ready(4)
    two_nodes.link_down(two_nodes.nodes[1])
    # Each side says which peer it cannot reach, then the link comes back.
    job.wait_said(0, "node1 (ranks 2-3) unreachable at ")
    job.wait_said(1, "node1 (ranks 2-3) cut off from the job's store at ")
    assert "cannot reach: node0 (unreachable)" in job.output(1)
    two_nodes.link_up(two_nodes.nodes[1])
    assert job.wait(90) == [1, 1], job.output(0) + job.output(1)
    [event] = job.events(two_nodes.nodes[0])
    _whole(job, event.name, 4)
    assert f"node1 came back: its part (ranks 2-3) joined {event}" in job.output(0)
    assert f"the whole event on node0 (10.97.0.1): {event}" in job.output(1)
    d = analyze(event)
    assert d.verdict == "partition", d.evidence
    assert [(n.host, n.state, n.ranks) for n in d.nodes] == [("node1", "unreachable", [2, 3])]


@pytest.mark.slow
def test_a_frozen_node_is_told_apart_from_a_lost_one(two_nodes: SimCluster) -> None:
    job = start_job(two_nodes, steps=1_000_000, hang_timeout=30.0)
    job.wait_ready(4)
    two_nodes.freeze(two_nodes.nodes[1])  # every process: its launcher too
    job.wait_said(0, "waiting up to 30s for node1 to come back")
    two_nodes.thaw(two_nodes.nodes[1])
    codes = job.wait(90)
    assert codes[0] == 1, job.output(0)
    [event] = job.events(two_nodes.nodes[0])
    assert "node1 (ranks 2-3) frozen at " in job.output(0)
    _whole(job, event.name, 4)  # thawed, node 1 brought its ranks' part
    d = analyze(event)
    assert d.verdict == "node_frozen", d.evidence
    assert [(n.host, n.state, n.ranks) for n in d.nodes] == [("node1", "frozen", [2, 3])]


@pytest.mark.slow
def test_node_0_lost_the_event_is_assembled_on_the_lowest_survivor(
    three_nodes: SimCluster,
) -> None:
    job = start_job(three_nodes, per_node=1, steps=1_000_000, hang_timeout=30.0)
    codes = job.lose_node(0, world=3)  # the job's store goes with it
    assert codes[1:] == [1, 1], job.output(1) + job.output(2)
    events = job.events(three_nodes.nodes[1])
    assert len(events) == 1, f"{events}\n{job.output(1)}\n{job.output(2)}"
    [event] = events
    assert f"the event is assembled here, on node1: {event}" in job.output(1)
    assert f"the whole event on node1 (10.97.0.2): {event}" in job.output(2)
    assert "cannot reach: node0 (gone)" in job.output(2)
    assert rank_file(event, 1).exists() and rank_file(event, 2).exists()
    d = analyze(event)
    assert d.verdict == "node_lost", d.evidence
    assert [(n.host, n.state, n.ranks) for n in d.nodes] == [("node0", "lost", [0])]


@pytest.mark.slow
def test_node_0s_cluster_page_reaches_every_rank_of_every_node(two_nodes: SimCluster) -> None:
    job = start_job(two_nodes, steps=1_000_000)
    job.wait_ready(4)
    job.wait_said(0, "tether run: cluster page http://10.97.0.1:")
    line = next(x for x in job.output(0).splitlines() if "cluster page" in x)
    page = line.split("cluster page ", 1)[1].strip()
    assert "?token=" in page  # on a node's address, not loopback: the job's token is required
    url = page.replace("/?token=", "/metrics/job?token=")
    fetch = (
        "import sys, urllib.request; "
        "print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())"
    )
    out = subprocess.run(
        two_nodes.command(two_nodes.nodes[0], [sys.executable, "-c", fetch, url]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for rank in range(4):
        assert f'tether_rank_up{{rank="{rank}"}} 1.0' in out, out[:2000]


@pytest.mark.slow
def test_a_nodes_stopped_workers_are_read_by_its_own_launcher(two_nodes: SimCluster) -> None:
    job = start_job(two_nodes, steps=1_000_000, hang_timeout=3.0)
    job.wait_ready(4)
    two_nodes.freeze(two_nodes.nodes[1], spare=[job.procs[1].pid])  # its launcher goes on
    assert job.wait(90) == [HANG_EXIT_CODE, HANG_EXIT_CODE], job.output(0) + job.output(1)
    [event] = job.events(two_nodes.nodes[0])
    # Node 1's launcher read its stopped ranks' stacks from outside and sent them to node 0.
    assert (event / "stacks_2.txt").exists() and (event / "stacks_3.txt").exists(), job.output(1)
    d = analyze(event)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2, 3]), d.evidence
    assert d.unresponsive_ranks == {2: "stopped", 3: "stopped"}
    assert d.hosts[2] == d.hosts[3] == "node1"


@pytest.mark.slow
def test_a_rank_that_raises_on_the_second_node_makes_one_event_on_the_first(
    two_nodes: SimCluster,
) -> None:
    job = start_job(two_nodes, fault="raise", culprit=3)
    assert job.wait(120) == [1, 1], job.output(0) + job.output(1)
    [event] = job.events(two_nodes.nodes[0])  # one event: ranks 0-1 failing after it add none
    _whole(job, event.name, 4)
    last = job.output(0).strip().splitlines()[-1]
    assert last.startswith("tether run: rank 3 (node1) died (exit code 1): rank 3 raised"), last
    d = analyze(event)
    assert (d.verdict, d.culprit_ranks) == ("crash", [3]), d.evidence
    assert "bad batch" in d.exceptions[3]
    assert d.hosts[3] == "node1"
