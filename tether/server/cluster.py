"""Rank 0's view of the whole job: every rank's health, who holds the job back, the dump events;
as JSON (``/api/cluster``, ``/api/events``), as a live page (``/``), and every rank's metrics in
one Prometheus exposition (``/metrics/job``).

A request is answered from what rank 0 holds: while anyone looks (:data:`WATCHED_S` after the
last request), a thread of its own asks every rank again every :data:`HEALTH_EVERY_S` (their
metrics every :data:`METRICS_EVERY_S`), so a page at 1,024 ranks answers at once rather than
after a round of 1,024 requests; the first request after a quiet spell waits for a round. Ranks
are grouped by node (their host), the node holding the job back first.

Ranks are asked in parallel with a short timeout, so one that does not answer (stuck holding the
GIL, dead, on an unreachable host) is shown as such and delays the page by one timeout at most.
A rank that answers too slowly or too much (a trickle, an endless body) costs rank 0 no more: at
the round's deadline its connection is cut, and an answer is read up to :data:`MAX_ANSWER_BYTES`
(all of them up to :data:`MAX_ROUND_BYTES`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from http import HTTPStatus
from pathlib import Path
from typing import Any, Generic, TypeVar, cast
from urllib.parse import urlsplit

from tether.job.alarm import Alarm, AlarmBoard
from tether.job.health import HealthReport
from tether.server.blame import group_label, holding_back
from tether.server.jobmetrics import Families, job_exposition, parse_exposition
from tether.server.page import page_response
from tether.server.rank import PROMETHEUS_TEXT, Source
from tether.server.web import Request, Response, Route, error_response, json_response

__all__ = ["Cluster", "Held", "Round", "fetch", "fetch_health", "fetch_metrics"]

FETCH_TIMEOUT_S = 0.5
MAX_ANSWER_BYTES = 8 << 20
"""The most read of one rank's answer; a longer one counts as no answer."""
MAX_ROUND_BYTES = 256 << 20
"""The most read of all ranks' answers to one request (a large job whose every rank answers
too much must not exhaust rank 0's memory either); past it, the ranks still sending count as
not answering."""
MAX_FETCHERS = 32
EVENTS_SHOWN = 20
HEALTH_EVERY_S = 1.0
"""How often every rank's health is asked again while anyone looks: half the page's refresh."""
METRICS_EVERY_S = 5.0
"""How often every rank's metrics are asked again while scraped: a third of Prometheus' usual
scrape interval (15 s). Parsing 1,024 ranks' expositions costs rank 0 about 0.7 s of a core."""
BUSY_RATIO = 3.0
"""A round of asking is followed by at least this many times its length of rest."""
WATCHED_S = 30.0
"""How long after the last request rank 0 goes on asking."""
FIRST_ROUND_WAIT_S = 30.0
"""The longest a request waits for the first round after a quiet spell (a round is bounded by
twice the fetch timeout, but reading the addresses from the store is not)."""
RANK_LABELS_MAX = 64
"""Above this many ranks, ``/metrics/job`` aggregates per node unless asked ``?by=rank``: its
size then grows with the nodes, not the ranks (64 ranks x ~40 samples is already 2,500)."""

Health = HealthReport
T = TypeVar("T")
Answer = tuple[T | None, str | None]
"""What a rank answered, or None and why not."""
Answers = dict[int, Answer[T]]
WORST_FIRST = ("holding back", "no answer", "hung", "healthy")
"""A rank's states, the worst first: a node's is that of its worst rank."""


@dataclasses.dataclass(frozen=True, slots=True)
class Asked(Generic[T]):
    """One round of asking every rank: where each is served, on which host (as it published:
    a rank that did not is on no known host), and its answer."""

    urls: dict[int, str]
    hosts: dict[int, str]
    answers: Answers[T]


