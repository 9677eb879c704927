"""The analysis of one event: read every rank into columns, find what is wrong, decide.

Order of the verdicts, most specific first: ranks recorded dead (crash); ranks that disagree on
the collective they are stuck in (desync); ranks waiting for others (hang, its root cause found
through the graph of who waits on whom; a crash when that root left no dump); a desync not (yet)
stuck; ranks that are consistently late (straggler); a missing dump nobody waits on
(inconclusive); healthy.
"""

from __future__ import annotations

from pathlib import Path

from tether._exceptions import AnalysisError, UnsafeDumpError
from tether.analyze import findings
from tether.analyze.diagnosis import Diagnosis, GroupRef, Straggler, UnmatchedP2P
from tether.analyze.event import Event, compress_ranks, load_event_columns
from tether.analyze.findings import Desync, Wait
from tether.analyze.model import SigInfo
from tether.analyze.stacks import culprit_stack
from tether.recorder.load import find_dump_files, resolve_dump_event

__all__ = ["analyze", "analyze_event", "load"]

MAX_PER_RANK = 8
"""Lines kept in ``per_rank``: the culprits' and a few others', never thousands."""


def analyze(path: str | Path, *, event: str | None = None, jobs: int | None = None) -> Diagnosis:
    """Analyze the dump event at ``path`` (an event directory, or a dump directory whose newest
    event is taken, or the one named ``event``). Raises :class:`tether.AnalysisError` when
    nothing usable is there (the message names the files and why). ``jobs``: worker processes
    that read the files at once (default: one per CPU for events of 32 files or more; 0: read
    in this process)."""
    return analyze_event(load(path, event=event, jobs=jobs))


def load(path: str | Path, *, event: str | None = None, jobs: int | None = None) -> Event:
    """The event at ``path`` read into columns (what :func:`analyze` works on)."""
    try:
        event_dir = resolve_dump_event(path, event)
    except UnsafeDumpError as exc:
        raise AnalysisError(str(exc)) from exc
    files = find_dump_files(event_dir)
    ev = load_event_columns(event_dir, files, jobs)
    if not ev.ranks:
        why = "; ".join(ev.unreadable.values()) or "no dump files"
        raise AnalysisError(f"{event_dir}: no usable dump: {why}")
    return ev


def analyze_event(ev: Event) -> Diagnosis:
    d = Diagnosis(
        event=ev.name,
        verdict="healthy",
        world_size=ev.world_size,
        ranks_loaded=len(ev.ranks),
        reason=ev.reason,
        dead_ranks=dict(sorted(ev.dead_ranks.items())),
        unreadable=dict(ev.unreadable),
        missing_dumps=ev.missing,
    )
    waits = findings.find_waits(ev)
    desyncs = findings.find_desync(ev)
    stacks_files = {r for r in ev.missing if (ev.path / f"stacks_{r}.txt").is_file()}
    d.unmatched_p2p = [
        UnmatchedP2P(group=g, src=s, dst=t, sends=ns, recvs=nr)
        for g, s, t, ns, nr in findings.unmatched_p2p(ev, waits)
    ]
    if ev.dead_ranks:
        _crash(ev, d, sorted(ev.dead_ranks), waits)
    elif (dz := _stuck_desync(desyncs, waits)) is not None:
        _desync(ev, d, dz)
    elif waits:
        _hang(ev, d, waits, stacks_files)
    elif desyncs:
        _desync(ev, d, min(desyncs, key=lambda x: x.seq))
    else:
        _straggler_or_healthy(ev, d)
    if d.verdict not in ("straggler", "healthy", "inconclusive"):
        d.stragglers = _stragglers(ev)
    _gaps(ev, d)
    _stacks(ev, d)
    return d


