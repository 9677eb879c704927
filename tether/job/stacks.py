"""Stacks of a rank that cannot write its own dump, as the rank itself prepares for it.

Every rank arms two ``faulthandler`` hooks on one per-process file (C code that needs no GIL):
the stack signal, which a same-host peer sends to a rank stuck holding the GIL (the fallback when
no agent reads stacks from outside), and the fatal signals (SIGSEGV, SIGABRT, SIGBUS, SIGFPE,
SIGILL), whose last words the launcher copies into the crash event. Where ``tether run``'s agent
reads its host's stacks from outside (py-spy, without disturbing the process), it says so in the
job's store (:func:`agent_key`), and no rank signals a peer.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import IO, Any

__all__ = [
    "FATAL_MARK",
    "STACKS_DIR",
    "STACK_SIGNAL",
    "agent_key",
    "arm_stack_signal",
    "collect_signal_stacks",
    "fatal_block",
    "process_start_time",
    "stack_file",
]

# A real-time signal: nothing else in a training process is likely to use it.
STACK_SIGNAL = signal.SIGRTMIN + 7
FATAL_MARK = "Fatal Python error: "
"""How faulthandler starts what it writes at a fatal signal."""
_AGENT = "tether/agent"

_armed: IO[str] | None = None


def agent_key(host: str) -> str:
    """The store key that the launcher's agent on ``host`` sets while it reads the stacks of
    that host's unresponsive ranks itself (JSON: its pid, the tool; on a job of several nodes
    also ``ranks``, this node's, whose dumps stay on this node's disk until it sends them)."""
    return f"{_AGENT}/{host}"


def node_ranks(store: Any, host: str) -> list[int] | None:
    """The ranks of ``host``'s node where the job spans several nodes (its agent said so), else
    None."""
    key = agent_key(host)
    if not store.check([key]):
        return None
    try:
        ranks = json.loads(store.get(key)).get("ranks")
    except (ValueError, AttributeError):
        return None
    return [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else None


STACKS_DIR = ".stacks"
"""Where, in the dump directory, each process keeps its stacks file."""


def stack_file(directory: Path, host: str, pid: int) -> Path:
    """The file process ``pid`` of ``host`` arms its stack signal and fatal signals on."""
    return directory / f"{host}-{pid}.txt"


def arm_stack_signal(directory: Path, host: str) -> Path:
    """Make :data:`STACK_SIGNAL` write every thread's stack to a file, even while the GIL is
    held, and a fatal signal write them there too (this replaces an earlier
    ``faulthandler.enable``: the event, not a worker's stderr, is where they are looked for).
    Returns the file, which grows by one traceback block per signal."""
    global _armed
    directory.mkdir(parents=True, exist_ok=True)
    path = stack_file(directory, host, os.getpid())
    if _armed is None:
        _armed = open(path, "a")  # noqa: SIM115 - must stay open for the signal handlers
        faulthandler.register(STACK_SIGNAL, file=_armed, all_threads=True, chain=False)
        faulthandler.enable(file=_armed, all_threads=True)
    return path


def fatal_block(path: Path, limit: int = 1 << 20) -> str | None:
    """What faulthandler wrote into ``path`` at the process's fatal signal (from the last
    ``Fatal Python error:`` to the end), or None when it wrote nothing of the kind."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - limit, 0))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    at = text.rfind(FATAL_MARK)
    return text[at:] if at >= 0 else None


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