class Cluster:
    def __init__(
        self,
        board: AlarmBoard,
        *,
        local: Source,
        rank: int,
        world_size: int,
        token: str | None,
        dump_dir: Path,
        job_id: str,
        fetch_timeout: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.board = board
        self.local = local
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.dump_dir = dump_dir
        self.job_id = job_id
        self.fetch_timeout = fetch_timeout
        self._store_lock = threading.Lock()
        """One store connection, shared by the server's threads: one request on it at a time."""
        self._urls: dict[int, str] = {}
        self._hosts: dict[int, str] = {}
        self._alarms: list[Alarm] = []
        self._done: dict[int, dict[int, str]] = {}
        self._health = Held(
            lambda: self._ask_all(self.local.health, fetch_health),
            every=HEALTH_EVERY_S,
            name="tether-cluster-health",
        )
        self._metrics = Held(
            lambda: _parsed(self._ask_all(self.local.metrics, fetch_metrics)),
            every=METRICS_EVERY_S,
            name="tether-cluster-metrics",
        )

    def routes(self) -> Mapping[str, Mapping[str, Route]]:
        return {
            "/": {"GET": lambda _: page_response()},
            "/api/cluster": {"GET": self.cluster_route},
            "/api/events": {"GET": self.events_route},
            "/metrics/job": {"GET": self.job_metrics},
        }

    def close(self) -> None:
        """Stop asking the ranks (the threads end within one round)."""
        self._health.close()
        self._metrics.close()

    def job_metrics(self, request: Request) -> Response:
        """Every rank's ``/metrics`` with its rank, and ``tether_rank_up``; per node above
        :data:`RANK_LABELS_MAX` ranks or with ``?by=node`` (``?by=rank`` asks for every rank)."""
        by = request.param("by") or ("rank" if self.world_size <= RANK_LABELS_MAX else "node")
        if by not in ("rank", "node"):
            return error_response(HTTPStatus.BAD_REQUEST, f"by=rank or by=node, not {by!r}")
        asked = self._metrics.get(FIRST_ROUND_WAIT_S)
        if asked is None:
            return _not_yet()
        parsed = {rank: families for rank, (families, _) in asked.answers.items()}
        nodes = asked.hosts if by == "node" else None
        return Response(HTTPStatus.OK, job_exposition(parsed, nodes=nodes), PROMETHEUS_TEXT)

    def cluster_route(self, request: Request) -> Response:
        """The view; ``?brief=1`` leaves out each rank's whole health (what the page asks)."""
        view = self.view(brief=request.param("brief") not in (None, "0"))
        return json_response(view) if view is not None else _not_yet()

    def view(self, *, brief: bool = False) -> dict[str, Any] | None:
        """The job as the page shows it; None if no round of asking ended in time."""
        asked = self._health.get(FIRST_ROUND_WAIT_S)
        if asked is None:
            return None
        healths = {rank: health for rank, (health, _) in asked.answers.items()}
        blamed = {h.rank: h.reason for h in holding_back(healths)}
        rows = [_row(rank, asked, blamed.get(rank), brief=brief) for rank in range(self.world_size)]
        return {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "time_ns": time.time_ns(),
            "holding_back": [{"rank": r, "reason": why} for r, why in sorted(blamed.items())],
            "nodes": _nodes(rows),
            "ranks": rows,
            "events": self.events()[-EVENTS_SHOWN:],
        }

    def _published(self) -> tuple[dict[int, str], dict[int, str]]:
        """Each rank's debug server and host, as published in the store (each cached once
        known)."""
        with self._store_lock:
            for rank in (r for r in range(self.world_size) if r not in self._urls):
                info = self.board.proc(rank)
                if info is not None and info.get("debug_url"):
                    self._urls[rank] = str(info["debug_url"])
                    if info.get("host"):
                        self._hosts[rank] = str(info["host"])
            return dict(self._urls), dict(self._hosts)

    def _ask_all(
        self, local: Callable[[], T], ask: Callable[[str, str | None, float, Round], Answer[T]]
    ) -> Asked[T]:
        """Every rank's answer to ``ask`` (this rank's own from ``local``), or None and why not."""
        urls, hosts = self._published()
        answers: Answers[T] = {
            rank: (None, "no debug server published") for rank in range(self.world_size)
        }
        answers[self.rank] = (local(), None)  # no round trip to ourselves
        others = {rank: url for rank, url in urls.items() if rank != self.rank}
        if not others:
            return Asked(urls, hosts, answers)
        pool = ThreadPoolExecutor(
            min(MAX_FETCHERS, len(others)), thread_name_prefix="tether-debug-fetch"
        )
        round_ = Round()
        futures = {
            pool.submit(ask, url, self.token, self.fetch_timeout, round_): rank
            for rank, url in others.items()
        }
        # A deadline for the whole round: a rank's timeout applies to each socket operation.
        done, _ = wait(futures, timeout=2 * self.fetch_timeout)
        round_.end()  # the threads of ranks still answering end now, not when those ranks stop
        pool.shutdown(wait=False, cancel_futures=True)
        for future, rank in futures.items():
            answers[rank] = future.result() if future in done else (None, "timed out")
        with self._store_lock:
            for rank, (value, _why) in answers.items():
                if value is None and self._urls.get(rank) == others.get(rank):
                    # Read again from the store next time: an elastic replacement serves the
                    # rank from a new address, and the old one never answers again.
                    self._urls.pop(rank, None)
        return Asked(urls, hosts, answers)

    def events(self) -> list[dict[str, Any]]:
        """Every dump event raised through the job's alarms, oldest first."""
        with self._store_lock:
            while (alarm := self.board.get(len(self._alarms) + 1)) is not None:
                self._alarms.append(alarm)
            for alarm in self._alarms:
                # An event is final once every rank has done its part; before, ask again.
                if len(self._done.get(alarm.epoch, ())) < self.world_size:
                    self._done[alarm.epoch] = self.board.done(alarm.epoch, self.world_size)
            return [
                {
                    **dataclasses.asdict(alarm),
                    "dir": str(self.dump_dir / alarm.event_id),
                    "done": {str(rank): what for rank, what in self._done[alarm.epoch].items()},
                }
                for alarm in self._alarms
            ]

    def events_route(self, request: Request) -> Response:
        """All events, or with ``?id=`` one event and the files of its directory on this host."""
        events = self.events()
        wanted = request.param("id")
        if wanted is None:
            return json_response(events)
        event = next((e for e in events if e["event_id"] == wanted), None)
        if event is None:
            return error_response(HTTPStatus.NOT_FOUND, f"no dump event {wanted!r}")
        directory = Path(event["dir"])
        files = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        return json_response({**event, "files": files})


class Round:
    """The connections of one round of asking, cut when its deadline passes (:meth:`end`): a
    socket timeout bounds each read, not a rank that sends a byte just before each expires."""

    def __init__(self, budget: int = MAX_ROUND_BYTES) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._over = False
        self._budget = budget

    def spend(self, n: int) -> bool:
        """Take ``n`` bytes of the round's budget; False once it is spent."""
        with self._lock:
            self._budget -= n
            return self._budget >= 0

    def join(self, sock: socket.socket) -> bool:
        """Cut ``sock`` at the end; False (and nothing to ask) if the round is already over."""
        with self._lock:
            if not self._over:
                self._socks.add(sock)
            return not self._over

    def leave(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def end(self) -> None:
        with self._lock:
            self._over = True
            socks, self._socks = self._socks, set()
        for sock in socks:
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading it

    @property
    def over(self) -> bool:
        return self._over


def fetch(
    url: str,
    path: str,
    token: str | None,
    timeout: float,
    round_: Round | None = None,
    *,
    limit: int = MAX_ANSWER_BYTES,
) -> Answer[bytes]:
    """``GET url + path``: the body of a 200 of at most ``limit`` bytes, or None and why not.
    Never raises."""
    try:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    except ValueError as exc:
        return None, f"bad address {url!r}: {exc}"
    sock: socket.socket | None = None
    try:
        conn.connect()
        sock = conn.sock
        if round_ is not None and sock is not None and not round_.join(sock):
            return None, "timed out"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        if response.status != HTTPStatus.OK:
            return None, f"HTTP {response.status}"
        if (response.length or 0) > limit:
            return None, f"an answer of {response.length} bytes (at most {limit} are read)"
        body = bytearray()
        while chunk := response.read1(65536):
            body += chunk
            if len(body) > limit:
                return None, f"an answer of more than {limit} bytes"
            if round_ is not None and not round_.spend(len(chunk)):
                return None, "the ranks' answers together were too long"
        return bytes(body), None
    except TimeoutError:
        return None, "timed out"
    except (OSError, http.client.HTTPException) as exc:
        if round_ is not None and round_.over:  # cut by the round's deadline
            return None, "timed out"
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        if round_ is not None and sock is not None:
            round_.leave(sock)
        conn.close()


def fetch_health(
    url: str, token: str | None, timeout: float, round_: Round | None = None
) -> Answer[Health]:
    """``GET url/health``: the health, or None and why not. Never raises."""
    body, error = fetch(url, "/health", token, timeout, round_)
    if body is None:
        return None, error
    try:
        health = json.loads(body)
    except ValueError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(health, dict):
        return None, "not a health report"
    return cast(HealthReport, health), None  # read with .get: a key may be missing


def fetch_metrics(
    url: str, token: str | None, timeout: float, round_: Round | None = None
) -> Answer[str]:
    """``GET url/metrics``: the exposition text, or None and why not. Never raises."""
    body, error = fetch(url, "/metrics", token, timeout, round_)
    if body is None:
        return None, error
    try:
        return body.decode(), None
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8: {exc}"


class Held(Generic[T]):
    """The latest result of ``ask``, asked again by a thread of its own while anyone wants it
    (:data:`WATCHED_S` after the last :meth:`get`): every ``every`` seconds, or
    :data:`BUSY_RATIO` times as long as asking took if that is longer. A request takes what is
    held and never waits for a round, except the first after a quiet spell: what was held then
    is out of date, and it waits for the next."""

    def __init__(self, ask: Callable[[], T], *, every: float, name: str) -> None:
        self._ask = ask
        self._every = every
        self._name = name
        self._cond = threading.Condition()
        self._held: T | None = None
        self._error: Exception | None = None
        self._wanted_at = 0.0
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def get(self, timeout: float) -> T | None:
        """What is held; None if the first round did not end within ``timeout`` seconds. An
        error of the last round (the store gone) is raised."""
        with self._cond:
            self._wanted_at = time.monotonic()
            if self._thread is None and not self._closed.is_set():
                self._held = self._error = None
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.wait_for(lambda: self._held is not None or self._error is not None, timeout)
            if self._error is not None:
                raise self._error
            return self._held

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while True:
            start = time.monotonic()
            try:
                held, error = self._ask(), None
            except Exception as exc:  # e.g. the store is gone: each request says so
                held, error = None, exc
            with self._cond:
                self._held, self._error = held, error
                self._cond.notify_all()
                if time.monotonic() - self._wanted_at > WATCHED_S:
                    self._thread = None  # the next request starts another
                    return
            # Asking takes at most a quarter of the time: a round of 0.7 s (1,024 ranks) waits
            # 2.1 s for the next, rank 0 is a training rank too.
            if self._closed.wait(max(self._every, BUSY_RATIO * (time.monotonic() - start))):
                return


def _not_yet() -> Response:
    return error_response(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"no round of asking the ranks ended within {FIRST_ROUND_WAIT_S:.0f} s; try again",
    )


def _parsed(asked: Asked[str]) -> Asked[Families]:
    """The ranks' expositions parsed once per round, not per scrape (0.7 s at 1,024 ranks); a
    text that cannot be parsed counts as no answer."""
    answers: Answers[Families] = {
        rank: parse_exposition(text) if text is not None else (None, why)
        for rank, (text, why) in asked.answers.items()
    }
    return Asked(asked.urls, asked.hosts, answers)


def _row(rank: int, asked: Asked[Health], reason: str | None, *, brief: bool) -> dict[str, Any]:
    """One rank, as the page shows it; ``health`` keeps everything else (left out if
    ``brief``)."""
    health, error = asked.answers[rank]
    row: dict[str, Any] = {
        "rank": rank,
        "url": asked.urls.get(rank),
        "host": (health or {}).get("host") or asked.hosts.get(rank),
        "answered": health is not None,
        "error": error,
        "holding_back": reason is not None,
        "reason": reason,
        "state": _state(health, reason),
    }
    if not brief:
        row["health"] = health
    if health is None:
        return row
    in_flight = health.get("in_flight", [])
    slowest = max(in_flight, key=lambda op: op["age_s"], default=None)
    oldest: dict[str, Any] | None = None
    if slowest is not None:
        label = group_label(slowest["group"], slowest.get("group_desc"))
        oldest = {**slowest, "group_label": label}
    return row | {
        "pid": health.get("pid"),
        "healthy": health.get("healthy"),
        "in_flight": len(in_flight),
        "oldest_in_flight": oldest,
        "last_completed": [
            {
                "group": name,
                "group_label": group_label(name, group.get("desc")),
                "seq": group.get("last_completed_collective"),
            }
            for name, group in health.get("groups", {}).items()
        ],
        "heartbeat_age_s": health.get("watchdog_heartbeat_age_s"),
    }


def _nodes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks grouped by host: each node's ranks, its worst state and how many of its ranks
    are in each; the nodes holding the job back first, then by worst state, then by rank."""
    by_host: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(row)
    nodes = [
        {
            "host": host,
            "ranks": [row["rank"] for row in members],
            "state": min((row["state"] for row in members), key=WORST_FIRST.index),
            "states": dict(Counter(row["state"] for row in members)),
            "holding_back": [row["rank"] for row in members if row["holding_back"]],
        }
        for host, members in by_host.items()
    ]
    nodes.sort(key=lambda n: (not n["holding_back"], WORST_FIRST.index(n["state"]), n["ranks"]))
    return nodes


def _state(health: Health | None, reason: str | None) -> str:
    """One word for the rank, as its badge shows it. A rank holding the others back is not
    "healthy", whatever its own watchdog says: it has nothing in flight to time out, which is
    the point (the culprit of a hang is usually the one rank that looks fine on its own)."""
    if health is None:
        return "no answer"
    if reason is not None:
        return "holding back"
    return "healthy" if health.get("healthy", True) else "hung"