# -- verdicts ---------------------------------------------------------------------------------
def _crash(ev: Event, d: Diagnosis, culprits: list[int], waits: list[Wait]) -> None:
    d.verdict = "crash"
    d.culprit_ranks = culprits
    for r in culprits:
        how = ev.dead_ranks.get(r)
        if how:
            d.evidence.append(f"rank {r} died ({how}), as the launcher recorded")
        else:
            d.evidence.append(f"rank {r} left no dump and no stacks: it died or never answered")
        progress = _last_progress(ev, r)
        d.per_rank[r] = progress
        d.evidence.append(f"rank {r} last known progress: {progress}")
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    if broken:
        error = next(iter(broken.values()))
        d.evidence.append(
            f"the backend failed the last operation of rank(s) {compress_ranks(list(broken))} "
            f"(not completed: no proof the dead rank took part): {error}"
        )
    blocked = [w for w in waits if set(w.blockers) & set(culprits)]
    if blocked:
        w = min(blocked, key=lambda w: w.t)
        _locate(ev, d, w.group, w.seq, w.sig, w.kind)
        d.evidence.append(
            f"{len(blocked)} rank(s) wait for it in group {_gname(ev, w.group)}, "
            f"{_what(ev, w)}: {compress_ranks([w.rank for w in blocked])}"
        )


def _stuck_desync(desyncs: list[Desync], waits: list[Wait]) -> Desync | None:
    """A desync at the operation ranks are waiting in (or before it) explains the hang."""
    stuck = {(w.group, w.seq) for w in waits if w.seq is not None}
    frontier: dict[str, int] = {}
    for w in waits:
        if w.seq is not None:
            frontier[w.group] = min(frontier.get(w.group, w.seq), w.seq)
    hits = [z for z in desyncs if (z.group, z.seq) in stuck or z.seq <= frontier.get(z.group, -1)]
    return min(hits, key=lambda z: z.seq) if hits else None


def _desync(ev: Event, d: Diagnosis, z: Desync) -> None:
    d.verdict = "desync"
    d.culprit_ranks = z.odd
    ref = z.majority if z.majority is not None else next(iter(z.by_rank.values()))
    _locate(ev, d, z.group, z.seq, ref, "collective")
    sides: dict[int, list[int]] = {}
    for r, code in z.by_rank.items():
        sides.setdefault(code, []).append(r)
    kinds = set()
    for code, ranks in sorted(sides.items(), key=lambda kv: -len(kv[1])):
        info = ev.sigs[code]
        d.evidence.append(
            f"seq {z.seq} in group {_gname(ev, z.group)}: rank(s) {compress_ranks(ranks)} "
            f"issued {_describe(info)}"
        )
        if code != ref:
            kinds.add(_difference(ev.sigs[ref], info))
        if code != ref or z.majority is None:
            for r in ranks[:MAX_PER_RANK]:
                d.per_rank[r] = f"issued {_describe(info)}"
    if z.majority is None:
        # No side is the reference: the sizes and dtypes are in the evidence, side by side.
        d.sizes = d.dtypes = None
        ops = {ev.sigs[code].op for code in sides}
        d.op = ops.pop() if len(ops) == 1 else None
        d.evidence.append("no majority: the sides are the same size, so each could be the odd one")
    else:
        d.evidence.append(
            f"the odd rank(s) differ from the group's majority ({len(sides[z.majority])} of "
            f"{len(z.by_rank)}) in {', '.join(sorted(kinds))}"
        )


def _difference(a: SigInfo, b: SigInfo) -> str:
    if a.key[0] != b.key[0]:
        return "op"
    if [x for x in a.key if isinstance(x, tuple)] != [x for x in b.key if isinstance(x, tuple)]:
        return "dtype"
    return "size"


