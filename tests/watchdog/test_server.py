"""The debug server in-process: real servers on port 0 in front of fake ranks, every endpoint,
the token, refusals, the cluster view, "holding back", and a fuzz of what clients may send."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import string
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests._jobs import until
from tether.config import Config
from tether.job.alarm import Alarm, AlarmBoard
from tether.recorder.frames import python_stacks
from tether.recorder.recorder import Recorder
from tether.server import DebugServer, Holdup, holding_back, start_debug_server
from tether.server import cluster as cluster_module
from tether.server.auth import TOKEN_KEY, Guard, needs_token
from tether.server.cluster import Cluster, Held, Round, fetch_metrics
from tether.server.jobmetrics import job_exposition, parse_exposition
from tether.server.rank import RankEndpoints
from tether.server.web import MAX_BODY, App
from tether.testing.fleet import FleetSpec, host_of, synthetic_metrics
from tether.watchdog.link import JobLink
from tether.watchdog.report import RankReport

pytestmark = pytest.mark.every_torch

WORLD = [0, 1, 2]


def health(
    rank: int,
    *,
    last: dict[str, int] | None = None,
    waiting: dict[str, int] | None = None,
    members: dict[str, list[int]] | None = None,
    healthy: bool = True,
    age: float = 12.5,
) -> dict[str, Any]:
    """A rank's /health: ``last`` enqueued collective per group, ``waiting`` in collective #N per
    group; group "0" is the world (default_pg), others have ``members``."""
    last = last if last is not None else {"0": 3}
    waiting = waiting or {}
    members = {"0": WORLD, **(members or {})}
    desc = {"0": "default_pg"}
    return {
        "rank": rank,
        "world_size": len(WORLD),
        "host": "node-a",
        "pid": 1000 + rank,
        "healthy": healthy,
        "hung": None,
        "hang_timeout_s": 60.0,
        "watchdog_heartbeat_age_s": 0.01,
        "in_flight": [
            {
                "record_id": 7,
                "op": "gloo:all_reduce",
                "group": group,
                "group_desc": desc.get(group, "undefined"),
                "collective_seq_id": seq,
                "state": "started",
                "age_s": age,
            }
            for group, seq in waiting.items()
        ],
        "groups": {
            group: {
                "desc": desc.get(group, "undefined"),
                "ranks": members[group],
                "last_enqueued_collective": seq,
                "last_started_collective": seq,
                "last_completed_collective": seq - (group in waiting),
            }
            for group, seq in last.items()
        },
    }


class FakeRank:
    """What a rank gives the server: its report, and the dumps its link to the job raises."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        self.dumps: list[str] = []

    def health(self) -> dict[str, Any]:
        return self.report

    def trace(self) -> dict[str, Any]:
        entry = {"process_group": ("0", "default_pg"), "time_discovered_completed_ns": None}
        return {"version": "2.10", "entries": [entry]}

    def stacks(self) -> list[dict[str, Any]]:
        return python_stacks()

    def metrics(self) -> str:
        return f'tether_in_flight{{rank="{self.report["rank"]}"}} 0\n'

    def request_dump(self, reason: str = "manual") -> Alarm:
        self.dumps.append(reason)
        return Alarm(1, f"20260101T000000.000000Z-{reason}", reason, origin="rank 0")


# The hang of tests/workers/served.py: rank 1 never joins world collective #4.
HUNG = {
    0: health(0, last={"0": 4}, waiting={"0": 4}),
    1: health(1, last={"0": 3}),
    2: health(2, last={"0": 4}, waiting={"0": 4}),
}


def rank_routes(source: FakeRank, dump_dir: Path) -> Any:
    return RankEndpoints(source, dump_dir, request_dump=source.request_dump).routes()


def rank_app(source: FakeRank, dump_dir: Path, token: str | None = None) -> App:
    return App(rank_routes(source, dump_dir), Guard(token))


