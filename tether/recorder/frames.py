"""Call-site capture: cheap at record time, symbolized only when a dump is written.

At record time we keep each frame's code object and instruction offset (no locals, so no tensors
are kept alive); file and line are worked out in one batch at dump time, with a cache per code
object. torch's own C++ gatherer is no faster here, and its symbolizer imports torch._inductor on
first use: seconds of CPU inside a rank's first dump.
"""

from __future__ import annotations

import dis
import os
import sys
import threading
from collections.abc import Sequence
from types import CodeType
from typing import Any

__all__ = ["Frame", "capture", "python_stacks", "symbolize"]

# Frames of the recorder itself sit on top of every captured stack; they say nothing.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

Frame = dict[str, Any]  # {"name": str, "filename": str, "line": int}, innermost first

Captured = list[Any]  # [code, lasti, code, lasti, ...], innermost first


def capture(depth: int, skip: int = 2) -> Captured | None:
    """The current stack as ``(code, offset)`` pairs, starting ``skip`` frames above the
    caller; None when ``depth`` is 0. This is on every operation's path: keep it tight."""
    if depth == 0:
        return None
    try:
        f: Any = sys._getframe(1 + skip)
    except ValueError:  # called from C++ (DDP's reducer) with fewer Python frames above
        f = sys._getframe(1)
    out: Captured = []
    append = out.append
    while f is not None and depth:
        append(f.f_code)
        append(f.f_lasti)
        f = f.f_back
        depth -= 1
    return out


def symbolize(handles: Sequence[Captured | None], depth: int) -> list[list[Frame]]:
    """Turn handles from :func:`capture` into frames, innermost first, at most ``depth`` each,
    without the recorder's own frames."""
    lines = _LineTable()
    out: list[list[Frame]] = []
    for handle in handles:
        frames: list[Frame] = []
        for i in range(0, len(handle or ()), 2):
            code: CodeType = handle[i]  # type: ignore[index]
            if not frames and code.co_filename.startswith(_OWN_DIR):
                continue
            frames.append(
                {
                    "name": code.co_name,
                    "filename": code.co_filename,
                    "line": lines.line(code, handle[i + 1]),  # type: ignore[index]
                }
            )
        out.append(frames[:depth])
    return out


class _LineTable:
    """Instruction offset -> line number, computed once per code object."""

    def __init__(self) -> None:
        self._tables: dict[CodeType, dict[int, int]] = {}

    def line(self, code: CodeType, lasti: int) -> int:
        table = self._tables.get(code)
        if table is None:
            table = self._tables[code] = self._build(code)
        if lasti in table:
            return table[lasti]
        starts = [offset for offset in table if offset <= lasti]
        return table[max(starts)] if starts else code.co_firstlineno

    @staticmethod
    def _build(code: CodeType) -> dict[int, int]:
        if sys.version_info >= (3, 11):
            return {
                2 * i: pos[0] for i, pos in enumerate(code.co_positions()) if pos[0] is not None
            }
        return {offset: line for offset, line in dis.findlinestarts(code) if line is not None}


def python_stacks(limit: int = 64) -> list[dict[str, Any]]:
    """Every thread of this process, innermost frame first."""
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        frames: list[Frame] = []
        f: Any = frame
        while f is not None and len(frames) < limit:
            frames.append(
                {"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno}
            )
            f = f.f_back
        thread = names.get(ident)
        out.append(
            {
                "thread_id": ident,
                "thread_name": thread.name if thread else "",
                "daemon": bool(thread and thread.daemon),
                "frames": frames,
            }
        )
    return out
