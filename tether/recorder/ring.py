"""The bounded ring of recorded operations.

Recording must cost a few microseconds, so the ring takes no lock: CPython makes ``next()`` on an
``itertools.count`` and a list item assignment atomic, and each entry is written by the thread that
issued the operation. Entries are mutated afterwards only to advance their state.
"""

from __future__ import annotations

import itertools
from typing import Any

from tether.events.ringfile import Fixed

__all__ = ["COMPLETED", "SCHEDULED", "STARTED", "Entry", "Ring"]

SCHEDULED = "scheduled"
STARTED = "started"
COMPLETED = "completed"


class Entry:
    """One recorded operation; field names follow torch's flight-recorder schema."""

    __slots__ = (
        "collective_seq_id",
        "error",
        "filed",
        "fixed",
        "frames",
        "group",
        "in_dtypes",
        "in_shapes",
        "is_p2p",
        "op_id",
        "out_dtypes",
        "out_shapes",
        "p2p_seq_id",
        "profiling_name",
        "record_id",
        "spec",
        "state",
        "thread_id",
        "time_completed_ns",
        "time_created_ns",
        "time_started_ns",
        "work",
    )

    def __init__(
        self,
        group: Any,
        spec: Any,
        profiling_name: str,
        collective_seq_id: int,
        p2p_seq_id: int,
        op_id: int,
        is_p2p: bool,
        in_shapes: list[Any],
        in_dtypes: list[Any],
        out_shapes: list[Any] | None,
        out_dtypes: list[Any] | None,
        frames: list[Any] | None,
        thread_id: int,
        time_created_ns: int,
    ) -> None:
        self.record_id = -1
        self.group = group
        self.spec = spec
        self.profiling_name = profiling_name
        self.collective_seq_id = collective_seq_id
        self.p2p_seq_id = p2p_seq_id
        self.op_id = op_id
        self.is_p2p = is_p2p
        self.in_shapes = in_shapes
        self.in_dtypes = in_dtypes
        self.out_shapes = out_shapes
        self.out_dtypes = out_dtypes
        self.frames = frames
        self.thread_id = thread_id
        self.time_created_ns = time_created_ns
        self.time_started_ns = 0
        self.time_completed_ns = 0
        self.state = SCHEDULED
        self.work: Any = None
        self.error: str | None = None
        """Set when the backend reported that the operation failed (see ``Recorder``)."""
        self.fixed: Fixed | None = None
        """The ring file's unchanging part of this entry's record, once written."""
        self.filed: str | None = None
        """The state the ring file last got for this entry (the Python recorder's)."""


class Ring:
    """Keeps the newest ``capacity`` entries; ``record_id`` grows forever, like torch's."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: list[Entry | None] = [None] * capacity
        self._ids = itertools.count()

    def add(self, entry: Entry) -> None:
        rid = next(self._ids)
        entry.record_id = rid
        self._slots[rid % self.capacity] = entry

    def snapshot(self) -> list[Entry]:
        """The entries now held, oldest first."""
        return sorted((e for e in list(self._slots) if e is not None), key=lambda e: e.record_id)