def _hang(ev: Event, d: Diagnosis, waits: list[Wait], stacks_files: set[int]) -> None:
    d.verdict = "hang"
    roots = _roots(waits)
    if roots:
        _hang_roots(ev, d, waits, roots, stacks_files)
        return
    cyc = sorted({b for w in waits for b in w.blockers})
    if cyc:
        if _majority_cycle(ev, d, waits):
            return
        d.culprit_ranks = cyc
        w = min((w for w in waits if w.blockers), key=lambda w: (w.t, w.rank))
        _locate(ev, d, w.group, w.seq, w.sig, w.kind)
        cycle_groups = {x.group for x in waits if x.blockers}
        if len(cycle_groups) > 1:
            d.evidence.append(
                f"ranks {compress_ranks(cyc)} wait on each other in different groups: they "
                "issue the groups' operations in different orders (a deadlock)"
            )
        else:
            d.evidence.append(
                f"ranks {compress_ranks(cyc)} wait on each other in group {_gname(ev, w.group)}: "
                "each waits for an operation another never posted (a deadlock)"
            )
        for x in waits[:MAX_PER_RANK]:
            d.per_rank[x.rank] = f"waits in {_what(ev, x)} of group {_gname(ev, x.group)}"
        return
    # Everyone joined and it still did not complete.
    w = min(waits, key=lambda w: (w.t, w.rank))
    _locate(ev, d, w.group, w.seq, w.sig, w.kind)
    same = [x for x in waits if x.group == w.group and x.seq == w.seq]
    d.evidence.append(
        f"every member issued {_what(ev, w)} in group {_gname(ev, w.group)} and it did not "
        f"complete on {compress_ranks([x.rank for x in same])}: no rank is missing from it; "
        "look at the transport (network, a dead peer process) and the stacks"
    )
    done_elsewhere = _completed_by(ev, w)
    if done_elsewhere:
        d.culprit_ranks = sorted(x.rank for x in same)
        d.evidence.append(
            f"rank(s) {compress_ranks(done_elsewhere)} completed it: the others are stuck inside"
        )
    for x in same[:MAX_PER_RANK]:
        d.per_rank[x.rank] = f"inside {_what(ev, x)} since {_age(ev, x)}"


def _roots(waits: list[Wait]) -> set[int]:
    """Ranks some waiting rank waits for, directly or through others, that wait on no one
    themselves: idle (in Python, stuck in C), dead, or stuck inside an operation every member
    of its group issued."""
    blocked_by = {w.rank: w.blockers for w in waits}
    roots: set[int] = set()
    seen: set[int] = set()
    stack = [r for r, b in blocked_by.items() if b]
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        for b in blocked_by.get(r, ()):
            if blocked_by.get(b):
                stack.append(b)
            else:
                roots.add(b)
    return roots


def _hang_roots(
    ev: Event, d: Diagnosis, waits: list[Wait], roots: set[int], stacks_files: set[int]
) -> None:
    waiting = {w.rank: w for w in waits}
    stuck = {r: waiting[r] for r in roots if r in waiting}
    # A rank stuck inside a group whose membership no dump records (torch's gloo recorder)
    # may wait for members nobody knew of: when idle roots exist, they are the likelier cause,
    # and that group, not the ones waiting on it, is where they are missing.
    vague = [x for x in stuck.values() if _guessed_members(ev, x.group)]
    inside = min(vague, key=lambda x: (x.t, x.rank)) if vague and len(stuck) < len(roots) else None
    if inside is not None:
        roots = roots - {x.rank for x in vague}
        stuck = {r: x for r, x in stuck.items() if r in roots}
    d.culprit_ranks = sorted(roots)
    # The group where the culprits are missing and nothing else is: the root cause, not the
    # groups merely waiting on it transitively.
    direct = [w for w in waits if w.blockers and set(w.blockers) <= roots]
    w = inside or min(direct or [w for w in waits if w.blockers], key=lambda w: (w.t, w.rank))
    _locate(ev, d, w.group, w.seq, w.sig, w.kind)
    if inside is not None:
        info = ev.groups[w.group]
        d.evidence.append(
            f"rank(s) {compress_ranks(d.culprit_ranks)}, waited for and waiting on nothing, "
            f"likely never issued {_what(ev, w)} in group {_gname(ev, w.group)}, which rank(s) "
            f"{compress_ranks(sorted(x.rank for x in vague))} wait in: no dump's pg_config "
            f"records the group's members (taken as {compress_ranks(info.ranks)}, the ranks "
            "that recorded it), so they may belong to it"
        )
    else:
        never = sorted(set(w.blockers) & roots)
        d.evidence.append(
            f"rank(s) {compress_ranks(never)} never issued {_what(ev, w)} in group "
            f"{_gname(ev, w.group)}, which rank(s) "
            f"{compress_ranks([x.rank for x in direct or [w]])} wait in"
        )
    unknown = sorted({u for x in waits for u in x.unknown} - roots)
    if unknown:
        d.evidence.append(
            f"rank(s) {compress_ranks(unknown)} left no usable dump: whether they joined "
            "cannot be told; the ranks above certainly did not"
        )
    if w.kind == "collective" and w.joined:
        d.evidence.append(f"rank(s) {compress_ranks(w.joined)} joined it and are stuck inside")
    for r, x in sorted(stuck.items()):
        both = (
            f"every member issued (rank(s) {compress_ranks(x.joined)} are in it)"
            if x.kind == "collective"
            else f"rank {x.peer} posted the other side of"
        )
        d.evidence.append(
            f"rank {r} waits on no one: it is stuck inside {_what(ev, x)} of group "
            f"{_gname(ev, x.group)}, which {both}"
        )
    for r in d.culprit_ranks:
        if r in stuck:
            d.per_rank[r] = (
                f"stuck inside {_what(ev, stuck[r])} of group {_gname(ev, stuck[r].group)} "
                f"since {_age(ev, stuck[r])}"
            )
        elif r in ev.ranks:
            d.per_rank[r] = _where(ev, r, w.group)
        elif r in stacks_files:
            d.per_rank[r] = "no dump: stuck holding the GIL (stacks written by faulthandler)"
        else:
            d.per_rank[r] = "no dump; " + _last_progress(ev, r)
            if not _unreadable(ev, r):  # an unreadable dump was written: the rank was alive
                d.verdict = "crash"
                d.evidence.append(
                    f"rank {r} left no dump and no stacks while others wait for it: it died or "
                    "never answered"
                )
    others = [x for x in waits if x is not w and x.group != w.group and x.blockers]
    if others:
        gs = sorted({_gname(ev, x.group) for x in others})
        d.evidence.append(
            f"ranks waiting in {', '.join(gs)} wait on it transitively ({len(others)} rank(s))"
        )


