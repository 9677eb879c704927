"""The desync verdict: members of a group that issued a different op, size or dtype at one
sequence number, and the deaths a mismatch causes (the backend aborting the side that receives
more than it expects)."""

from __future__ import annotations

import dataclasses

from tether.analyze import deaths
from tether.analyze.event import Event, compress_ranks
from tether.analyze.findings import Desync, HangOp, Wait
from tether.analyze.model import SigInfo, canonical_op
from tether.analyze.verdict import Finding
from tether.analyze.words import MAX_PER_RANK
from tether.analyze.words import describe as _describe
from tether.analyze.words import first as _first
from tether.analyze.words import gname as _gname
from tether.analyze.words import last_progress as _last_progress
from tether.analyze.words import locate as _locate
from tether.analyze.words import what as _what

__all__ = [
    "consequences",
    "desync",
    "desync_with_deaths",
    "outnumbered_by_aborts",
    "stuck_desync",
    "tie_by_abort",
]


def consequences(ev: Event, dead_ranks: dict[int, str], mismatch: Finding) -> Finding:
    """The desync finding ``mismatch`` with the dead ranks (``dead_ranks``: rank -> how) that
    are not among its odd ones as its consequences: they died of it."""
    evidence = list(mismatch.evidence)
    per_rank = dict(mismatch.per_rank)
    died_of_it = dict(mismatch.consequences)
    for r, how in sorted(dead_ranks.items()):
        if r in mismatch.culprits:
            continue
        died_of_it[r] = f"died ({how}) at the mismatch"
        hint = f" ({deaths.ABORT_HINT})" if "SIGABRT" in how else ""
        known = "the launcher recorded" if r in ev.dead_ranks else "its stacks file records"
        evidence.append(
            f"rank {r} died ({how}), as {known}: a consequence of the mismatch, not its cause{hint}"
        )
        if r in per_rank or len(per_rank) < MAX_PER_RANK:
            per_rank.setdefault(r, f"died ({how}); " + _last_progress(ev, r))
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    if broken:
        error = next(iter(broken.values()))
        evidence.append(
            f"then the backend failed the operation of rank(s) {compress_ranks(list(broken))}: "
            f"{error}"
        )
    return dataclasses.replace(
        mismatch, evidence=tuple(evidence), per_rank=per_rank, consequences=died_of_it
    )


def desync_with_deaths(
    ev: Event, dead_ranks: dict[int, str], z: Desync, hop: HangOp | None
) -> Finding:
    """The desync ``z`` that explains the deaths in ``dead_ranks``: a tie among the dumps that
    exist settled by how a lost rank died, then the dead as its consequences."""
    z, inferred = tie_by_abort(ev, dead_ranks, z)
    return consequences(ev, dead_ranks, desync(ev, z, hop, inferred=inferred))


def outnumbered_by_aborts(
    ev: Event, dead_ranks: dict[int, str], waits: list[Wait], hop: HangOp | None
) -> Finding | None:
    """The survivors agree, and more of the group died of SIGABRT at that operation than
    survived it (a broadcast root sending more than every receiver expects): each aborted rank
    expected fewer bytes than it was sent, so the survivors are the odd side. A desync, said to
    be an inference; None otherwise."""
    lost_all = [r for r in dead_ranks if r not in ev.ranks]
    lost = sorted(r for r in lost_all if "SIGABRT" in dead_ranks[r])
    if not lost or len(lost) != len(lost_all):
        return None
    broken = [w for w in waits if w.kind == "collective" and set(w.blockers) & set(lost)]
    if not broken:
        return None
    w = _first(hop, broken)
    same = [x for x in broken if (x.group, x.seq) == (w.group, w.seq)]
    info = ev.groups.get(w.group)
    members = set(info.ranks) if info else set()
    here = [r for r in lost if r in members]
    survivors = sorted(x.rank for x in same)
    if (
        len({x.sig for x in same}) != 1
        or len(here) <= len(survivors)
        or set(survivors) | set(here) != members
    ):
        return None
    # The sizes and dtypes shown are the majority's, lost with it.
    where = dataclasses.replace(_locate(ev, w.group, w.seq, w.sig, w.kind), sizes=None, dtypes=None)
    issued = _describe(ev.sigs[w.sig])
    evidence = (
        f"rank(s) {compress_ranks(here)} died of SIGABRT at {_what(ev, w)} in group "
        f"{_gname(ev, w.group)}, which rank(s) {compress_ranks(survivors)} issued as {issued}: "
        f"{deaths.ABORT_HINT}, so each expected fewer bytes than it was sent; outnumbered, rank(s) "
        f"{compress_ranks(survivors)} are the odd side (an inference from how the others died: "
        "their records are lost)",
    )
    found = Finding(
        verdict="desync",
        culprits=tuple(survivors),
        where=where,
        evidence=evidence,
        per_rank={r: f"issued {issued}" for r in survivors[:MAX_PER_RANK]},
    )
    return consequences(ev, dead_ranks, found)


