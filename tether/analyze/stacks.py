"""Where a culprit rank was at dump time: ``file:line in func``, read only for the few ranks
named (re-reading one dump costs milliseconds; keeping every rank's stacks would cost memory).

From the rank's own dump when it wrote one (its threads at dump time, else the call site of its
last operation), else from the ``stacks_<rank>.txt`` file someone else wrote for it (see
:mod:`tether.events.stacks`). The frame shown is chosen by :mod:`tether.events.frames`, the
filter ``tether show`` and the recorder use too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.frames import (
    format_frame,
    main_thread,
    pick,
    stacks_text_main_thread,
    traceback_lines,
)
from tether.events.stacks import stacks_file
from tether.recorder.load import load_trace

__all__ = ["culprit_stack"]

_MAX_TEXT = 1 << 20

Found = tuple[str | None, list[str], str]
"""(``file:line in func``, the whole stack innermost first, where it came from)."""


def _found(frames: list[dict[str, Any]], source: str) -> Found:
    best = pick(frames)
    return (format_frame(best) if best else None), traceback_lines(frames), source


def _from_dump(path: str, entry_idx: int | None) -> Found:
    try:
        data = load_trace(path)
    except UnsafeDumpError:
        return None, [], ""
    meta = data.get("tether")
    threads = meta.get("stacks") if isinstance(meta, dict) else None
    if isinstance(threads, list):
        thread = main_thread(threads)
        if thread is not None:
            frames = [f for f in thread["frames"] if isinstance(f, dict)]
            if frames:
                return _found(frames, str(thread.get("thread_name", "")))
    entries = data.get("entries")
    if isinstance(entries, list) and entries:
        e = (
            entries[entry_idx]
            if entry_idx is not None and -len(entries) <= entry_idx < len(entries)
            else entries[-1]
        )
        raw = e.get("frames") if isinstance(e, dict) else None
        if isinstance(raw, list) and raw:
            frames = [f for f in raw if isinstance(f, dict)]
            return _found(frames, "call site of its last operation")
    return None, [], ""


def _from_stacks_file(path: Path) -> Found:
    try:
        text = path.read_text(errors="replace")[:_MAX_TEXT]
    except OSError:
        return None, [], ""
    frames, source = stacks_text_main_thread(text)
    return _found(frames, source) if frames else (None, [], "")


def culprit_stack(
    event_dir: Path, rank: int, dump_path: str | None, entry_idx: int | None = None
) -> Found:
    """(``file:line in func``, the whole stack innermost first, where it came from)."""
    if dump_path is not None:
        got = _from_dump(dump_path, entry_idx)
        if got[0]:
            return got
    path = stacks_file(event_dir, rank)
    if path.is_file():
        return _from_stacks_file(path)
    return None, [], ""
