"""Stacks of a process stuck holding the GIL: written by ``faulthandler``'s signal handler (C code
that needs no GIL) and collected by a healthy peer on the same host."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import IO

__all__ = ["STACK_SIGNAL", "arm_stack_signal", "collect_signal_stacks", "process_start_time"]

# A real-time signal: nothing else in a training process is likely to use it.
STACK_SIGNAL = signal.SIGRTMIN + 7

_armed: IO[str] | None = None


def arm_stack_signal(directory: Path, host: str) -> Path:
    """Make :data:`STACK_SIGNAL` write every thread's stack to a file, even while the GIL is
    held. Returns the file, which grows by one traceback block per signal."""
    global _armed
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{host}-{os.getpid()}.txt"
    if _armed is None:
        _armed = open(path, "a")  # noqa: SIM115 - must stay open for the signal handler
        faulthandler.register(STACK_SIGNAL, file=_armed, all_threads=True, chain=False)
    return path


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, from ``/proc``); None where unknown. With the
    pid it names one process: a pid alone may have been reused by an unrelated one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Field 22; the command name (field 2, in parentheses) may itself hold spaces.
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def collect_signal_stacks(
    pid: int, path: Path, timeout: float = 1.0, *, start_time: int | None = None
) -> str | None:
    """Signal ``pid`` and return what its handler appended to ``path``; None if nothing came.
    With ``start_time`` (see :func:`process_start_time`), a pid that now names another process
    is not signalled: the signal's default action would kill it."""
    if start_time is not None and process_start_time(pid) != start_time:
        return None
    start = _size(path)
    if start is None:
        return None
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return None
    # faulthandler writes from the signal handler without telling anyone it has finished; wait
    # for the file to grow and then stop growing.
    deadline = time.monotonic() + timeout
    size = start
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = _size(path)
        if now is None:  # removed meanwhile: nothing to collect
            return None
        if now > start and now == size:
            break
        size = now
    if size <= start:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(size - start).decode("utf-8", "replace")
    except OSError:
        return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