def tie_by_abort(ev: Event, dead_ranks: dict[int, str], z: Desync) -> tuple[Desync, str | None]:
    """A tie among the dumps that exist, where a rank whose record is lost died of SIGABRT: gloo
    aborts the process that receives more bytes than it expects, so the lost rank held the
    smaller buffer of two. Counted on that side, it may make a majority: then ``z`` with that
    majority, and the sentence that says so (else ``z`` as it is, and None)."""
    info = ev.groups.get(z.group)
    members = set(info.ranks) if info else set()
    lost = [
        r
        for r, how in dead_ranks.items()
        if "SIGABRT" in how and r not in ev.ranks and r in members
    ]
    codes = sorted(set(z.by_rank.values()))
    if z.majority is not None or not lost or len(codes) != 2:
        return z, None
    a, b = (ev.sigs[c] for c in codes)
    na, nb = deaths.nbytes(a), deaths.nbytes(b)
    if canonical_op(a.op) != canonical_op(b.op) or na is None or nb is None or na == nb:
        return z, None
    small, big = (codes[0], codes[1]) if na < nb else (codes[1], codes[0])
    n_small = sum(1 for v in z.by_rank.values() if v == small) + len(lost)
    n_big = sum(1 for v in z.by_rank.values() if v == big)
    if n_small <= n_big:
        return z, None
    odd = sorted(r for r, v in z.by_rank.items() if v == big)
    inferred = (
        f"the dumps that exist are split evenly; rank(s) {compress_ranks(sorted(lost))}, whose "
        f"record is lost, died of SIGABRT: {deaths.ABORT_HINT}, so it held the smaller buffer "
        f"({_describe(ev.sigs[small])}) and rank(s) {compress_ranks(odd)}, with the larger one, "
        "are the odd side (an inference from how it died)"
    )
    return dataclasses.replace(z, majority=small, odd=odd), inferred


def stuck_desync(desyncs: list[Desync], waits: list[Wait]) -> Desync | None:
    """A desync at the operation ranks are waiting in (or before it) explains the hang."""
    stuck = {(w.group, w.seq) for w in waits if w.seq is not None}
    frontier: dict[str, int] = {}
    for w in waits:
        if w.seq is not None:
            frontier[w.group] = min(frontier.get(w.group, w.seq), w.seq)
    hits = [z for z in desyncs if (z.group, z.seq) in stuck or z.seq <= frontier.get(z.group, -1)]
    return min(hits, key=lambda z: z.seq) if hits else None


def desync(
    ev: Event, z: Desync, hop: HangOp | None = None, *, inferred: str | None = None
) -> Finding:
    """The members of ``z``'s group that issued something else than the others; ``inferred``:
    the sentence that settled a tie (it comes first)."""
    ref = z.majority if z.majority is not None else z.by_rank[min(z.by_rank)]
    where = _locate(ev, z.group, z.seq, ref, "collective")
    evidence = [inferred] if inferred is not None else []
    per_rank: dict[int, str] = {}
    sides: dict[int, list[int]] = {}
    for r, code in sorted(z.by_rank.items()):
        sides.setdefault(code, []).append(r)
    kinds = set()
    # The largest side first; equal sides in order of their lowest rank.
    for code, ranks in sorted(sides.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        info = ev.sigs[code]
        evidence.append(
            f"seq {z.seq} in group {_gname(ev, z.group)}: rank(s) {compress_ranks(ranks)} "
            f"issued {_describe(info)}"
        )
        if code != ref:
            kinds.add(_difference(ev.sigs[ref], info))
        if code != ref or z.majority is None:
            for r in ranks[:MAX_PER_RANK]:
                per_rank[r] = f"issued {_describe(info)}"
        elif len(ranks) and ranks[0] not in per_rank:  # one of the majority, for contrast
            per_rank[ranks[0]] = f"issued {_describe(info)} (as rank(s) {compress_ranks(ranks)})"
    if z.majority is None:
        # No side is the reference: the sizes and dtypes are in the evidence, side by side.
        ops = {ev.sigs[code].op for code in sides}
        op = ops.pop() if len(ops) == 1 else None
        where = dataclasses.replace(where, op=op, sizes=None, dtypes=None)
        evidence.append("no majority: the sides are the same size, so each could be the odd one")
    else:
        evidence.append(
            f"the odd rank(s) differ from the group's majority ({len(sides.get(z.majority, []))} "
            f"of {len(z.by_rank)} dumps) in {', '.join(sorted(kinds))}"
        )
    if hop is not None and hop.group == z.group and 0 < z.seq < hop.seq:
        evidence.append(
            f"the alarm was about seq {hop.seq} in group {_gname(ev, hop.group)}: the mismatch "
            "is at or before it, so it explains it"
        )
    return Finding(
        verdict="desync",
        culprits=tuple(z.odd),
        where=where,
        evidence=tuple(evidence),
        per_rank=per_rank,
    )


def _difference(a: SigInfo, b: SigInfo) -> str:
    if a.key[0] != b.key[0]:
        return "op"
    if [x for x in a.key if isinstance(x, tuple)] != [x for x in b.key if isinstance(x, tuple)]:
        return "dtype"
    return "size"