@pytest.fixture
def serve() -> Iterator[Callable[..., DebugServer]]:
    """Start servers on port 0; all are closed after the test."""
    servers: list[DebugServer] = []

    def start(app: App, host: str = "127.0.0.1", **kwargs: Any) -> DebugServer:
        server = DebugServer(app, host=host, port=0, **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def call(
    server: DebugServer,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response, response.read()
    finally:
        conn.close()


def get_json(server: DebugServer, path: str, **kwargs: Any) -> Any:
    status, _, body = call(server, "GET", path, **kwargs)
    assert status == 200, body
    return json.loads(body)


def raw(server: DebugServer, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` as is, then read the reply until the server closes."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


class FakeTorchWorker:
    """What torch's worker routes read: ``ready`` once a group formed; a file write that
    blocks until ``release`` is set (to hold a dump in progress)."""

    def __init__(self, *, ready: bool = True) -> None:
        self.ready = ready
        self.release = threading.Event()
        self.writes: list[str] = []
        self.unhealthy: list[str] = []

    def c10d_health(self) -> dict[str, Any]:
        return {"healthy": not self.unhealthy, "unhealthy_backends": self.unhealthy}

    def fr_ready(self) -> bool:
        return self.ready

    def fr_trace(self, backend: str, *, stacks: bool, only_active: bool) -> dict[str, Any] | None:
        return {"version": "2.10", "backend": backend, "entries": []} if self.ready else None

    def write_fr_file(self, backend: str) -> Path | None:
        self.release.wait(10)
        self.writes.append(backend)
        return None

    def stacks(self) -> list[dict[str, Any]]:
        return python_stacks()


@pytest.mark.timeout(30)
def test_torch_worker_routes_answer_with_torchs_texts(
    serve: Callable[..., DebugServer],
) -> None:
    from tether.server.torch_worker import TorchWorkerRoutes

    source = FakeTorchWorker()
    server = serve(App(TorchWorkerRoutes(source, rank=3).routes(), Guard(None)))
    assert call(server, "POST", "/handler/ping")[2] == b"pong"
    assert get_json(server, "/handler/c10d_health_check") == {
        "healthy": True,
        "unhealthy_backends": [],
    }
    source.unhealthy = ["gloo"]
    health = get_json(server, "/handler/c10d_health_check")
    assert health == {"healthy": False, "unhealthy_backends": ["gloo"]}
    assert get_json(server, "/handler/fr_trace_json")["backend"] == "gloo", "torch's default"
    assert get_json(server, "/handler/fr_trace_json?backend=NCCL")["backend"] == "nccl"
    # single-flight: a second request while the first dump runs is told so, and starts nothing
    first = call(server, "POST", "/handler/fr_dump_file?backend=gloo")
    again = call(server, "POST", "/handler/fr_dump_file?backend=gloo")
    assert (first[0], first[2]) == (200, b"Flight Recorder dump initiated for rank 3")
    assert (again[0], again[2]) == (200, b"Flight Recorder dump already in progress for rank 3")
    source.release.set()
    deadline = time.monotonic() + 10
    while not source.writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.writes == ["gloo"]
    deadline = time.monotonic() + 10  # the flight ends once the write has returned
    while time.monotonic() < deadline:
        status, _, text = call(server, "POST", "/handler/fr_dump_file")
        if text == b"Flight Recorder dump initiated for rank 3":
            break
        time.sleep(0.01)
    assert text == b"Flight Recorder dump initiated for rank 3"
    status, _, text = call(server, "POST", "/handler/dump_traceback")
    assert status == 200 and b"most recent call first" in text


@pytest.mark.timeout(30)
def test_torch_worker_routes_before_any_group_are_503(serve: Callable[..., DebugServer]) -> None:
    from tether.server.torch_worker import TorchWorkerRoutes

    source = FakeTorchWorker(ready=False)
    server = serve(App(TorchWorkerRoutes(source, rank=0).routes(), Guard(None)))
    unset = b"Flight Recorder rank is unset; no process group has registered with it yet"
    for route in ("fr_dump_file", "fr_trace_json"):
        status, _, text = call(server, "POST", f"/handler/{route}")
        assert (status, text) == (503, unset)
    assert source.writes == []


# -- every rank's endpoints ---------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_health_trace_stacks_metrics(serve: Callable[..., DebugServer], tmp_path: Path) -> None:
    server = serve(rank_app(FakeRank(HUNG[0]), tmp_path))
    assert get_json(server, "/health") == HUNG[0]
    trace = get_json(server, "/trace")
    assert trace["entries"] == [
        {"process_group": ["0", "default_pg"], "time_discovered_completed_ns": None}
    ], "tuples become lists, None stays null"
    threads = {t["thread_name"] for t in get_json(server, "/stacks")}
    assert {"MainThread", "tether-debug-server"} <= threads
    status, response, text = call(server, "GET", "/stacks?format=text")
    assert status == 200 and response.getheader("Content-Type", "").startswith("text/plain")
    assert "'tether-debug-server' (daemon), most recent call first:" in text.decode()
    assert re.search(r'File ".*rank\.py", line \d+, in stacks', text.decode())
    status, response, text = call(server, "GET", "/metrics")
    assert status == 200 and "version=0.0.4" in response.getheader("Content-Type", "")
    assert text == b'tether_in_flight{rank="0"} 0\n'
    assert response.getheader("Cache-Control") == "no-store"


@pytest.mark.timeout(30)
def test_dump_asks_every_rank_once_per_interval(
    serve: Callable[..., DebugServer], tmp_path: Path
) -> None:
    source = FakeRank(HUNG[0])
    server = serve(rank_app(source, tmp_path))
    status, _, body = call(server, "POST", "/dump")
    assert status == 202
    event = "20260101T000000.000000Z-manual"
    assert json.loads(body) == {
        "event_id": event,
        "dir": str(tmp_path / event),
        "epoch": 1,
        "origin": "rank 0",
    }
    assert source.dumps == ["manual"]
    status, response, _ = call(server, "POST", "/dump")
    assert status == 429 and response.getheader("Retry-After") == "1"
    assert source.dumps == ["manual"], "a retry loop must not dump again at once"


@pytest.mark.timeout(30)
def test_refusals_are_4xx(serve: Callable[..., DebugServer], tmp_path: Path) -> None:
    server = serve(rank_app(FakeRank(HUNG[0]), tmp_path))
    status, _, body = call(server, "GET", "/nowhere")
    assert status == 404 and "GET /health" in json.loads(body)["endpoints"]
    status, response, _ = call(server, "GET", "/dump")
    assert status == 405 and response.getheader("Allow") == "POST"
    status, response, _ = call(server, "DELETE", "/health")
    assert status == 405 and response.getheader("Allow") == "GET"
    status, _, _ = call(server, "POST", "/dump", body=b"x" * (MAX_BODY + 1))
    assert status == 413, "refused unread, and still received: the server lingers"
    too_long = f"POST /dump HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    assert raw(server, too_long).startswith(b"HTTP/1.0 413 ")
    status, _, _ = call(server, "POST", "/dump", headers={"Content-Length": "1_0"})
    assert status == 400
    status, _, _ = call(server, "POST", "/dump", headers={"Transfer-Encoding": "chunked"})
    assert status == 411
    assert raw(server, b"GET /health\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert raw(server, b"GET /health HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert raw(server, b"BREW /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 405 ")
    assert raw(server, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 414")
    assert raw(server, b"GET /health?" + b"a=1&" * 20 + b" HTTP/1.1\r\n\r\n").startswith(
        b"HTTP/1.0 400 "
    )
    assert get_json(server, "/health")["rank"] == 0


# -- who may ask --------------------------------------------------------------------------------
def test_only_the_usual_loopback_names_go_without_a_token() -> None:
    assert not any(map(needs_token, ["127.0.0.1", "localhost", "::1"]))
    assert all(map(needs_token, ["0.0.0.0", "10.1.2.3", "127.0.0.2", "node-7", "::"]))


@pytest.mark.timeout(30)
def test_a_server_off_loopback_needs_the_token(
    serve: Callable[..., DebugServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tether.server")
    server = serve(rank_app(FakeRank(HUNG[0]), tmp_path, token="s3cret"), host="127.0.0.2")
    status, response, body = call(server, "GET", "/health")
    assert status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
    assert "token" in json.loads(body)["error"]
    assert call(server, "GET", "/health", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert call(server, "GET", "/health?token=wrong")[0] == 401
    assert call(server, "POST", "/dump")[0] == 401
    status, _, body = call(server, "GET", "/no-such-page")  # no route list without the token
    assert status == 401 and b"/health" not in body
    assert get_json(server, "/health", headers={"Authorization": "Bearer s3cret"})["rank"] == 0
    assert get_json(server, "/health?token=s3cret")["rank"] == 0
    assert "/health?token=***" in caplog.text and "s3cret" not in caplog.text  # access log


@pytest.mark.timeout(30)
def test_loopback_refuses_rebound_names_and_cross_origin_posts(
    serve: Callable[..., DebugServer], tmp_path: Path
) -> None:
    server = serve(rank_app(FakeRank(HUNG[0]), tmp_path))
    assert call(server, "GET", "/health", headers={"Host": "evil.example"})[0] == 403
    assert call(server, "GET", "/health", headers={"Host": f"localhost:{server.port}"})[0] == 200
    foreign = {"Origin": "http://evil.example"}
    assert call(server, "POST", "/dump", headers=foreign)[0] == 403
    own = {"Origin": f"http://127.0.0.1:{server.port}"}
    assert call(server, "POST", "/dump", headers=own)[0] == 202


# -- who holds the job back ---------------------------------------------------------------------
def test_the_rank_missing_from_a_collective_holds_back() -> None:
    assert holding_back(HUNG) == [
        Holdup(
            1,
            "has not joined gloo:all_reduce #4 on group default_pg (its last is #3); "
            "ranks 0, 2 waited 12.5 s for it",
        )
    ]


def test_nobody_holds_back_a_healthy_job() -> None:
    assert holding_back({r: health(r, last={"0": 5}) for r in WORLD}) == []
    # Everyone in the same collective: slow, or stuck in the backend; no member is missing.
    assert holding_back({r: health(r, last={"0": 5}, waiting={"0": 5}) for r in WORLD}) == []


def test_point_to_point_waits_are_not_attributed() -> None:
    # Rank 0 waits in a receive; its number is the last collective's, which rank 1 also ran.
    healths = {r: health(r, last={"0": 3}) for r in WORLD}
    healths[0]["in_flight"] = [
        {"op": "gloo:recv 0<-1", "group": "0", "collective_seq_id": 3, "age_s": 9.0, "is_p2p": True}
    ]
    healths[1]["groups"]["0"]["last_enqueued_collective"] = 2
    assert holding_back(healths) == []


def test_silent_and_idle_unhealthy_ranks_are_suspects() -> None:
    got = holding_back({0: health(0), 1: None, 2: health(2, healthy=False)})
    assert got == [Holdup(1, "does not answer"), Holdup(2, "unhealthy with nothing in flight")]


def test_a_rank_held_back_in_turn_is_not_the_cause() -> None:
    # Rank 0 waits in world #4 for rank 1; rank 1 waits in group "1" (ranks 1, 2) #2 for rank 2.
    pair = {"1": [1, 2]}
    healths = {
        0: health(0, last={"0": 4}, waiting={"0": 4}),
        1: health(1, last={"0": 3, "1": 2}, waiting={"1": 2}, members=pair),
        2: health(2, last={"0": 4, "1": 1}, members=pair),
    }
    assert [h.rank for h in holding_back(healths)] == [2]
    assert "on group 1 (its last is #1); rank 1 waited" in holding_back(healths)[0].reason


def test_a_silent_member_explains_its_waiters() -> None:
    # Rank 1 is behind on world #4, but itself waits in group "1" for rank 2, which is silent.
    pair = {"1": [1, 2]}
    healths = {
        0: health(0, last={"0": 4}, waiting={"0": 4}),
        1: health(1, last={"0": 3, "1": 2}, waiting={"1": 2}, members=pair),
        2: None,
    }
    assert holding_back(healths) == [Holdup(2, "does not answer")]


def test_a_cycle_of_waits_names_everyone_in_it() -> None:
    # Ranks 0 and 1 each wait in a group where the other is behind.
    groups = {"1": [0, 1], "2": [0, 1]}
    healths = {
        0: health(0, last={"1": 5, "2": 1}, waiting={"1": 5}, members=groups),
        1: health(1, last={"1": 4, "2": 2}, waiting={"2": 2}, members=groups),
    }
    assert [h.rank for h in holding_back(healths)] == [0, 1]


def test_only_members_of_the_waiting_group_are_blamed() -> None:
    # Group "1" = ranks 0, 2: rank 1 is not a member, so its lower count there means nothing.
    sub = {"1": [0, 2]}
    healths = {
        0: health(0, last={"0": 3, "1": 6}, waiting={"1": 6}, members=sub),
        1: health(1, last={"0": 3}),
        2: health(2, last={"0": 3, "1": 5}, members=sub),
    }
    assert [h.rank for h in holding_back(healths)] == [2]


# -- the cluster view ---------------------------------------------------------------------------
@pytest.fixture
def board() -> AlarmBoard:
    return AlarmBoard(dist.HashStore())


def cluster_server(
    serve: Callable[..., DebugServer],
    board: AlarmBoard,
    dump_dir: Path,
    ranks: dict[int, dict[str, Any]],
    urls: dict[int, str] | None = None,
) -> DebugServer:
    """Rank 0's server over in-process servers for the other ``ranks``; ``urls`` overrides."""
    servers = {r: serve(rank_app(FakeRank(h), dump_dir)) for r, h in ranks.items() if r != 0}
    published = {r: s.url() for r, s in servers.items()} | (urls or {})
    cluster = Cluster(
        board,
        local=FakeRank(ranks[0]),
        rank=0,
        world_size=len(WORLD),
        token=None,
        dump_dir=dump_dir,
        job_id="job-7",
    )
    routes = {**rank_routes(FakeRank(ranks[0]), dump_dir), **cluster.routes()}
    server = serve(App(routes, Guard(None)))
    server.on_close.append(cluster.close)
    for rank, url in (published | {0: server.url()}).items():
        board.publish_proc(rank, {"host": "node-a", "pid": 1000 + rank, "debug_url": url})
    return server


@pytest.mark.timeout(30)
def test_cluster_view_names_the_rank_holding_back(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    server = cluster_server(serve, board, tmp_path, HUNG)
    view = get_json(server, "/api/cluster")
    assert (view["job_id"], view["world_size"]) == ("job-7", 3)
    assert [h["rank"] for h in view["holding_back"]] == [1]
    assert "gloo:all_reduce #4" in view["holding_back"][0]["reason"]
    rows = view["ranks"]
    assert [(r["rank"], r["answered"], r["holding_back"]) for r in rows] == [
        (0, True, False),
        (1, True, True),
        (2, True, False),
    ]
    assert rows[0]["oldest_in_flight"]["group_label"] == "default_pg"
    assert rows[0]["oldest_in_flight"]["collective_seq_id"] == 4
    assert rows[1]["oldest_in_flight"] is None and rows[1]["in_flight"] == 0
    assert rows[1]["last_completed"] == [{"group": "0", "group_label": "default_pg", "seq": 3}]
    assert rows[2]["health"] == HUNG[2] and rows[2]["url"].startswith("http://127.0.0.1:")
    # The culprit's own watchdog sees nothing wrong (nothing in flight), but it is not "healthy".
    assert rows[1]["healthy"] is True
    assert [r["state"] for r in rows] == ["healthy", "holding back", "healthy"]


@pytest.mark.timeout(30)
def test_each_rank_has_one_state_the_badge_shows(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    ranks = {0: health(0, healthy=False, waiting={"0": 4}, last={"0": 4}), 1: HUNG[1]}
    with socket.create_server(("127.0.0.1", 0)) as mute:
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        server = cluster_server(serve, board, tmp_path, ranks, urls={2: url})
        rows = get_json(server, "/api/cluster")["ranks"]
    assert [(r["state"], r["holding_back"]) for r in rows] == [
        ("hung", False),
        ("holding back", True),
        ("no answer", True),
    ]
    status, _, page = call(server, "GET", "/")
    assert status == 200 and b"BADGES[row.state]" in page, "the page draws the server's word"
    assert b'text: "healthy"' not in page, "no badge of the page's own making"


@pytest.mark.timeout(30)
def test_a_rank_served_from_a_new_address_is_asked_there(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    # Rank 2's process was replaced (an elastic job): its successor publishes a new address.
    with socket.create_server(("127.0.0.1", 0)) as gone:
        old = f"http://127.0.0.1:{gone.getsockname()[1]}"
    server = cluster_server(serve, board, tmp_path, HUNG, urls={2: old})
    rows = get_json(server, "/api/cluster")["ranks"]
    assert (rows[2]["answered"], rows[2]["url"]) == (False, old)
    successor = serve(rank_app(FakeRank(HUNG[2]), tmp_path))
    board.publish_proc(2, {"host": "node-b", "pid": 2002, "debug_url": successor.url()})
    # At a later round of asking (as the page refreshes): a request takes the last round's.
    rows = until(
        lambda: (r := get_json(server, "/api/cluster")["ranks"])[2]["answered"] and r,
        "rank 2 was never asked at its new address",
        timeout=10.0,
    )
    assert rows[2]["url"] == successor.url()
    metrics = call(server, "GET", "/metrics/job")[2].decode()
    assert 'tether_rank_up{rank="2"} 1.0' in metrics


class HostileRank:
    """A "rank" on port 0 that answers any request with a 200 whose headers (``trickle``) or
    body (``flood``, without a length) never end; ``cut`` is set once the client hangs up,
    ``sent`` counts what it got out."""

    FLOOD = 64 << 20

    def __init__(self, how: str) -> None:
        self.how = how
        self.cut = threading.Event()
        self.sent = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hostile-rank", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(10)
        conn, _ = self._listener.accept()
        with conn:
            conn.recv(65536)  # the request
            status = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            try:
                conn.sendall(status if self.how == "trickle" else status + b"\r\n")
                while not self._stop.is_set() and self.sent < self.FLOOD:
                    if self.how == "trickle":  # a header line just before each read times out
                        self.sent += conn.send(b"X-Slow: 1\r\n")
                        self._stop.wait(0.3)  # http.client takes 100 headers: 30 s
                    else:
                        self.sent += conn.send(b"x" * (1 << 20))
                if self.sent >= self.FLOOD:
                    return  # everything went out: nobody cut it
                conn.recv(1)  # the client closed: b"" (or a reset)
            except OSError:
                pass
            self.cut.set()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["trickle", "flood"])
def test_a_rank_answering_slowly_or_endlessly_is_cut_off(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path, how: str
) -> None:
    hostile = HostileRank(how)
    try:
        server = cluster_server(serve, board, tmp_path, HUNG, urls={2: hostile.url})
        status, _, body = call(server, "GET", "/metrics/job")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
        assert up == {"0": 1, "1": 1, "2": 0}
        # Rank 0's thread stops reading at the round's deadline or the size limit, not when
        # the rank stops sending (a flood is cut long before its 64 MiB are out).
        assert hostile.cut.wait(20), f"still reading after {hostile.sent} bytes"
        assert hostile.sent < HostileRank.FLOOD
    finally:
        hostile.close()


class BigRank(FakeRank):
    def metrics(self) -> str:
        return "".join(f'tether_in_flight{{rank="1",n="{i}"}} 0\n' for i in range(4000))


@pytest.mark.timeout(30)
def test_the_ranks_answers_to_one_request_share_a_byte_budget(
    serve: Callable[..., DebugServer], tmp_path: Path
) -> None:
    server = serve(rank_app(BigRank(HUNG[1]), tmp_path))
    size = len(BigRank(HUNG[1]).metrics())
    round_ = Round(budget=int(1.5 * size))
    first, error = fetch_metrics(server.url(), None, 10, round_)
    assert error is None and first is not None and len(first) == size
    assert fetch_metrics(server.url(), None, 10, round_) == (
        None,
        "the ranks' answers together were too long",
    )
    assert fetch_metrics(server.url(), None, 10, Round())[0] == first, "another round, anew"


@pytest.mark.timeout(30)
def test_job_metrics_need_the_token_off_loopback_and_carry_it_to_the_ranks(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    guarded = Guard("s3cret")
    others = {r: serve(App(rank_routes(FakeRank(HUNG[r]), tmp_path), guarded),
                       host="127.0.0.2") for r in (1, 2)}  # fmt: skip
    cluster = Cluster(
        board, local=FakeRank(HUNG[0]), rank=0, world_size=3, token="s3cret", dump_dir=tmp_path,
        job_id="job-7",
    )  # fmt: skip
    server = serve(App(cluster.routes(), guarded), host="127.0.0.2")
    for rank, s in (others | {0: server}).items():
        board.publish_proc(rank, {"debug_url": s.url()})
    assert call(server, "GET", "/metrics/job")[0] == 401
    status, _, body = call(server, "GET", "/metrics/job?token=s3cret")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
    assert up == {"0": 1, "1": 1, "2": 1}, "the ranks were asked with the token"


@pytest.mark.timeout(30)
def test_job_metrics_are_every_ranks_with_its_rank_and_up(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as mute:
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        server = cluster_server(serve, board, tmp_path, HUNG, urls={2: url})
        status, response, body = call(server, "GET", "/metrics/job")
    assert status == 200 and "version=0.0.4" in response.getheader("Content-Type", "")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    up = {s.labels["rank"]: s.value for s in families["tether_rank_up"].samples}
    assert up == {"0": 1, "1": 1, "2": 0}, "rank 2 does not answer"
    in_flight = families["tether_in_flight"].samples
    assert sorted(s.labels["rank"] for s in in_flight) == ["0", "1"]


@pytest.mark.timeout(30)
def test_the_view_groups_ranks_by_node_the_one_holding_back_first(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    on_b = {1: {**HUNG[1], "host": "node-b"}}
    with socket.create_server(("127.0.0.1", 0)) as mute:  # rank 2: published, never answers
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        server = cluster_server(serve, board, tmp_path, HUNG | on_b, urls={2: url})
        board.publish_proc(2, {"host": "node-c", "pid": 1002, "debug_url": url})
        view = get_json(server, "/api/cluster?brief=1")
    assert [(n["host"], n["ranks"], n["state"], n["holding_back"]) for n in view["nodes"]] == [
        ("node-b", [1], "holding back", [1]),
        ("node-c", [2], "no answer", [2]),
        ("node-a", [0], "healthy", []),
    ]
    assert view["nodes"][0]["states"] == {"holding back": 1}
    assert view["ranks"][2]["host"] == "node-c", "where a silent rank runs, as it published"
    assert all("health" not in row for row in view["ranks"]), "brief: the page's fields only"


def test_a_held_answer_is_asked_again_only_while_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds: list[int] = []
    held = Held(lambda: rounds.append(len(rounds)) or len(rounds), every=60.0, name="test-held")
    try:
        assert (held.get(10), held.get(10)) == (1, 1), "the second request takes what is held"
        assert rounds == [0]
    finally:
        held.close()
    monkeypatch.setattr(cluster_module, "WATCHED_S", 0.0)  # nobody looks after a request
    quiet = Held(lambda: rounds.append(len(rounds)) or len(rounds), every=0.01, name="test-held")
    try:
        assert quiet.get(10) == 2
        # The thread ends once nobody wants the answer.
        until(lambda: quiet._thread is None, "the thread went on asking", timeout=10.0)
        assert quiet.get(10) == 3, "after a quiet spell, a request waits for a new round"
    finally:
        quiet.close()


def test_a_held_round_that_fails_is_the_requests_error() -> None:
    def ask() -> int:
        raise ConnectionError("store gone")

    held = Held(ask, every=60.0, name="test-held")
    try:
        with pytest.raises(ConnectionError, match="store gone"):
            held.get(10)
    finally:
        held.close()


def test_job_metrics_fold_per_node_into_a_size_of_nodes_not_ranks() -> None:
    spec = FleetSpec(world=64, per_node=16, culprit=17)
    parsed = {r: parse_exposition(synthetic_metrics(spec, r).decode())[0] for r in range(64)}
    parsed[20] = None  # did not answer
    hosts = {r: host_of(r, 16) for r in range(64)} | {63: None}
    by_node = job_exposition(parsed, nodes=hosts).decode()
    families = {f.name: f for f in text_string_to_metric_families(by_node)}

    def values(name: str) -> dict[tuple[str, ...], float]:
        return {
            tuple(v for k, v in sorted(s.labels.items()) if k != "op"): s.value
            for s in families[name].samples
            if s.labels.get("op", "allreduce") == "allreduce"
        }

    node1 = host_of(16, 16)
    assert (
        values("tether_node_ranks")[(node1,)] == 16
        and values("tether_node_ranks")[("unknown",)] == 1
    )
    assert values("tether_node_ranks_up")[(node1,)] == 15, "rank 20 did not answer"
    expected = sum(1000 + r % 3 for r in range(16, 32) if r != 20)
    assert values("tether_operations_recorded")[("tp", node1)] == expected, "counters sum"
    assert values("tether_healthy")[(node1,)] == 0, "a gauge of health: the least"
    oldest = max(42.0 + r % 5 for r in range(16, 32) if r not in (17, 20))
    assert values("tether_oldest_in_flight_seconds")[(node1,)] == oldest, "an age: the most"
    assert values("tether_operations_in_flight")[(node1,)] == 14, "15 answered, 1 not waiting"
    labels = {k for f in families.values() for s in f.samples for k in s.labels}
    assert labels == {"node", "group_desc", "op"}, "no label that grows with the ranks"
    by_rank = job_exposition(parsed).decode()
    assert len(by_node) * 4 < len(by_rank), "a node's 16 ranks are one sample"


@pytest.mark.timeout(30)
def test_job_metrics_per_node_above_the_limit_or_when_asked(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    server = cluster_server(serve, board, tmp_path, HUNG)
    up = families_of(server, "/metrics/job?by=node")["tether_node_ranks_up"].samples
    assert [(s.labels, s.value) for s in up] == [({"node": "node-a"}, 3)]
    assert "tether_rank_up" in families_of(server, "/metrics/job"), "3 ranks: by rank"
    status, _, body = call(server, "GET", "/metrics/job?by=host")
    assert status == 400 and b"by=rank or by=node" in body


def families_of(server: DebugServer, path: str) -> dict[str, Any]:
    status, _, body = call(server, "GET", path)
    assert status == 200, body
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


@pytest.mark.timeout(30)
def test_a_rank_that_does_not_answer_does_not_hold_up_the_page(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    # Rank 2's "server" accepts connections and never answers, like a rank stuck holding the GIL.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        server = cluster_server(serve, board, tmp_path, HUNG, urls={2: url})
        start = time.monotonic()
        view = get_json(server, "/api/cluster")
        assert time.monotonic() - start < 2.0
    row = view["ranks"][2]
    assert (row["answered"], row["error"], row["health"]) == (False, "timed out", None)
    assert [(h["rank"], h["reason"]) for h in view["holding_back"]][1] == (2, "does not answer")


@pytest.mark.timeout(30)
def test_dump_events_are_listed_with_their_progress(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    server = cluster_server(serve, board, tmp_path, HUNG)
    assert get_json(server, "/api/cluster")["events"] == []
    board.put(Alarm(1, "E1-hang", "hang", origin="rank 2", detail="all_reduce #4"))
    board.mark_done(1, 0, "dump")
    (tmp_path / "E1-hang").mkdir()
    (tmp_path / "E1-hang" / "rank_0").write_bytes(b"")
    (event,) = get_json(server, "/api/cluster")["events"]
    assert (event["event_id"], event["reason"], event["origin"]) == ("E1-hang", "hang", "rank 2")
    assert event["done"] == {"0": "dump"} and event["dir"] == str(tmp_path / "E1-hang")
    board.mark_done(1, 2, "dump")
    one = get_json(server, "/api/events?id=E1-hang")
    assert one["done"] == {"0": "dump", "2": "dump"} and one["files"] == ["rank_0"]
    assert [e["event_id"] for e in get_json(server, "/api/events")] == ["E1-hang"]
    assert call(server, "GET", "/api/events?id=E2")[0] == 404


@pytest.mark.timeout(30)
def test_the_page_is_served_with_a_strict_policy(
    serve: Callable[..., DebugServer], board: AlarmBoard, tmp_path: Path
) -> None:
    server = cluster_server(serve, board, tmp_path, HUNG)
    status, response, body = call(server, "GET", "/?token=abc")
    assert status == 200 and response.getheader("Content-Type") == "text/html; charset=utf-8"
    policy = response.getheader("Content-Security-Policy", "")
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy
    assert "connect-src 'self'" in policy
    page = body.decode()
    assert 'fetch("api/cluster?brief=1"' in page and "data-holding-back" in page
    assert "innerHTML" not in page, "values from ranks are put in as text only"


# -- wiring to a real rank ----------------------------------------------------------------------
def real_rank(dump_dir: Path, **config: Any) -> tuple[RankReport, JobLink]:
    """Rank 0 of a one-rank job, its report and its link as after JobLink.connect, without a
    process group."""
    recorder = Recorder(Config(dump_dir=dump_dir, **config))
    recorder.global_rank, recorder.world_size = 0, 1
    link = JobLink(recorder)
    link.board = AlarmBoard(dist.HashStore())
    report = RankReport.of(link)
    return report, link


@pytest.mark.timeout(30)
def test_start_debug_server_serves_a_rank_and_publishes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, link = real_rank(tmp_path)
    server = start_debug_server(report, link)
    assert server is not None
    try:
        assert link.board is not None
        assert link.board.procs(1)[0]["debug_url"] == server.url()
        assert capsys.readouterr().err == f"tether: cluster page {server.url()}/\n"
        assert get_json(server, "/health")["healthy"] is True
        assert get_json(server, "/trace")["version"] == "2.10"
        metrics = call(server, "GET", "/metrics")[2].decode()
        assert 'tether_healthy{rank="0"} 1.0' in metrics
        assert "# TYPE tether_operations_recorded_total counter" in metrics
        view = get_json(server, "/api/cluster")
        (row,) = view["ranks"]
        assert row["answered"] and row["url"] == server.url()
        # No job id was given: the page names the job as its job and targets files do.
        assert view["job_id"] == link.job_id == f"{report.recorder.host}-{os.getpid()}"
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_off_loopback_the_printed_page_carries_the_jobs_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, link = real_rank(tmp_path, debug_host="127.0.0.2")
    server = start_debug_server(report, link)
    assert server is not None and link.board is not None
    try:
        token = link.board.store.get(TOKEN_KEY).decode()
        assert capsys.readouterr().err == f"tether: cluster page {server.url()}/?token={token}\n"
        assert call(server, "GET", "/health")[0] == 401
        assert get_json(server, f"/api/cluster?token={token}")["ranks"][0]["answered"]
    finally:
        server.close()


def test_no_server_when_turned_off_or_the_port_is_taken(tmp_path: Path) -> None:
    assert start_debug_server(*real_rank(tmp_path, debug_port=None)) is None
    with socket.create_server(("127.0.0.1", 0)) as taken:
        report, busy = real_rank(tmp_path, debug_port=taken.getsockname()[1])
        assert start_debug_server(report, busy) is None, "the job runs on without its server"
    assert busy.board is not None and "debug_url" not in busy.board.procs(1).get(0, {})


@pytest.mark.timeout(30)
def test_close_is_prompt_final_and_frees_the_port(tmp_path: Path) -> None:
    server = DebugServer(rank_app(FakeRank(HUNG[0]), tmp_path), host="127.0.0.1", port=0)
    server.start()
    assert "tether-debug-server" in {t.name for t in threading.enumerate()}
    # A client that connected and went quiet must not delay closing.
    with socket.create_connection(("127.0.0.1", server.port)):
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 1.0
    server.close()
    assert "tether-debug-server" not in {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="cannot start again"):
        server.start()
    with socket.create_server(("127.0.0.1", server.port)):
        pass  # the port is free again


# -- fuzz ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DebugServer]:
    """Rank 0's full set of routes, with a short request timeout."""
    dump_dir = tmp_path_factory.mktemp("fuzz")
    cluster = Cluster(
        AlarmBoard(dist.HashStore()),
        local=FakeRank(HUNG[0]),
        rank=0,
        world_size=1,
        token=None,
        dump_dir=dump_dir,
        job_id="fuzz",
    )
    routes = {**rank_routes(FakeRank(HUNG[0]), dump_dir), **cluster.routes()}
    server = DebugServer(App(routes, Guard(None)), host="127.0.0.1", port=0, request_timeout=1.0)
    server.start()
    yield server
    server.close()


_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"))
_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"))
_METHOD = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]) | st.text(
    string.ascii_letters, min_size=1, max_size=10
)
_ROUTES = ["/", "/health", "/trace", "/stacks", "/metrics", "/dump", "/api/cluster", "/api/events"]
_ODD = ["//health", "/health/", "*", "http://127.0.0.1/health", "/../../etc/passwd", "/%00"]
_PATH = st.sampled_from(_ROUTES + _ODD) | _TEXT.map(lambda s: "/" + s[:40])
_QUERY = st.dictionaries(_VALUE, _VALUE, max_size=4).map(urlencode) | _TEXT.map(lambda s: s[:60])
_HEADERS = st.dictionaries(
    st.sampled_from(["Host", "Origin", "Authorization", "Content-Type", "Connection", "Expect"])
    | st.sampled_from(["Transfer-Encoding", "Accept", "X-Forwarded-For"])
    | st.text(string.ascii_letters + "-", min_size=1, max_size=20),
    _VALUE.map(lambda s: s[:80]),
    max_size=5,
)
_VERSION = st.sampled_from(["HTTP/1.0", "HTTP/1.1", "HTTP/2.0", "HTTP/1", "HTTP/x.y", "FOO", ""])
_LENGTH = st.sampled_from(["exact", "exact", "none", "-1", "1_0", "abc", str(MAX_BODY + 1)])


def _request(
    method: str,
    path: str,
    query: str,
    version: str,
    headers: dict[str, str],
    body: bytes,
    length: str,
) -> bytes:
    target = f"{path}?{query}" if query else path
    lines = [f"{method} {target} {version}".rstrip()]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if length == "exact":
        lines.append(f"Content-Length: {len(body)}")
    elif length != "none":
        lines.append(f"Content-Length: {length}")
    head = "\r\n".join(lines) + "\r\n\r\n"
    return head.encode("latin-1") + (body if length == "exact" else b"")


_STATUS = re.compile(rb"HTTP/1\.[01] ([24]\d\d) ")


def _answered_well(server: DebugServer, reply: bytes) -> None:
    match = _STATUS.match(reply)
    assert match, f"not a 2xx or 4xx reply: {reply[:200]!r}"
    assert get_json(server, "/health")["rank"] == 0, "the server still answers"


@pytest.mark.timeout(60)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=_METHOD,
    path=_PATH,
    query=_QUERY,
    version=_VERSION,
    headers=_HEADERS,
    body=st.binary(max_size=512),
    length=_LENGTH,
)
def test_fuzz_every_request_gets_a_2xx_or_4xx(
    fuzzed: DebugServer,
    method: str,
    path: str,
    query: str,
    version: str,
    headers: dict[str, str],
    body: bytes,
    length: str,
) -> None:
    request = _request(method, path, query, version, headers, body, length)
    _answered_well(fuzzed, raw(fuzzed, request, timeout=5.0))


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.binary(max_size=400))
def test_fuzz_raw_bytes_never_hang_or_break_the_server(fuzzed: DebugServer, garbage: bytes) -> None:
    reply = raw(fuzzed, garbage + b"\r\n\r\n", timeout=5.0)
    # A blank request line gets no reply (there was no request); anything else a 4xx.
    if reply or garbage.split(b"\n")[0].decode("latin-1").split():
        _answered_well(fuzzed, reply)
    else:
        assert get_json(fuzzed, "/health")["rank"] == 0
