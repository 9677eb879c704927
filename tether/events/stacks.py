"""``stacks_<rank>.txt``: the threads of a rank that could not write its own dump.

Written into the event directory by whoever could read the rank from outside: the launcher's
agent on the rank's host (py-spy, reading the interpreter's memory without stopping it), a
same-host peer (``faulthandler`` through a signal, the fallback), or the launcher after the rank
died of a fatal signal (what ``faulthandler`` wrote at that moment). One file, two parts:

- the first line, ``# tether-stacks {json}``: a :class:`StacksHeader`, what the reader needs to
  weigh the stacks (how they were read, whether the rank was alive, what it was doing in the
  kernel);
- the body, in ``faulthandler``'s text format whichever tool read it (``Thread 0x... (most
  recent call first):`` blocks of ``  File "f", line N in func``), so there is one parser. Lines
  starting with ``#`` are comments (the native frames, when the tool gave them, and notes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypedDict

from tether.events.layout import stacks_file, write_atomic

__all__ = [
    "HEADER_PREFIX",
    "Method",
    "StacksHeader",
    "When",
    "format_header",
    "parse_header",
    "read_stacks_text",
    "stacks_file",
    "stacks_rank",
    "write_stacks",
]

HEADER_PREFIX = "# tether-stacks "

Method = Literal["py-spy", "faulthandler", "fatal-signal"]
"""``py-spy``: read from outside, the process not disturbed; ``faulthandler``: a peer signalled
the rank and its handler wrote them (the signal interrupts the system call it was in);
``fatal-signal``: written by ``faulthandler`` as the rank died (SIGSEGV, SIGABRT, SIGBUS,
SIGFPE, SIGILL)."""

When = Literal["unresponsive", "death"]
"""``unresponsive``: the rank was alive but did not answer an alarm; ``death``: at its death."""


class StacksHeader(TypedDict, total=False):
    rank: int
    """Global rank."""
    host: str
    pid: int
    method: Method
    when: When
    event: str
    """The alarm's event id."""
    state: str | None
    """The process's scheduler state when read (``/proc/<pid>/stat``): ``running``,
    ``sleeping``, ``disk-sleep`` (stuck in the kernel), ``stopped`` (SIGSTOP), ``tracing-stop``,
    ``zombie``; None where unknown."""
    syscall: str | None
    """The system call the main thread was blocked in (``nanosleep``, ``futex``, ``read``...),
    or its kernel wait channel, where ``/proc`` says; None otherwise."""
    signal: str | None
    """How the rank died (``SIGABRT``), for ``when == "death"``."""
    note: str
    """Anything the writer could not collect, and why."""


MAX_TEXT = 1 << 20
"""Bytes of a stacks file read: far more than any real one (a few KB per thread), and a bound
on what a corrupt or hostile one costs."""


def read_stacks_text(path: Path) -> str:
    """The first :data:`MAX_TEXT` bytes of a stacks file as text. Raises OSError."""
    with open(path, "rb") as f:
        return f.read(MAX_TEXT).decode("utf-8", errors="replace")


def stacks_rank(name: str) -> int | None:
    """The rank a file name in an event directory is the stacks file of, or None."""
    if name.startswith("stacks_") and name.endswith(".txt"):
        digits = name[len("stacks_") : -len(".txt")]
        # isdigit() alone takes "²", which int() refuses: a hostile name must not crash a reader.
        if digits.isascii() and digits.isdigit():
            return int(digits)
    return None


def format_header(header: StacksHeader) -> str:
    """The file's first line, newline included."""
    return HEADER_PREFIX + json.dumps(header, sort_keys=True) + "\n"


def parse_header(text: str) -> StacksHeader | None:
    """The header of a stacks file's text, or None when it has none (an older writer) or it is
    malformed: the body is still readable without it."""
    first = text.split("\n", 1)[0]
    if not first.startswith(HEADER_PREFIX):
        return None
    try:
        data = json.loads(first[len(HEADER_PREFIX) :])
    except (ValueError, RecursionError):  # RecursionError: a header of deeply nested arrays
        return None
    if not isinstance(data, dict):
        return None
    out: StacksHeader = {}
    for key, kind in _TYPES.items():
        value = data.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            out[key] = value  # type: ignore[literal-required]
    return out


_TYPES: dict[str, type] = {
    "rank": int,
    "host": str,
    "pid": int,
    "method": str,
    "when": str,
    "event": str,
    "state": str,
    "syscall": str,
    "signal": str,
    "note": str,
}


def write_stacks(path: Path, header: StacksHeader, body: str) -> None:
    """Write a stacks file atomically (readers never see half of one)."""
    write_atomic(path, format_header(header) + body)
