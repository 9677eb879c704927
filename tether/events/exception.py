"""What a rank died of: the exception that ended its main thread, as one record. Torch-free.

A rank that dies of an exception writes it into its dump (``tether.exception``); where it could
not (it died before joining the job, or ``--exit-linger 0`` let it exit at once), the launcher
reads the same from torchrun's error file (``TORCHELASTIC_ERROR_FILE``, which
``@record`` and tether's worker bootstrap write) into the rank's recovered record. Either way the
analyzer reads one shape::

    {"type": "ValueError", "message": "bad batch", "frames": [{filename, line, name}, ...],
     "source": "the rank" | "torchrun's error file"}

``frames`` are innermost first, as every stack in a dump is.
"""

from __future__ import annotations

import json
import re
import traceback
from pathlib import Path
from typing import Any

from tether.events.frames import TETHER, frame_kind

__all__ = [
    "EXCEPTION",
    "describe",
    "from_collective",
    "from_error_file",
    "from_exception",
    "read_record",
]

EXCEPTION = "exception"
"""The key of the record in a dump's ``tether`` section."""
MAX_MESSAGE = 2000
"""Characters of the message kept: enough for any error's sense, bounded for a 16k-rank event."""
MAX_FRAMES = 64
_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_SOURCES = ("the rank", "torchrun's error file")
_COLLECTIVE_CALLERS = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/")
"""Where a failed collective surfaces as an exception: its own call, DDP, autograd's engine
running DDP's or FSDP's hooks."""


def from_exception(exc: BaseException) -> dict[str, Any]:
    """The record of ``exc``, raised in this process."""
    summary = traceback.extract_tb(exc.__traceback__)
    frames = [
        {"filename": f.filename, "line": int(f.lineno or 0), "name": f.name}
        for f in reversed(summary)
    ]
    return _record(type(exc).__name__, str(exc), frames, _SOURCES[0])


def from_error_file(path: str | Path) -> dict[str, Any] | None:
    """The record in torchrun's error file at ``path`` (the JSON ``@record`` writes); None where
    the file is absent or holds something else."""
    try:
        data = json.loads(Path(path).read_text(errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    stack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        message = message.get("message")
    if not isinstance(message, str) or not message:
        return None
    kind, _, text = message.partition(": ")
    if not kind.isidentifier():  # "Signal 6 (SIGABRT) received by PID 12": no exception
        kind, text = "", message
    lines = stack.splitlines() if isinstance(stack, str) else []
    frames = [
        {"filename": m["file"], "line": int(m["line"]), "name": m["func"]}
        for m in map(_FILE_LINE.match, reversed(lines))
        if m is not None
    ]
    return _record(kind, text, frames, _SOURCES[1])


def from_collective(record: dict[str, Any]) -> bool:
    """Whether the exception came out of torch's collective machinery (its innermost frame that
    is not tether's is there): a failed collective, which a peer's death causes as often as the
    rank's own fault. A user's exception in a module DDP or FSDP runs has their frames only
    around it."""
    inner = next(
        (f["filename"] for f in record["frames"] if frame_kind(f["filename"]) != TETHER), ""
    )
    return any(tree in inner.replace("\\", "/") for tree in _COLLECTIVE_CALLERS)


def read_record(value: Any) -> dict[str, Any] | None:
    """A record as a dump holds it, checked (a dump is read from outside); None if not one."""
    if not isinstance(value, dict):
        return None
    kind, message, raw = value.get("type"), value.get("message"), value.get("frames")
    if not isinstance(kind, str) or not isinstance(message, str) or not isinstance(raw, list):
        return None
    frames = [
        {"filename": f["filename"], "line": f["line"], "name": f.get("name", "?")}
        for f in raw[:MAX_FRAMES]
        if isinstance(f, dict)
        and isinstance(f.get("filename"), str)
        and isinstance(f.get("line"), int)
    ]
    source = value.get("source")
    return _record(kind, message, frames, source if source in _SOURCES else _SOURCES[0])


def describe(record: dict[str, Any]) -> str:
    """``ValueError: bad batch at step 2`` (its first line)."""
    first = record["message"].strip().splitlines()
    text = first[0] if first else ""
    kind = record["type"]
    return f"{kind}: {text}" if kind and text else kind or text or "an exception"


def _record(kind: str, message: str, frames: list[dict[str, Any]], source: str) -> dict[str, Any]:
    return {
        "type": kind[:200],
        "message": message[:MAX_MESSAGE],
        "frames": frames[:MAX_FRAMES],
        "source": source,
    }
