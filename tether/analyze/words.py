"""How the verdicts say things: rank, group and operation in words, where a rank was, what it
last completed; shared by :mod:`tether.analyze.engine` and the verdict modules."""

from __future__ import annotations

from pathlib import Path

from tether.analyze.diagnosis import GroupRef
from tether.analyze.event import Event
from tether.analyze.findings import HangOp, Wait
from tether.analyze.model import SigInfo
from tether.analyze.verdict import Where

__all__ = [
    "MAX_PER_RANK",
    "age",
    "completed_by",
    "describe",
    "first",
    "gname",
    "group_ref",
    "last_progress",
    "locate",
    "unreadable",
    "what",
    "where",
]

MAX_PER_RANK = 8
"""Lines kept in ``per_rank``: the culprits' and a few others', never thousands."""


def _is_alarm_op(hop: HangOp | None, w: Wait) -> bool:
    return hop is not None and hop.covers(w.group, w.seq)


def first(hop: HangOp | None, waits: list[Wait]) -> Wait:
    """The wait to report: on the alarm's operation if any is, else the oldest (then the lowest
    rank: never the order the dumps were read in)."""
    return min(waits, key=lambda w: (not _is_alarm_op(hop, w), w.t, w.rank))


def unreadable(ev: Event, rank: int) -> bool:
    return any(_rank_of(p) == rank for p in ev.unreadable)


def _rank_of(path: str) -> int | None:
    name = Path(path).name
    digits = ""
    for ch in reversed(name.split(".")[0]):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits) if digits else None


def gname(ev: Event, group: str) -> str:
    info = ev.groups.get(group)
    desc = info.desc if info else ""
    return f"{group} ({desc})" if desc else group


def what(ev: Event, w: Wait) -> str:
    op = ev.sigs[w.sig].op if 0 <= w.sig < len(ev.sigs) else "?"
    if w.kind == "collective":
        return f"{op} seq {w.seq}"
    arrow = f"{w.rank}->{w.peer}" if w.kind == "send" else f"{w.rank}<-{w.peer}"
    return f"{w.kind} {arrow}"


def group_ref(ev: Event, group: str) -> GroupRef:
    info = ev.groups.get(group)
    return GroupRef(
        name=group, desc=info.desc if info else "", ranks=list(info.ranks) if info else []
    )


def locate(ev: Event, group: str, seq: int | None, sig: int, kind: str) -> Where:
    """The operation ``sig`` at ``seq`` in ``group``: its op, sizes and dtypes where the
    signature is known (else a send's or receive's kind)."""
    if 0 <= sig < len(ev.sigs):
        s = ev.sigs[sig]
        return Where(
            process_group=group_ref(ev, group),
            collective_seq_id=seq,
            op=s.op,
            sizes={"input": s.input_sizes, "output": s.output_sizes},
            dtypes={"input": s.input_dtypes, "output": s.output_dtypes},
        )
    return Where(
        process_group=group_ref(ev, group),
        collective_seq_id=seq,
        op=kind if kind != "collective" else None,
    )


def describe(s: SigInfo) -> str:
    dt = ",".join(s.input_dtypes) or "-"
    return f"{s.op} {s.input_sizes}->{s.output_sizes} {dt}"


def where(ev: Event, rank: int, group: str) -> str:
    tr = ev.ranks[rank]
    c = tr.groups.get(group)
    last = tr.last_enqueued.get(group, 0)
    if c is not None and c.seq:
        last = max(last, c.seq[-1])
        op = ev.sigs[c.sig[-1]].op
        return f"its last op in group {gname(ev, group)} is {op} seq {last}; it never went further"
    if last:
        return f"its last op in group {gname(ev, group)} is seq {last} (from pg_status)"
    return f"it recorded nothing in group {gname(ev, group)}"


def last_progress(ev: Event, rank: int) -> str:
    """The last collective every group of ``rank`` completed on the others (so it took part)."""
    tr = ev.ranks.get(rank)
    if tr is not None:
        parts = [
            f"{ev.sigs[c.sig[-1]].op} seq {c.seq[-1]} in group {gname(ev, g)}"
            for g, c in tr.groups.items()
            if c.seq
        ]
        return "its own last ops: " + "; ".join(parts) if parts else "its dump records nothing"
    parts = []
    for name, info in ev.groups.items():
        if rank not in info.ranks:
            continue
        best = _completed(ev, name)
        if best is not None:
            parts.append(
                f"{ev.sigs[best[1]].op} seq {best[0]} in group {gname(ev, name)} "
                "(completed by its peers, so it took part)"
            )
    return "; ".join(parts) if parts else "unknown (no peer recorded a group it belongs to)"


def _completed(ev: Event, group: str) -> tuple[int, int] | None:
    """The last (seq, signature) of ``group`` that a member completed, worked out once per
    event (every rank without a dump asks: 12,544 of them, each over 16,384 members, took 130 s
    when each worked it out)."""
    if group in ev.completed:
        return ev.completed[group]
    best: tuple[int, int] | None = None
    for m in ev.groups[group].ranks:
        c = ev.cols(m, group)
        if c is None or not c.seq:
            continue
        k = c.done.find(0)
        k = len(c.seq) - 1 if k < 0 else k - 1
        if k >= 0 and (best is None or c.seq[k] > best[0]):
            best = (c.seq[k], c.sig[k])
    ev.completed[group] = best
    return best


def completed_by(ev: Event, w: Wait) -> list[int]:
    info = ev.groups.get(w.group)
    out = []
    for m in info.ranks if info else []:
        c = ev.cols(m, w.group)
        if c is None:
            continue
        for k, s in enumerate(c.seq):
            if s == w.seq and c.done[k]:
                out.append(m)
                break
    return out


def age(ev: Event, w: Wait) -> str:
    tr = ev.ranks[w.rank]
    if tr.dump_time_ns is None:
        return "before the dump"
    return f"{(tr.dump_time_ns + tr.clock_offset_ns - w.t) / 1e9:.1f} s before the dump"
