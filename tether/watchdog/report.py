"""What a rank reports: its health, traces, stacks and metrics, read from the recorder and the
watchdog. The debug server serves these (``GET /health /trace /stacks /metrics`` and torch's
worker routes); reading never changes what the rank does: alarms, dumps and the job's store are
the rank's :class:`~tether.watchdog.link.JobLink`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any

from tether._log import get_logger
from tether._versions import backend_family
from tether.config import fr_dump_file
from tether.job.health import GroupHealth, HealthReport, InFlightOp
from tether.recorder.frames import python_stacks
from tether.recorder.group import RecordedGroup
from tether.recorder.recorder import Recorder
from tether.recorder.ring import Entry
from tether.recorder.writer import build_dump, torch_dump, write_torch_file
from tether.watchdog.link import JobLink
from tether.watchdog.metrics import RankMetrics
from tether.watchdog.watchdog import Watchdog

__all__ = ["RankReport"]

logger = get_logger(__name__)


class RankReport:
    """A read-only view of one rank. ``unhealthy_backends`` and ``alarm_events`` are the hang
    policy's and the job link's own (live) collections: this view reads them, never writes."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        watchdog: Watchdog,
        unhealthy_backends: Set[str],
        alarm_events: Counter[tuple[str, str]],
        alarm_source: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.recorder = recorder
        self._alarm_source = alarm_source
        self.config = recorder.config
        self._watchdog = watchdog
        self._unhealthy_backends = unhealthy_backends
        self._metrics = RankMetrics(recorder, watchdog, alarm_events)

    @classmethod
    def of(cls, link: JobLink) -> RankReport:
        """What the rank behind ``link`` reports: its recorder, its watchdog, the backends its hang
        policy found unhealthy and its alarm counts, read and never written."""
        return cls(
            link.recorder,
            watchdog=link.watchdog,
            unhealthy_backends=link.hang_policy.unhealthy_backends,
            alarm_events=link.events,
            alarm_source=lambda: link.responder.alarm_source if link.responder else None,
        )

    def health(self) -> HealthReport:
        rec, now = self.recorder, time.time_ns()
        inflight = rec.inflight()
        hung = self._watchdog.hung
        return {
            "rank": rec.global_rank,
            "world_size": rec.world_size,
            "host": rec.host,
            "pid": rec.pid,
            "healthy": self._watchdog.healthy,
            "hung": _describe(hung, now) if hung is not None else None,
            "hang_timeout_s": self.config.hang_timeout,
            "watchdog_heartbeat_age_s": (time.monotonic_ns() - self._watchdog.heartbeat_ns) / 1e9,
            "in_flight": [_describe(e, now) for e in inflight],
            "groups": {name: _group_health(g) for name, g in rec.groups.items()},
            "alarm_source": self._alarm_source(),
        }

    def trace(self) -> dict[str, Any]:
        return build_dump(self.recorder, reason="trace", event_id="live")

    # -- what torch's debug frontend asks of a worker (tether.server.torch_worker) ------------
    def c10d_health(self) -> dict[str, Any]:
        unhealthy = sorted(self._unhealthy_backends)
        return {"healthy": not unhealthy, "unhealthy_backends": unhealthy}

    def fr_ready(self) -> bool:
        """Whether a group of this process has formed (torch: a group "has registered")."""
        return self.recorder.global_rank >= 0 and bool(self.recorder.groups)

    def fr_trace(self, backend: str, *, stacks: bool, only_active: bool) -> dict[str, Any] | None:
        """This rank's trace as torch's recorder for ``backend`` holds it; None before
        :meth:`fr_ready`."""
        rec = self.recorder
        if not self.fr_ready():
            return None
        family = backend_family(backend)  # ?backend=nccl asks for nccl2's groups too (2.15)
        groups = [
            g for g in rec.groups.values() if family in map(backend_family, g.backends.values())
        ]
        data = build_dump(rec, reason="trace", event_id="live")
        data.pop("tether")  # torch's payload: its readers need none of it
        return torch_dump(data, stacks=stacks, only_active=only_active, groups=groups)

    def write_fr_file(self, backend: str) -> Path | None:
        """Write :meth:`fr_trace` (without stacks, as torch's ``fr_dump_file``) where torch
        writes it; None before any group has formed."""
        data = self.fr_trace(backend, stacks=False, only_active=self.config.fr_only_active)
        if data is None:
            return None
        path = write_torch_file(data, fr_dump_file(self.config, self.recorder.global_rank))
        logger.info("wrote torch's single-rank dump %s (asked through fr_dump_file)", path)
        return path

    def stacks(self) -> list[dict[str, Any]]:
        return python_stacks()

    def metrics(self) -> str:
        """Prometheus text exposition (see :mod:`tether.watchdog.metrics`)."""
        return self._metrics.exposition()


def _group_health(g: RecordedGroup) -> GroupHealth:
    status = g.status()
    return {
        "desc": g.desc,
        "ranks": g.ranks,
        "last_enqueued_collective": status["last_enqueued_collective"],
        "last_started_collective": status["last_started_collective"],
        "last_completed_collective": status["last_completed_collective"],
    }


def _describe(e: Entry, now_ns: int) -> InFlightOp:
    return {
        "record_id": e.record_id,
        "op": e.profiling_name,
        "group": e.group.name,
        "group_desc": e.group.desc,
        "collective_seq_id": e.collective_seq_id,
        "is_p2p": e.is_p2p,
        "state": e.state,
        "age_s": (now_ns - e.time_created_ns) / 1e9,
    }