def _guessed_members(ev: Event, group: str) -> bool:
    """The group's membership was taken from the ranks that recorded it (and is not the world)."""
    info = ev.groups.get(group)
    return info is not None and info.inferred and len(info.ranks) < ev.world_size


def _majority_cycle(ev: Event, d: Diagnosis, waits: list[Wait]) -> bool:
    """A wait cycle in which one of the awaited operations is a collective most of its group
    has issued: the culprits are the members that did not issue it (they are off waiting on
    something else, a send or receive nobody matches), not the majority waiting for them. A
    cycle without such a collective (a symmetric deadlock) is left to the caller."""
    best: Wait | None = None
    best_share = 0.0
    for w in waits:
        if w.kind != "collective" or not w.blockers:
            continue
        info = ev.groups.get(w.group)
        size = len(info.ranks) if info else 0
        if not size or 2 * len(w.joined) <= size:
            continue
        share = len(w.joined) / size
        if best is None or (share, -w.t, -w.rank) > (best_share, -best.t, -best.rank):
            best, best_share = w, share
    if best is None:
        return False
    w = best
    absent = sorted(w.blockers)
    d.culprit_ranks = absent
    _locate(ev, d, w.group, w.seq, w.sig, w.kind)
    waiting_in = sorted(x.rank for x in waits if x.group == w.group and x.seq == w.seq)
    d.evidence.append(
        f"rank(s) {compress_ranks(absent)} never issued {_what(ev, w)} in group "
        f"{_gname(ev, w.group)}, which rank(s) {compress_ranks(waiting_in)} of "
        f"{len(ev.groups[w.group].ranks)} wait in"
    )
    own = {x.rank: x for x in waits}
    for r in absent[:MAX_PER_RANK]:
        x = own.get(r)
        if x is None:
            d.per_rank[r] = _where(ev, r, w.group)
            continue
        d.per_rank[r] = f"waits in {_what(ev, x)} of group {_gname(ev, x.group)}"
        if x.kind in ("send", "recv") and x.blockers:
            other = "receive" if x.kind == "send" else "send"
            peer = x.blockers[0]
            theirs = own.get(peer)
            also = (
                f" (rank {peer} waits in {_what(ev, theirs)} of group {_gname(ev, theirs.group)})"
                if theirs is not None
                else ""
            )
            d.evidence.append(
                f"rank {r} waits in {_what(ev, x)} for a {other} rank {peer} never posted{also}"
            )
        elif x.blockers:
            d.evidence.append(
                f"rank {r} waits in {_what(ev, x)} of group {_gname(ev, x.group)} for rank(s) "
                f"{compress_ranks(x.blockers)}"
            )
    return True


