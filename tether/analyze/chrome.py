"""Every rank's collectives as a Chrome trace (opens in Perfetto and chrome://tracing): one
process lane per rank, one complete ("X") event per operation, the culprits' lanes named
"rank N (CULPRIT)" and sorted first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.analyze.diagnosis import Diagnosis
from tether.analyze.event import Event

__all__ = ["chrome_trace", "write_chrome_trace"]

MAX_EVENTS = 2_000_000
"""Beyond this the trace is cut to each rank's most recent operations: Perfetto cannot open
much more."""
_OPEN_US = 1000.0
"""Width drawn for an operation that never completed or has no duration: 1 ms."""


def chrome_trace(ev: Event, d: Diagnosis) -> dict[str, Any]:
    culprits = set(d.culprit_ranks)
    events: list[dict[str, Any]] = []
    t0 = min(
        (c.t[0] for tr in ev.ranks.values() for c in tr.groups.values() if c.t),
        default=0,
    )
    per_rank = max(1, MAX_EVENTS // max(1, len(ev.ranks)))
    for rank, tr in sorted(ev.ranks.items()):
        label = f"rank {rank} (CULPRIT)" if rank in culprits else f"rank {rank}"
        events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": label}})
        sort = rank - ev.world_size - 1 if rank in culprits else rank
        events.append(
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": sort}}
        )
        rows: list[tuple[int, int, str, str, int | None, bool]] = []
        for name, c in tr.groups.items():
            for k in range(len(c.seq)):
                rows.append((c.t[k], c.sig[k], name, "collective", c.seq[k], bool(c.done[k])))
        for p in tr.p2p:
            rows.append((p.t, p.sig, p.group, p.kind, None, p.done))
        rows.sort()
        tids: dict[str, int] = {}
        for t, sig, group, kind, seq, done in rows[-per_rank:]:
            tid = tids.setdefault(group, len(tids))
            op = ev.sigs[sig].op if 0 <= sig < len(ev.sigs) else kind
            events.append(
                {
                    "ph": "X",
                    "pid": rank,
                    "tid": tid,
                    "name": op,
                    "cat": "collective" if kind == "collective" else "p2p",
                    "ts": (t - t0) / 1000.0,
                    "dur": _OPEN_US,
                    "args": {
                        "group": group,
                        "seq": seq,
                        "completed": done,
                        "input_sizes": ev.sigs[sig].input_sizes if 0 <= sig < len(ev.sigs) else [],
                        "dtypes": ev.sigs[sig].input_dtypes if 0 <= sig < len(ev.sigs) else [],
                    },
                }
            )
        for group, tid in tids.items():
            info = ev.groups.get(group)
            tname = f"group {group} ({info.desc})" if info and info.desc else f"group {group}"
            events.append(
                {"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": tname}}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"event": d.event, "verdict": d.verdict, "culprit_ranks": d.culprit_ranks},
    }


def write_chrome_trace(ev: Event, d: Diagnosis, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(chrome_trace(ev, d), f)
    tmp.replace(out)
    return out
