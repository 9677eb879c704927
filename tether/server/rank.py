"""What every rank's debug server answers: this process's health, recorder, threads and metrics,
and a job-wide dump on request."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

from tether.config import Config
from tether.job.alarm import Alarm, AlarmBoard
from tether.job.health import HealthReport
from tether.server.web import Request, Response, Route, error_response, json_response

__all__ = ["RankEndpoints", "RankLink", "RankSource", "Source"]

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
MIN_DUMP_INTERVAL_S = 1.0
"""Each manual dump writes a file on every rank: a client retrying in a loop must not fill the
disk."""


class Source(Protocol):
    """What a rank reports (:class:`tether.watchdog.report.RankReport` is one): reads only."""

    def health(self) -> HealthReport: ...
    def trace(self) -> dict[str, Any]: ...
    def stacks(self) -> list[dict[str, Any]]: ...
    def metrics(self) -> str: ...


class Rank(Protocol):
    """Who the process is (the recorder is one)."""

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def host(self) -> str: ...


class RankSource(Source, Protocol):
    """A :class:`Source` with the settings and who it is (the rank's report is one)."""

    @property
    def config(self) -> Config: ...
    @property
    def recorder(self) -> Rank: ...


class RankLink(Protocol):
    """What the server does through the rank's link to the job (:class:`tether.watchdog.link.
    JobLink` is one): the job's store and name, publishing the server's address, raising a
    job-wide dump (``POST /dump``), and saying which files the server wrote."""

    @property
    def board(self) -> AlarmBoard | None: ...
    @property
    def job_id(self) -> str: ...
    def publish(self, **info: Any) -> None: ...
    def launcher_says_page(self) -> bool: ...
    def wrote(self, path: Path) -> None: ...
    def request_dump(self, reason: str = ...) -> Alarm: ...


class RankEndpoints:
    """``source``: what the GETs read; ``request_dump``: what ``POST /dump`` raises (the rank's
    link to the job: a read never makes an alarm)."""

    def __init__(
        self,
        source: Source,
        dump_dir: Path,
        *,
        request_dump: Callable[[str], Alarm],
        min_dump_interval: float = MIN_DUMP_INTERVAL_S,
    ) -> None:
        self.source = source
        self.request_dump = request_dump
        self.dump_dir = dump_dir
        self.min_dump_interval = min_dump_interval
        self._lock = threading.Lock()
        self._last_dump = -float("inf")

    def routes(self) -> Mapping[str, Mapping[str, Route]]:
        return {
            "/health": {"GET": lambda _: json_response(self.source.health())},
            "/trace": {"GET": lambda _: json_response(self.source.trace())},
            "/stacks": {"GET": self.stacks},
            "/metrics": {"GET": self.metrics},
            "/dump": {"POST": self.dump},
        }

    def stacks(self, request: Request) -> Response:
        """Every thread's stack: JSON, or text for people with ``?format=text``."""
        stacks = self.source.stacks()
        if request.param("format") == "text":
            return Response(
                HTTPStatus.OK, format_stacks(stacks).encode(), "text/plain; charset=utf-8"
            )
        return json_response(stacks)

    def metrics(self, request: Request) -> Response:
        return Response(HTTPStatus.OK, self.source.metrics().encode(), PROMETHEUS_TEXT)

    def dump(self, request: Request) -> Response:
        """Make every rank of the job dump into one new event (the dumps land asynchronously)."""
        with self._lock:
            wait = self._last_dump + self.min_dump_interval - time.monotonic()
            if wait > 0:
                return error_response(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"one dump per {self.min_dump_interval:g} s; retry later",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
            self._last_dump = time.monotonic()
        alarm = self.request_dump("manual")
        return json_response(
            {
                "event_id": alarm.event_id,
                "dir": str(self.dump_dir / alarm.event_id),
                "epoch": alarm.epoch,
                "origin": alarm.origin,
            },
            HTTPStatus.ACCEPTED,
        )


def format_stacks(stacks: list[dict[str, Any]]) -> str:
    """Threads as Python prints tracebacks, most recent call first (like faulthandler)."""
    lines = []
    for thread in stacks:
        daemon = " (daemon)" if thread.get("daemon") else ""
        name = f"Thread {thread['thread_id']} {thread['thread_name']!r}{daemon}"
        lines.append(f"{name}, most recent call first:")
        lines += [
            f'  File "{f["filename"]}", line {f["line"]}, in {f["name"]}' for f in thread["frames"]
        ]
        lines.append("")
    return "\n".join(lines)
