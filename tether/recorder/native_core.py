"""The native core's interface, typed: what ``tether._native_<torch release>`` holds.

The core's module is named after the torch it was built for
(:func:`tether._versions.native_module`), so no ``.pyi`` beside it can be matched by mypy;
:func:`tether.recorder.native.load` returns the module as a :class:`NativeModule` instead. These
classes are the stub: they say what ``tether/csrc/bindings.cpp`` binds, no more, and
``tests/core/test_native.py`` checks them against the loaded module both ways (every name here
exists there with these parameters, and every name bound there is here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tether.events.ringfile import RecordLayout

__all__ = ["Core", "NativeModule", "RecordingBackend"]

Row = tuple[Any, ...]
"""One entry of :meth:`Core.snapshot`, in the order ``NativeRecorder._entry`` unpacks it."""


class Core(Protocol):
    """The core: the ring of records, each group's counters, and completion tracking."""

    def __init__(
        self,
        capacity: int,
        stack_depth: int,
        is_library: Callable[[str], bool],
        walk_on: int,
        p2p_seq_base: int,
        ring_path: str,
        records_at: int,
    ) -> None: ...
    @property
    def ring_file_open(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    def add_group(self, rank: int) -> int: ...
    def reap(self, min_age_ns: int) -> None: ...
    def inflight(self) -> list[int]: ...
    def oldest_inflight(self) -> int: ...
    def suspect(self, gid: int) -> list[int]: ...
    def snapshot(self, only: list[int] = ...) -> list[Row]: ...
    def group_status(self, gid: int) -> tuple[int, int, int, int, int]: ...
    def regroup(self, gid: int, rank: int) -> None: ...
    def last_done(self, gid: int) -> tuple[int | None, Any]: ...
    def forget_last_done(self, gid: int, rid: int) -> None: ...
    def mark_failed(self, rid: int, error: str) -> None: ...
    def finish(self, rid: int) -> None: ...
    def set_stack_depth(self, depth: int) -> None: ...
    def bugs(self) -> list[str]: ...
    def fail_next(self, what: str, n: int) -> None: ...


class RecordingBackend(Protocol):
    """A group's recording backend (a ``torch.distributed.Backend``): what tether calls on it
    besides torch's own methods, which it answers for the backend it wraps."""

    def __init__(
        self,
        core: Core,
        gid: int,
        rank: int,
        size: int,
        inners: list[tuple[str, Any, str]],  # (device, its c10d backend, its name in dumps)
        default_device: str,
    ) -> None: ...
    @property
    def attached(self) -> bool: ...
    def inner(self, device: str) -> Any: ...
    def set_ready(self, ready: bool) -> None: ...
    def attach(self, gid: int) -> None: ...
    def replace(self, backend: Any, rank: int, size: int) -> None: ...


class NativeModule(Protocol):
    """The core's module."""

    ABI: int
    TORCH_VERSION: str
    RECORD_LAYOUT: RecordLayout
    Core: type[Core]
    RecordingBackend: type[RecordingBackend]
