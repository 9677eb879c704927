"""``tether show PATH``: what each rank recorded in a dump event."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.analyze.model import Forming
from tether.analyze.stacks import dump_whereabouts
from tether.cli.main import plain_help
from tether.events.frames import pick, stacks_text_main_thread
from tether.events.load import load_event, resolve_event
from tether.events.schema import FORMING, P2P_SEQ_BASE
from tether.events.stacks import read_stacks_text, stacks_rank

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
        forming = Forming.read(meta.get(FORMING))
        if forming is not None:
            who = f"rank(s) {forming.missing}" if forming.missing is not None else "members"
            lines.append(
                f"  waits in {forming.op} of group {forming.group} ({forming.group_desc}) for "
                f"{who} that never arrived (found late after {forming.waited_s:.1f}s)"
            )
        frames, source = dump_whereabouts(data)
        if source.startswith("call site"):
            lines.append(
                f"  last operation issued at {_call_site(frames)} (its main thread holds no "
                "frame of the job's own code)"
            )
        elif frames:
            label = "main thread" if source == "MainThread" else f"thread {source!r}"
            lines.append(f"  {label} at {_call_site(frames)}")
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
    lines.extend(_stacks_files(event_dir, set(dumps)))
    return "\n".join(lines)


def _stacks_files(event_dir: Path, dumped: set[int]) -> list[str]:
    """A line for each rank that left no dump but whose stacks someone else read."""
    lines = []
    for path in sorted(event_dir.iterdir(), key=lambda p: p.name):
        rank = stacks_rank(path.name)
        if rank is None or rank in dumped or not path.is_file():
            continue
        try:
            text = read_stacks_text(path)
        except OSError as exc:
            lines.append(f"\nrank {rank}  no dump; {path.name} unreadable: {exc}")
            continue
        frames, source = stacks_text_main_thread(text)
        where = _call_site(frames) if frames else "no Python frames"
        lines.append(f"\nrank {rank}  no dump; stacks by {source}\n  main thread at {where}")
    return lines


def _call_site(frames: list[dict[str, Any]]) -> str:
    """The frame :func:`tether.events.frames.pick` chooses (the user's own line first), short."""
    f = pick(frames)
    return (
        f"{Path(str(f.get('filename', '?'))).name}:{f.get('line', '?')} ({f.get('name', '?')})"
        if f
        else ""
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tether show", description=plain_help(__doc__))
    parser.add_argument("path", help="an event directory, or a dump directory (newest event)")
    parser.add_argument("--event", help="the event id to show, inside a dump directory")
    parser.add_argument("--last", type=int, default=3, help="operations listed per rank")
    args = parser.parse_args(list(argv))
    print(summarize(resolve_event(args.path, args.event), last=args.last))
    return 0
