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

from tether.events.frames import is_library
from tether.events.schema import ELIDED, Frame

__all__ = ["WALK_ON", "Frame", "capture", "python_stacks", "symbolize"]

# Frames of the recorder itself sit on top of every captured stack; they say nothing.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


Captured = list[Any]  # [code, lasti, code, lasti, ...], innermost first


def capture(depth: int, skip: int = 2) -> Captured | None:
    """The current stack as ``(code, offset)`` pairs, starting ``skip`` frames above the
    caller; None when ``depth`` is 0. Past ``depth``, when the outermost frame kept is torch's,
    the standard library's or tether's, the first other frame is kept too, after an
    :data:`_ELIDED` marker. This is on every operation's path: keep it tight."""
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
    # Deeper than the limit, and the outermost frame kept is not (known to be) the user's.
    if f is not None and _library_get(out[-2].co_filename) is not False:
        _walk_on(out, f)
    return out


_ELIDED = None
"""In a captured list, ``_ELIDED, n`` before the last pair: ``n`` frames were passed over."""

WALK_ON = 256
"""How many frames past the depth limit :func:`capture` (and the native core) looks for the
first user frame."""

# File name -> "torch, the standard library or tether's own" (no user line in it). Keyed on the
# name, whose hash str caches (a code object's hash is recomputed from its contents each time).
# Bounded: code compiled at run time (exec, torch.fx) must not pile names up here.
_library: dict[str, bool] = {}
_LIBRARY_CACHE_MAX = 1 << 14
_library_get = _library.get  # cleared, never replaced: the bound method stays valid


def _is_library(filename: str) -> bool:
    verdict = _library_get(filename)
    if verdict is None:
        if len(_library) >= _LIBRARY_CACHE_MAX:
            _library.clear()
        verdict = _library[filename] = is_library(filename)
    return verdict


# Where the last walk from a frame led: id(code) -> (code, offset, frames passed, the code found
# there, or None when none was before the stack's end or the cap). A call site past the limit is
# nearly always reached through the same stack (an FSDP2 backward, step after step): checking
# that the walk lands on the same code costs a third of classifying every frame on the way.
# Holding the code keeps its id from being reused.
_walks: dict[int, tuple[CodeType, int, int, CodeType | None]] = {}
_WALKS_MAX = 4096


def _walk_on(out: Captured, f: Any) -> None:
    """Append the first frame at or above ``f`` outside torch and the standard library, when
    the outermost frame in ``out`` is not such a frame (an FSDP2 backward's collective is 20+
    torch frames below the user's ``loss.backward()``). Only the outermost is looked at: one
    look-up per operation, and where a user frame sits further in, one more frame is kept."""
    if not _is_library(out[-2].co_filename):
        return
    start, lasti = f.f_code, f.f_lasti
    seen = _walks.get(id(start))
    if seen is not None and seen[0] is start and seen[1] == lasti:
        passed, target = seen[2], seen[3]
        if target is None and passed >= WALK_ON:
            return  # none within reach last time either
        g, n = f, 0
        while n < passed and g is not None:
            g = g.f_back
            n += 1
        if n == passed:
            if g is None and target is None:
                return  # the stack ends where it ended last time: none in it
            if g is not None and g.f_code is target:
                out.extend((_ELIDED, passed, target, g.f_lasti))
                return
    get = _library_get
    passed = 0
    found: CodeType | None = None
    while f is not None and passed < WALK_ON:
        code = f.f_code
        verdict = get(code.co_filename)
        if verdict is None:
            verdict = _is_library(code.co_filename)
        if not verdict:
            out.extend((_ELIDED, passed, code, f.f_lasti))
            found = code
            break
        f = f.f_back
        passed += 1
    if len(_walks) >= _WALKS_MAX:
        _walks.clear()
    _walks[id(start)] = (start, lasti, passed, found)


def symbolize(handles: Sequence[Captured | None], depth: int) -> list[list[Frame]]:
    """Turn handles from :func:`capture` into frames, innermost first, at most ``depth`` each
    (and the user frame kept past it, with its ``elided`` count), without the recorder's own
    frames."""
    lines = _LineTable()
    out: list[list[Frame]] = []
    for handle in handles:
        frames: list[Frame] = []
        extra: Frame | None = None
        passed: int | None = None  # set at the marker; 0 when the user frame came right next
        for i in range(0, len(handle or ()), 2):
            code: CodeType | None = handle[i]  # type: ignore[index]
            if code is _ELIDED:
                passed = handle[i + 1]  # type: ignore[index]
                continue
            if not frames and code.co_filename.startswith(_OWN_DIR):
                continue
            frame: Frame = {
                "name": code.co_name,
                "filename": code.co_filename,
                "line": lines.line(code, handle[i + 1]),  # type: ignore[index]
            }
            if passed is not None:
                extra = frame
            else:
                frames.append(frame)
        if extra is not None and passed is not None:
            extra[ELIDED] = passed + max(len(frames) - depth, 0)
            out.append([*frames[:depth], extra])
        else:
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
    """Every thread of this process, innermost frame first; past ``limit`` frames, the first
    frame outside torch and the standard library is kept as in :func:`capture`."""
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        frames: list[Frame] = []
        f: Any = frame
        while f is not None and len(frames) < limit:
            frames.append(_frame(f))
            f = f.f_back
        if f is not None and all(is_library(x["filename"]) for x in frames):
            passed = 0
            while f is not None and passed < WALK_ON:
                if not _is_library(f.f_code.co_filename):
                    frames.append({**_frame(f), ELIDED: passed})
                    break
                f = f.f_back
                passed += 1
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


def _frame(f: Any) -> Frame:
    return {"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno}
