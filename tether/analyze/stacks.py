"""Where a culprit rank was at dump time: ``file:line in func``, read only for the few ranks
named (re-reading one dump costs milliseconds; keeping every rank's stacks would cost memory).

From the rank's own dump when it wrote one (its threads at dump time, else the call site of its
last operation), else from the ``stacks_<rank>.txt`` file someone else wrote for it (see
:mod:`tether.events.stacks`). The frame shown is chosen by :mod:`tether.events.frames`, the
filter ``tether show`` and the recorder use too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.exception import EXCEPTION, read_record
from tether.events.frames import (
    FRAMEWORK,
    TETHER,
    format_frame,
    frame_kind,
    main_thread,
    pick,
    stacks_text_main_thread,
    traceback_lines,
)
from tether.events.load import load_trace
from tether.events.stacks import read_stacks_text, stacks_file

__all__ = ["culprit_stack", "dump_whereabouts"]

Found = tuple[str | None, list[str], str]
"""(``file:line in func``, the whole stack innermost first, where it came from)."""


def _found(frames: list[dict[str, Any]], source: str) -> Found:
    best = pick(frames)
    return (format_frame(best) if best else None), traceback_lines(frames), source


def _kind(frames: list[dict[str, Any]]) -> int:
    best = pick(frames)
    return frame_kind(str(best.get("filename", ""))) if best else TETHER + 1


def dump_whereabouts(
    data: Mapping[str, Any], entry_idx: int | None = None, *, entry_first: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """Where a rank was, from its loaded dump: the frames to show (innermost first; empty when
    none) and where they came from (a thread's name, or its last operation's call site).
    ``entry_first``: entry ``entry_idx``'s own call site comes first, where it has one (a
    mismatched collective: the rank may have run on past it). ``tether show`` and ``tether
    analyze`` both say what this says."""
    frames: list[dict[str, Any]] = []
    source, kind = "", TETHER + 1
    meta = data.get("tether")
    entries = data.get("entries")
    if entry_first and entry_idx is not None and isinstance(entries, list):
        e = entries[entry_idx] if -len(entries) <= entry_idx < len(entries) else None
        raw = e.get("frames") if isinstance(e, Mapping) else None
        op_frames = [f for f in raw if isinstance(f, dict)] if isinstance(raw, list) else []
        if op_frames and _kind(op_frames) <= FRAMEWORK:
            return op_frames, "call site of the mismatched operation"
    raised = read_record(meta.get(EXCEPTION)) if isinstance(meta, Mapping) else None
    if raised is not None and raised["frames"]:
        # It died of this: where it raised, not where its exit left the main thread.
        return raised["frames"], f"the {raised['type'] or 'exception'} it died of"
    threads = meta.get("stacks") if isinstance(meta, Mapping) else None
    if isinstance(threads, list):
        thread = main_thread(threads)
        if thread is not None:
            frames = [f for f in thread["frames"] if isinstance(f, dict)]
            source, kind = str(thread.get("thread_name", "")), _kind(frames)
    if kind <= FRAMEWORK:
        return frames, source
    # The main thread holds no line of the job's (tether's excepthook, its exit linger, a wait
    # in torch): where the rank issued its last operation says more.
    if isinstance(entries, list) and entries:
        e = (
            entries[entry_idx]
            if entry_idx is not None and -len(entries) <= entry_idx < len(entries)
            else entries[-1]
        )
        raw = e.get("frames") if isinstance(e, Mapping) else None
        if isinstance(raw, list) and raw:
            op_frames = [f for f in raw if isinstance(f, dict)]
            if not frames or _kind(op_frames) < kind:
                best = pick(frames)
                where = f"; its main thread was at {format_frame(best)}" if best else ""
                return op_frames, f"call site of its last operation{where}"
    return frames, source


def _from_dump(path: str, entry_idx: int | None, entry_first: bool) -> Found:
    try:
        data = load_trace(path)
    except UnsafeDumpError:
        return None, [], ""
    frames, source = dump_whereabouts(data, entry_idx, entry_first=entry_first)
    return _found(frames, source) if frames else (None, [], "")


def _from_stacks_file(path: Path) -> Found:
    try:
        text = read_stacks_text(path)
    except OSError:
        return None, [], ""
    frames, source = stacks_text_main_thread(text)
    return _found(frames, source) if frames else (None, [], "")


def culprit_stack(
    event_dir: Path,
    rank: int,
    dump_path: str | None,
    entry_idx: int | None = None,
    *,
    entry_first: bool = False,
) -> Found:
    """(``file:line in func``, the whole stack innermost first, where it came from);
    ``entry_first`` as :func:`dump_whereabouts` says."""
    if dump_path is not None:
        got = _from_dump(dump_path, entry_idx, entry_first)
        if got[0]:
            return got
    path = stacks_file(event_dir, rank)
    if path.is_file():
        return _from_stacks_file(path)
    return None, [], ""