def _straggler_or_healthy(ev: Event, d: Diagnosis) -> None:
    d.stragglers = _stragglers(ev)
    if d.stragglers:
        d.verdict = "straggler"
        d.culprit_ranks = [s.rank for s in d.stragglers]
        worst = d.stragglers[0]
        d.evidence.append(
            f"rank {worst.rank} issued {worst.collectives} collectives on average "
            f"{worst.mean_lag_ms:.1f} ms after the median rank, late in "
            f"{worst.late_fraction:.0%} of them (threshold: {findings.STRAGGLER_MIN_MS:g} ms mean "
            f"lag, late in ≥{findings.STRAGGLER_LATE_FRACTION:.0%} of ≥"
            f"{findings.STRAGGLER_MIN_COLLECTIVES} collectives; clock offsets to rank 0 applied)"
        )
        return
    if ev.missing:
        _inconclusive(ev, d)
        return
    d.verdict = "healthy"
    n = sum(len(c.seq) for tr in ev.ranks.values() for c in tr.groups.values())
    d.evidence.append(
        f"nothing wrong found: no rank waits for another, every group's ranks issued the same "
        f"collectives, no rank is consistently late ({n} collective records over "
        f"{len(ev.ranks)} rank(s) compared)"
    )


def _inconclusive(ev: Event, d: Diagnosis) -> None:
    """Nothing wrong among the dumps read, but some are missing with nothing that says what
    became of their ranks (no alarm, nobody waiting on them): a dump may just not have been
    collected, or the rank may have died after the others' last records."""
    d.verdict = "inconclusive"
    n = sum(len(c.seq) for tr in ev.ranks.values() for c in tr.groups.values())
    d.evidence.append(
        f"nothing wrong found among the {len(ev.ranks)} rank(s) read ({n} collective records), "
        f"but rank(s) {compress_ranks(ev.missing)} left no usable dump and nothing says why: no "
        "alarm recorded them dead, no rank waits for them"
    )
    for r in ev.missing[:MAX_PER_RANK]:
        d.per_rank[r] = "no usable dump; " + _last_progress(ev, r)


def _stragglers(ev: Event) -> list[Straggler]:
    out = []
    for lag in findings.find_lags(ev).values():
        if lag.n < findings.STRAGGLER_MIN_COLLECTIVES:
            continue
        frac = lag.late / lag.n
        if lag.mean_ms >= findings.STRAGGLER_MIN_MS and frac >= findings.STRAGGLER_LATE_FRACTION:
            out.append(
                Straggler(
                    rank=lag.rank, mean_lag_ms=lag.mean_ms, late_fraction=frac, collectives=lag.n
                )
            )
    return sorted(out, key=lambda s: -s.mean_lag_ms)


# -- helpers ----------------------------------------------------------------------------------
def _unreadable(ev: Event, rank: int) -> bool:
    return any(_rank_of(p) == rank for p in ev.unreadable)


def _rank_of(path: str) -> int | None:
    name = Path(path).name
    digits = ""
    for ch in reversed(name.split(".")[0]):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits) if digits else None


def _gname(ev: Event, group: str) -> str:
    info = ev.groups.get(group)
    desc = info.desc if info else ""
    return f"{group} ({desc})" if desc else group


def _what(ev: Event, w: Wait) -> str:
    op = ev.sigs[w.sig].op if 0 <= w.sig < len(ev.sigs) else "?"
    if w.kind == "collective":
        return f"{op} seq {w.seq}"
    arrow = f"{w.rank}->{w.peer}" if w.kind == "send" else f"{w.rank}<-{w.peer}"
    return f"{w.kind} {arrow}"


