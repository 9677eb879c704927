"""Where a culprit rank was at dump time: ``file:line in func``, read only for the few ranks
named (re-reading one dump costs milliseconds; keeping every rank's stacks would cost memory)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.recorder.load import load_trace

__all__ = ["culprit_stack"]

# Frames that say nothing about the user's code: torch, tether's own machinery, the interpreter's
# threading and start-up. Matched on package-relative paths, never on any parent directory's name:
# a checkout in ~/tether or ~/torch must keep its frames, and so must tether's demo job.
_NOISE = re.compile(
    r"[/\\](?:site|dist)-packages[/\\](?:torch|tether)[/\\]"
    r"|[/\\]torch[/\\](?:distributed|nn|autograd|utils|_[a-z_]+)[/\\]"
    r"|[/\\]tether[/\\](?:recorder|watchdog|launcher|server|cli|analyze|transport)[/\\]"
    r"|[/\\]tether[/\\](?:api|config|_log)\.py$"
    r"|(?:^|[/\\])(?:threading|selectors|socket|queue|runpy|socketserver)\.py$"
    r"|[/\\](?:concurrent|multiprocessing)[/\\]"
    r"|^<frozen "
)
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)


def _fmt(f: dict[str, Any]) -> str:
    return f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"


def _pick(frames: list[dict[str, Any]]) -> str | None:
    """The innermost frame of user code, else the innermost frame."""
    for f in frames:
        if not _NOISE.search(str(f.get("filename", ""))):
            return _fmt(f)
    return _fmt(frames[0]) if frames else None


def _from_dump(path: str, entry_idx: int | None) -> tuple[str | None, list[str], str]:
    try:
        data = load_trace(path)
    except UnsafeDumpError:
        return None, [], ""
    meta = data.get("tether")
    threads = meta.get("stacks") if isinstance(meta, dict) else None
    if isinstance(threads, list) and threads:
        threads = [t for t in threads if isinstance(t, dict) and isinstance(t.get("frames"), list)]
        main = [t for t in threads if t.get("thread_name") == "MainThread"]
        others = [t for t in threads if t not in main and not t.get("daemon")]
        for t in main + others + threads:
            frames = [f for f in t["frames"] if isinstance(f, dict)]
            where = _pick(frames)
            if where:
                return where, [_fmt(f) for f in frames], str(t.get("thread_name", ""))
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
            return _pick(frames), [_fmt(f) for f in frames], "call site of its last operation"
    return None, [], ""


def _from_faulthandler(path: Path) -> tuple[str | None, list[str], str]:
    try:
        text = path.read_text(errors="replace")[: 1 << 20]
    except OSError:
        return None, [], ""
    blocks = []
    starts = [m.start() for m in _FH_THREAD.finditer(text)] + [len(text)]
    for a, b in itertools.pairwise(starts):
        frames = [
            {"filename": m["file"], "line": int(m["line"]), "name": m["func"]}
            for m in _FH_FRAME.finditer(text, a, b)
        ]
        if frames:
            blocks.append(frames)
    if not blocks:
        return None, [], ""
    # faulthandler does not name threads; the main thread is the one running <module>.
    main = [b for b in blocks if b[-1]["name"] == "<module>"] or [blocks[-1]]
    frames = main[0]
    return _pick(frames), [_fmt(f) for f in frames], "faulthandler (the rank held the GIL)"


def culprit_stack(
    event_dir: Path, rank: int, dump_path: str | None, entry_idx: int | None = None
) -> tuple[str | None, list[str], str]:
    """(``file:line in func``, the whole stack innermost first, where it came from)."""
    if dump_path is not None:
        got = _from_dump(dump_path, entry_idx)
        if got[0]:
            return got
    fh = event_dir / f"stacks_{rank}.txt"
    if fh.is_file():
        return _from_faulthandler(fh)
    return None, [], ""
