"""Rank 0's cluster view of 1,024 ranks on 64 nodes (simulated: tether.testing.fleet serves
their debug servers from one process): rank 1,017's node has died and rank 517 has not joined
the collective every other rank waits in. The page's grid puts rank 517's node first and opens
it, a real browser draws it, and ``/metrics/job`` folds the ranks per node."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from tests._browser import chromium
from tests.watchdog.test_server import call
from tether.job.alarm import AlarmBoard
from tether.server import DebugServer
from tether.server.auth import Guard
from tether.server.cluster import Cluster
from tether.server.web import App
from tether.testing.fleet import FleetSpec, RankFleet, RankSource, host_of

pytestmark = pytest.mark.every_torch

WORLD, PER_NODE, CULPRIT = 1024, 16, 517
DEAD = tuple(range(1008, 1024))
"""The last node: its ranks accept connections and never answer."""
SPEC = FleetSpec(world=WORLD, per_node=PER_NODE, culprit=CULPRIT, silent=DEAD)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DebugServer]:
    """Rank 0's server, in this process, over 1,023 simulated ranks."""
    board = AlarmBoard(dist.HashStore())
    with RankFleet(SPEC) as fleet:
        for rank, url in fleet.urls.items():
            board.publish_proc(rank, {"host": host_of(rank, PER_NODE), "debug_url": url})
        cluster = Cluster(
            board,
            local=RankSource(SPEC),
            rank=0,
            world_size=WORLD,
            token=None,
            dump_dir=tmp_path_factory.mktemp("dumps"),
            job_id="sim-1024",
        )
        server = DebugServer(App(cluster.routes(), Guard(None)), host="127.0.0.1", port=0)
        server.on_close.append(cluster.close)
        server.start()
        board.publish_proc(0, {"host": host_of(0, PER_NODE), "debug_url": server.url()})
        try:
            yield server
        finally:
            server.close()


@pytest.mark.timeout(120)
def test_the_view_puts_the_culprits_node_first_and_the_dead_node_next(
    server: DebugServer,
) -> None:
    status, _, body = call(server, "GET", "/api/cluster?brief=1")
    assert status == 200, body
    view = json.loads(body)
    assert [h["rank"] for h in view["holding_back"]] == [CULPRIT, *DEAD]
    reason = view["holding_back"][0]["reason"]
    # 1,007 waiters named in a few words: the ranks that answered and wait in #4.
    assert "(its last is #3); ranks 0-516, 518-1007 waited 42.0 s for it" in reason, reason
    nodes = view["nodes"]
    assert len(nodes) == WORLD // PER_NODE
    assert (nodes[0]["host"], nodes[0]["state"], nodes[0]["holding_back"]) == (
        host_of(CULPRIT, PER_NODE),
        "holding back",
        [CULPRIT],
    )
    assert (nodes[1]["host"], nodes[1]["state"], nodes[1]["states"]) == (
        host_of(DEAD[0], PER_NODE),
        "no answer",
        {"no answer": PER_NODE},
    )
    assert {n["state"] for n in nodes[2:]} == {"hung"}
    assert all(len(n["ranks"]) == PER_NODE for n in nodes)


@pytest.mark.timeout(120)
def test_the_page_in_a_browser_opens_the_culprits_node(server: DebugServer, tmp_path: Path) -> None:
    dom = chromium(tmp_path / "profile", "--dump-dom", f"{server.url()}/").stdout
    cells = re.findall(
        r'<button[^>]*class="node (\w+)"[^>]*data-host="([^"]*)"[^>]*'
        r'data-state="([^"]*)"',
        dom,
    )
    assert len(cells) == WORLD // PER_NODE, dom[:3000]
    assert cells[0] == ("bad", host_of(CULPRIT, PER_NODE), "holding back")
    assert cells[1] == ("off", host_of(DEAD[0], PER_NODE), "no answer")
    shown = [int(r) for r in re.findall(r'<tr data-rank="(\d+)"', dom)]
    assert shown == list(range(512, 528)), "the first node's ranks, and only those"
    assert re.search(rf'<tr data-rank="{CULPRIT}" data-holding-back="true"', dom)
    assert "Ranks on sim-node0032 (16)" in dom
    assert f"Ranks {CULPRIT}, {DEAD[0]}-{DEAD[-1]} holding the job back" in dom
    assert f"ranks {DEAD[0]}-{DEAD[-1]} (sim-node0063): does not answer" in dom, "a line a node"
    assert re.search(r'data-first-drawn-ms="\d+"', dom), "the page says when it first drew"

    # For people to look at: the grid as a browser draws it.
    shot = tmp_path / "cluster-1024.png"
    chromium(
        tmp_path / "profile", "--window-size=1400,1000", f"--screenshot={shot}", f"{server.url()}/"
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")


@pytest.mark.timeout(120)
def test_job_metrics_fold_1024_ranks_per_node(server: DebugServer) -> None:
    status, _, body = call(server, "GET", "/metrics/job")
    assert status == 200, body
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    up = {s.labels["node"]: s.value for s in families["tether_node_ranks_up"].samples}
    assert len(up) == WORLD // PER_NODE and up[host_of(DEAD[0], PER_NODE)] == 0
    assert up[host_of(CULPRIT, PER_NODE)] == PER_NODE
    healthy = {s.labels["node"]: s.value for s in families["tether_healthy"].samples}
    assert healthy[host_of(CULPRIT, PER_NODE)] == 0, "its 15 waiters are hung"
    assert not any("rank" in s.labels for f in families.values() for s in f.samples)
    status, _, by_rank = call(server, "GET", "/metrics/job?by=rank")
    assert status == 200 and len(body) * 10 < len(by_rank), (len(body), len(by_rank))
