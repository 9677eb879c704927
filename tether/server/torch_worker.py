"""What torch's own debug frontend (``torch.distributed.debug``) asks of each worker, answered by
tether's rank server with torch's payloads, so that the frontend a user starts shows tether's
ranks and makes them dump, unchanged.

torch's frontend finds its workers in the store (``debug_server`` prefix, key ``rank<N>``: see
:mod:`tether.job.torch_debug`) and POSTs ``/handler/<name>?<args>`` to each. The routes and texts
are torch 2.15's (``control_plane/Handlers.cpp``, ``HealthCheckHook.cpp``):

    /handler/ping                       "pong"
    /handler/c10d_health_check          {"healthy": bool, "unhealthy_backends": [str]}
    /handler/fr_trace_json?backend=     the trace of that backend's groups, active entries only
    /handler/fr_dump_file?backend=      writes <prefix><rank> in the background, single-flight
    /handler/dump_traceback             every thread's stack, as faulthandler prints them

On gloo, torch (2.15 included) never marks a group unhealthy, so its frontend never dumps a
gloo job; tether's watchdog does, so the same frontend dumps every rank after a tether hang.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

from tether._log import get_logger
from tether.server.rank import format_stacks
from tether.server.web import Request, Response, Route, json_response

__all__ = ["TorchWorkerRoutes", "TorchWorkerSource"]

logger = get_logger(__name__)

DEFAULT_BACKEND = "gloo"
"""torch's ``kDefaultFRBackend``: what ``?backend=`` means when it is left out."""
_TEXT = "text/plain; charset=utf-8"


class TorchWorkerSource(Protocol):
    """What the routes read (:class:`tether.watchdog.report.RankReport` is one)."""

    def c10d_health(self) -> dict[str, Any]: ...
    def fr_ready(self) -> bool: ...
    def fr_trace(
        self, backend: str, *, stacks: bool, only_active: bool
    ) -> dict[str, Any] | None: ...
    def write_fr_file(self, backend: str) -> Path | None: ...
    def stacks(self) -> list[dict[str, Any]]: ...


class TorchWorkerRoutes:
    def __init__(self, source: TorchWorkerSource, *, rank: int) -> None:
        self.source = source
        self.rank = rank
        self._lock = threading.Lock()
        self._dumping = False

    def routes(self) -> Mapping[str, Mapping[str, Route]]:
        handlers: dict[str, Route] = {
            "ping": lambda _: _text(HTTPStatus.OK, "pong"),
            "c10d_health_check": lambda _: json_response(self.source.c10d_health()),
            "fr_trace_json": self.fr_trace_json,
            "fr_dump_file": self.fr_dump_file,
            "dump_traceback": self.dump_traceback,
        }
        # torch's frontend POSTs every fetch; a person with curl GETs.
        return {f"/handler/{name}": {"GET": r, "POST": r} for name, r in handlers.items()}

    def fr_trace_json(self, request: Request) -> Response:
        # 2.15 always answers with collectives and active entries only (no ``onlyactive=``).
        trace = self.source.fr_trace(_backend(request), stacks=False, only_active=True)
        if trace is None:
            return _unregistered()
        return json_response(trace)

    def fr_dump_file(self, request: Request) -> Response:
        backend = _backend(request)
        if not self.source.fr_ready():
            return _unregistered()
        with self._lock:
            if self._dumping:
                text = f"Flight Recorder dump already in progress for rank {self.rank}"
                return _text(HTTPStatus.OK, text)
            self._dumping = True
        threading.Thread(
            target=self._write, args=(backend,), name="tether-fr-dump-file", daemon=True
        ).start()
        return _text(HTTPStatus.OK, f"Flight Recorder dump initiated for rank {self.rank}")

    def _write(self, backend: str) -> None:
        try:
            self.source.write_fr_file(backend)
        except Exception:  # asked for over HTTP, answered already: the log is all that is left
            logger.exception("fr_dump_file: the dump failed")
        finally:
            with self._lock:
                self._dumping = False

    def dump_traceback(self, request: Request) -> Response:
        return _text(HTTPStatus.OK, format_stacks(self.source.stacks()))


def _backend(request: Request) -> str:
    return (request.param("backend") or DEFAULT_BACKEND).lower()


def _unregistered() -> Response:
    return _text(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "Flight Recorder rank is unset; no process group has registered with it yet",
    )


def _text(status: HTTPStatus, text: str) -> Response:
    return Response(status, text.encode(), _TEXT)