def _locate(ev: Event, d: Diagnosis, group: str, seq: int | None, sig: int, kind: str) -> None:
    info = ev.groups.get(group)
    d.process_group = GroupRef(
        name=group, desc=info.desc if info else "", ranks=list(info.ranks) if info else []
    )
    d.collective_seq_id = seq
    if 0 <= sig < len(ev.sigs):
        s = ev.sigs[sig]
        d.op = s.op
        d.sizes = {"input": s.input_sizes, "output": s.output_sizes}
        d.dtypes = {"input": s.input_dtypes, "output": s.output_dtypes}
    elif kind != "collective":
        d.op = kind


def _describe(s: SigInfo) -> str:
    dt = ",".join(s.input_dtypes) or "-"
    return f"{s.op} {s.input_sizes}->{s.output_sizes} {dt}"


def _where(ev: Event, rank: int, group: str) -> str:
    tr = ev.ranks[rank]
    c = tr.groups.get(group)
    last = tr.last_enqueued.get(group, 0)
    if c is not None and c.seq:
        last = max(last, c.seq[-1])
        op = ev.sigs[c.sig[-1]].op
        return f"its last op in group {_gname(ev, group)} is {op} seq {last}; it never went further"
    if last:
        return f"its last op in group {_gname(ev, group)} is seq {last} (from pg_status)"
    return f"it recorded nothing in group {_gname(ev, group)}"


def _last_progress(ev: Event, rank: int) -> str:
    """The last collective every group of ``rank`` completed on the others (so it took part)."""
    tr = ev.ranks.get(rank)
    if tr is not None:
        parts = [
            f"{ev.sigs[c.sig[-1]].op} seq {c.seq[-1]} in group {_gname(ev, g)}"
            for g, c in tr.groups.items()
            if c.seq
        ]
        return "its own last ops: " + "; ".join(parts) if parts else "its dump records nothing"
    parts = []
    for name, info in ev.groups.items():
        if rank not in info.ranks:
            continue
        best: tuple[int, int] | None = None
        for m in info.ranks:
            c = ev.cols(m, name)
            if c is None or not c.seq:
                continue
            k = c.done.find(0)
            k = len(c.seq) - 1 if k < 0 else k - 1
            if k >= 0 and (best is None or c.seq[k] > best[0]):
                best = (c.seq[k], c.sig[k])
        if best is not None:
            parts.append(
                f"{ev.sigs[best[1]].op} seq {best[0]} in group {_gname(ev, name)} "
                "(completed by its peers, so it took part)"
            )
    return "; ".join(parts) if parts else "unknown (no peer recorded a group it belongs to)"


def _completed_by(ev: Event, w: Wait) -> list[int]:
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


def _age(ev: Event, w: Wait) -> str:
    tr = ev.ranks[w.rank]
    if tr.dump_time_ns is None:
        return "before the dump"
    return f"{(tr.dump_time_ns + tr.clock_offset_ns - w.t) / 1e9:.1f} s before the dump"


def _gaps(ev: Event, d: Diagnosis) -> None:
    if d.missing_dumps:
        d.evidence.append(
            f"no usable dump from rank(s) {compress_ranks(d.missing_dumps)} of {ev.world_size}"
        )
    for path, why in list(ev.unreadable.items())[:10]:
        d.evidence.append(f"unreadable: {why}" if path in why else f"unreadable: {path}: {why}")
    if len(ev.unreadable) > 10:
        d.evidence.append(f"… and {len(ev.unreadable) - 10} more unreadable files")
    firsts = {tr.first_record_id for tr in ev.ranks.values() if tr.first_record_id}
    if len(firsts) > 1:
        d.evidence.append(
            "ranks' rings start at different records (wrap-around): compared over the "
            "sequence numbers every rank still holds"
        )
    d.evidence.extend(ev.notes)


def _stacks(ev: Event, d: Diagnosis) -> None:
    for r in d.culprit_ranks[:MAX_PER_RANK]:
        tr = ev.ranks.get(r)
        where, frames, _src = culprit_stack(ev.path, r, tr.path if tr else None)
        if where:
            d.culprit_stacks[r] = where
            d.culprit_tracebacks[r] = frames
