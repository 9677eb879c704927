"""The per-process recorder: the ring, the groups, and what is in flight.

Completion is discovered by polling each in-flight ``Work`` from the watchdog thread, the way
torch's NCCL watchdog polls CUDA events. A completion callback would run Python on the backend's
own worker threads and make them queue for the GIL behind the training loop.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from tether.config import Config
from tether.recorder.group import RecordedGroup
from tether.recorder.ring import Entry, Ring
from tether.recorder.work import WaitReportingWork

__all__ = ["Recorder"]


class Recorder:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stack_depth = config.stack_depth
        self.ring = Ring(config.ring_size)
        self.groups: dict[str, RecordedGroup] = {}
        self.global_rank = -1
        self.world_size = -1
        self.clock_offset_ns = 0
        """Add to this process's ``time.time_ns()`` to get rank 0's clock (estimated at init)."""
        self.clock_error_ns = 0
        self.store: Any = None
        """The default group's store: where ranks agree on dump event ids."""
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._inflight: dict[int, Entry] = {}
        self.suspicion: dict[int, Entry] = {}
        """Entries kept past ring eviction because their group looked stuck."""
        self._lock = threading.Lock()

    # -- groups -----------------------------------------------------------------------------
    def add_group(
        self,
        *,
        name: str,
        desc: str,
        ranks: list[int],
        group_rank: int,
        backends: dict[str, str],
        timeout_ms: int,
    ) -> RecordedGroup:
        with self._lock:
            group = RecordedGroup(
                self,
                uid=len(self.groups),
                name=name,
                desc=desc,
                ranks=ranks,
                group_rank=group_rank,
                backends=backends,
                timeout_ms=timeout_ms,
            )
            # A destroyed group's name can be reused by a new group; the old entries keep
            # pointing at the old object, so their metadata stays right.
            self.groups[name] = group
        return group

    # -- completion tracking ----------------------------------------------------------------
    def track(self, entry: Entry) -> None:
        self._inflight[entry.record_id] = entry

    def finish(self, entry: Entry) -> None:
        """Mark ``entry`` completed now (for works that report completion only through wait)."""
        if self._inflight.pop(entry.record_id, None) is not None:
            entry.group.completed(entry, time.time_ns())

    def reap(self) -> None:
        """Mark every in-flight entry whose work has finished as completed."""
        now = time.time_ns()
        for rid, entry in self._inflight.copy().items():  # copy(): atomic, list() is not
            work = entry.work
            if isinstance(work, WaitReportingWork):
                continue  # finished by its wait()
            try:
                done = work is None or work.is_completed()
            except Exception:  # a failed work is finished too; its error is the caller's
                done = True
            if done and self._inflight.pop(rid, None) is not None:
                entry.group.completed(entry, now)

    def inflight(self) -> list[Entry]:
        return sorted(self._inflight.copy().values(), key=lambda e: e.record_id)

    def oldest_inflight(self) -> Entry | None:
        entries = self._inflight.copy().values()
        return min(entries, key=lambda e: e.time_created_ns) if entries else None

    def suspect(self, group: RecordedGroup) -> None:
        """Keep ``group``'s entries now in the ring, so traffic on other groups cannot push
        them out before a dump."""
        kept = {e.record_id: e for e in self.ring.snapshot() if e.group is group}
        self.suspicion.update(kept)
