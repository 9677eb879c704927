"""``tether show PATH``: what each rank recorded in a dump event."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.recorder.group import P2P_SEQ_BASE
from tether.recorder.load import load_event, resolve_event

__all__ = ["main", "summarize"]


def summarize(event_dir: Path, *, last: int = 3) -> str:
    dumps, errors = load_event(event_dir)
    lines = [f"event {event_dir.name}  ({event_dir})"]
    for rank, data in dumps.items():
        meta: dict[str, Any] = data.get("tether", {})
        entries: list[dict[str, Any]] = data["entries"]
        lines.append(
            f"\nrank {rank}  host={meta.get('host', '?')} pid={meta.get('pid', '?')} "
            f"reason={meta.get('reason', '?')}  {len(entries)} operations recorded"
        )
        groups: dict[str, Counter[str]] = {}
        for e in entries:
            name, desc = e["process_group"]
            op = e["profiling_name"].split(":", 1)[1].split(" ")[0]
            groups.setdefault(f"{name} ({desc})", Counter())[op] += 1
        pg_config = data.get("pg_config", {})
        for label, ops in groups.items():
            ranks = pg_config.get(label.split(" ")[0], {}).get("ranks", "?")
            counts = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))
            lines.append(f"  group {label:<24} ranks {ranks:<14} {counts}")
        main = [t for t in meta.get("stacks", []) if t.get("thread_name") == "MainThread"]
        if main and main[0]["frames"]:
            lines.append(f"  main thread at {_call_site(main[0]['frames'])}")
        for e in entries[-last:]:
            seq = (
                f"p2p #{e['p2p_seq_id'] - P2P_SEQ_BASE}"
                if e["is_p2p"]
                else f"seq {e['collective_seq_id']}"
            )
            where = _call_site(e.get("frames") or [])
            lines.append(
                f"    #{e['record_id']:<5} {e['profiling_name']:<22} {seq:<9} "
                f"{e['state']:<9} {e['input_sizes']} {','.join(e['input_dtypes'])}  {where}"
            )
    for path, why in errors.items():
        lines.append(f"\nunreadable: {path}: {why}")
    return "\n".join(lines)


def _call_site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch: the line of the caller's own code."""
    for f in frames:
        if "/torch/" not in f["filename"]:
            return f"{Path(f['filename']).name}:{f['line']} ({f['name']})"
    return f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else ""


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tether show", description=__doc__)
    parser.add_argument("path", help="an event directory, or a dump directory (newest event)")
    parser.add_argument("--event", help="the event id to show, inside a dump directory")
    parser.add_argument("--last", type=int, default=3, help="operations listed per rank")
    args = parser.parse_args(list(argv))
    print(summarize(resolve_event(args.path, args.event), last=args.last))
    return 0
