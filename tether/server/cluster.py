"""Rank 0's view of the whole job: every rank's health, who holds the job back, the dump events;
as JSON (``/api/cluster``, ``/api/events``), as a live page (``/``), and every rank's metrics in
one Prometheus exposition (``/metrics/job``).

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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from tether.job.alarm import Alarm, AlarmBoard
from tether.job.health import HealthReport
from tether.server.blame import group_label, holding_back
from tether.server.jobmetrics import job_exposition
from tether.server.page import page_response
from tether.server.rank import PROMETHEUS_TEXT, Source
from tether.server.web import Request, Response, Route, error_response, json_response

__all__ = ["Cluster", "Round", "fetch", "fetch_health", "fetch_metrics"]

FETCH_TIMEOUT_S = 0.5
MAX_ANSWER_BYTES = 8 << 20
"""The most read of one rank's answer; a longer one counts as no answer."""
MAX_ROUND_BYTES = 256 << 20
"""The most read of all ranks' answers to one request (a large job whose every rank answers
too much must not exhaust rank 0's memory either); past it, the ranks still sending count as
not answering."""
MAX_FETCHERS = 32
EVENTS_SHOWN = 20

Health = HealthReport
T = TypeVar("T")
Answer = tuple[T | None, str | None]
"""What a rank answered, or None and why not."""


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
        self._alarms: list[Alarm] = []
        self._done: dict[int, dict[int, str]] = {}

    def routes(self) -> Mapping[str, Mapping[str, Route]]:
        return {
            "/": {"GET": lambda _: page_response()},
            "/api/cluster": {"GET": lambda _: json_response(self.view())},
            "/api/events": {"GET": self.events_route},
            "/metrics/job": {"GET": self.job_metrics},
        }

    def job_metrics(self, request: Request) -> Response:
        """Every rank's ``/metrics``, each sample labelled with its rank, and ``tether_rank_up``."""
        answers = self._ask_all(self.urls(), self.local.metrics, fetch_metrics)
        return Response(HTTPStatus.OK, job_exposition(answers), PROMETHEUS_TEXT)

    def view(self) -> dict[str, Any]:
        urls = self.urls()
        answers = self._ask_all(urls, self.local.health, fetch_health)
        healths = {rank: health for rank, (health, _) in answers.items()}
        blamed = {h.rank: h.reason for h in holding_back(healths)}
        return {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "time_ns": time.time_ns(),
            "holding_back": [{"rank": r, "reason": why} for r, why in sorted(blamed.items())],
            "ranks": [
                _row(rank, urls.get(rank), *answers[rank], blamed.get(rank))
                for rank in range(self.world_size)
            ],
            "events": self.events()[-EVENTS_SHOWN:],
        }

    def urls(self) -> dict[int, str]:
        """Each rank's debug server, as published in the store (each cached once known)."""
        with self._store_lock:
            for rank in (r for r in range(self.world_size) if r not in self._urls):
                info = self.board.proc(rank)
                if info is not None and info.get("debug_url"):
                    self._urls[rank] = str(info["debug_url"])
            return dict(self._urls)

    def _ask_all(
        self,
        urls: Mapping[int, str],
        local: Callable[[], T],
        ask: Callable[[str, str | None, float, Round], Answer[T]],
    ) -> dict[int, Answer[T]]:
        """Every rank's answer to ``ask`` (this rank's own from ``local``), or None and why not."""
        answers: dict[int, Answer[T]] = {
            rank: (None, "no debug server published") for rank in range(self.world_size)
        }
        answers[self.rank] = (local(), None)  # no round trip to ourselves
        others = {rank: url for rank, url in urls.items() if rank != self.rank}
        if not others:
            return answers
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
        return answers

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


def _row(
    rank: int, url: str | None, health: Health | None, error: str | None, reason: str | None
) -> dict[str, Any]:
    """One rank, as the page shows it; ``health`` keeps everything else."""
    row: dict[str, Any] = {
        "rank": rank,
        "url": url,
        "answered": health is not None,
        "error": error,
        "holding_back": reason is not None,
        "reason": reason,
        "state": _state(health, reason),
        "health": health,
    }
    if health is None:
        return row
    in_flight = health.get("in_flight", [])
    slowest = max(in_flight, key=lambda op: op["age_s"], default=None)
    oldest: dict[str, Any] | None = None
    if slowest is not None:
        label = group_label(slowest["group"], slowest.get("group_desc"))
        oldest = {**slowest, "group_label": label}
    return row | {
        "host": health.get("host"),
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


def _state(health: Health | None, reason: str | None) -> str:
    """One word for the rank, as its badge shows it. A rank holding the others back is not
    "healthy", whatever its own watchdog says: it has nothing in flight to time out, which is
    the point (the culprit of a hang is usually the one rank that looks fine on its own)."""
    if health is None:
        return "no answer"
    if reason is not None:
        return "holding back"
    return "healthy" if health.get("healthy", True) else "hung"
