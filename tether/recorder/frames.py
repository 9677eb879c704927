"""Call-site capture: cheap at record time, symbolized only when a dump is written.

torch's C++ traceback gatherer stores code objects and instruction offsets (no locals, so no
tensors are kept alive) in about 2 us for a 25-frame stack; turning them into file:line happens in
one batch at dump time. Where that private API is missing we walk the frames in Python.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Frame", "capture", "python_stacks", "symbolize"]

# Frames of the recorder itself sit on top of every captured stack; they say nothing.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

Frame = dict[str, Any]  # {"name": str, "filename": str, "line": int}, innermost first

_gather: Any = None
_symbolize: Any = None
try:
    from torch._C._profiler import gather_traceback as _gather
    from torch._C._profiler import symbolize_tracebacks as _symbolize
except ImportError:  # pragma: no cover - torch builds without the profiler bindings
    pass


def capture(depth: int) -> object | None:
    """An opaque handle for the current Python stack, or None when ``depth`` is 0."""
    if depth == 0:
        return None
    if _gather is not None:
        handle: object = _gather(python=True, script=False, cpp=False)
        return handle
    frames: list[tuple[Any, int]] = []
    f = sys._getframe(1)
    while f is not None and len(frames) < depth:
        frames.append((f.f_code, f.f_lineno or 0))
        f = f.f_back  # type: ignore[assignment]
    return tuple(frames)


def symbolize(handles: Sequence[object | None], depth: int) -> list[list[Frame]]:
    """Turn handles from :func:`capture` into frames, innermost first, at most ``depth`` each."""
    raw: list[list[Frame]] = [[] for _ in handles]
    native = [i for i, h in enumerate(handles) if h is not None and not isinstance(h, tuple)]
    if native and _symbolize is not None:
        for i, frames in zip(native, _symbolize([handles[i] for i in native]), strict=True):
            raw[i] = [
                {"name": f["name"], "filename": f["filename"], "line": int(f["line"])}
                for f in frames
            ]
    for i, h in enumerate(handles):
        if isinstance(h, tuple):
            raw[i] = [
                {"name": code.co_name, "filename": code.co_filename, "line": line}
                for code, line in h
            ]
    return [_drop_own(frames)[:depth] for frames in raw]


def _drop_own(frames: list[Frame]) -> list[Frame]:
    i = 0
    while i < len(frames) and frames[i]["filename"].startswith(_OWN_DIR):
        i += 1
    return frames[i:]


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
