"""The analysis of one event: read every rank into columns, find what is wrong, decide.

Order of the verdicts, most specific first: ranks recorded dead (crash); ranks that disagree on
the collective they are stuck in (desync); ranks waiting for others (hang, its root cause found
through the graph of who waits on whom; a crash when that root left no dump); a desync not (yet)
stuck; ranks that are consistently late (straggler); a missing dump nobody waits on
(inconclusive); healthy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tether._exceptions import AnalysisError, UnsafeDumpError
from tether.analyze import deaths, findings
from tether.analyze.diagnosis import Diagnosis, GroupRef, Straggler, UnmatchedP2P
from tether.analyze.event import Event, compress_ranks, load_event_columns
from tether.analyze.findings import Desync, HangOp, Wait
from tether.analyze.model import SigInfo, canonical_op
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
    dead = dict(sorted({**deaths.stacks_dead(ev), **ev.dead_ranks}.items()))
    d = Diagnosis(
        event=ev.name,
        verdict="healthy",
        world_size=ev.world_size,
        ranks_loaded=len(ev.ranks),
        reason=ev.reason,
        dead_ranks=dead,
        unreadable=dict(ev.unreadable),
        missing_dumps=ev.missing,
        recovered_ranks=sorted(ev.recovered),
        hang_timeout_s=ev.hang_timeout_s,
    )
    hop = findings.hang_op(ev)
    waits = findings.find_waits(ev)
    # Earliest first, ties by group name: the answer must not depend on the order of the files.
    desyncs = sorted(findings.find_desync(ev), key=lambda z: (z.seq, z.group))
    stacks_files = {r for r in ev.missing if r in ev.stacks}
    frozen = [r for r in ev.missing if deaths.unresponsive(ev.stacks.get(r)) and r not in dead]
    for r in frozen:
        d.unresponsive_ranks[r] = ev.stacks[r].get("state") or "unknown"
    d.unmatched_p2p = [
        UnmatchedP2P(group=g, src=s, dst=t, sends=ns, recvs=nr)
        for g, s, t, ns, nr in findings.unmatched_p2p(ev, waits)
    ]
    if dead:
        # A mismatch among the dumps that exist explains a death the backend caused (gloo
        # aborts the side that receives more than it expects): the dead are its consequences.
        dz = _stuck_desync(desyncs, waits) or (desyncs[0] if desyncs else None)
        if dz is not None:
            _desync(ev, d, _tie_by_abort(ev, d, dz), hop)
            _consequences(ev, d, waits)
        elif not _outnumbered_by_aborts(ev, d, waits, hop):
            _crash(ev, d, waits, hop)
    elif (dz := _stuck_desync(desyncs, waits)) is not None:
        _desync(ev, d, dz, hop)
    elif waits:
        _hang(ev, d, waits, stacks_files, hop)
    elif desyncs:
        _desync(ev, d, desyncs[0], hop)
    elif frozen:
        _frozen(ev, d, frozen, hop)
    else:
        _straggler_or_healthy(ev, d)
    if d.verdict not in ("straggler", "healthy", "inconclusive"):
        d.stragglers = _stragglers(ev)
    d.evidence.extend(deaths.death_notes(ev, dead))
    _gaps(ev, d)
    _stacks(ev, d)
    return d


def _is_alarm_op(hop: HangOp | None, w: Wait) -> bool:
    return hop is not None and hop.covers(w.group, w.seq)


def _first(hop: HangOp | None, waits: list[Wait]) -> Wait:
    """The wait to report: on the alarm's operation if any is, else the oldest (then the lowest
    rank: never the order the dumps were read in)."""
    return min(waits, key=lambda w: (not _is_alarm_op(hop, w), w.t, w.rank))


# -- verdicts ---------------------------------------------------------------------------------
def _crash(ev: Event, d: Diagnosis, waits: list[Wait], hop: HangOp | None) -> None:
    d.verdict = "crash"
    dead = sorted(d.dead_ranks)
    # A dead rank whose own record shows the backend failed its last operation died of a peer's
    # death (a broken connection), when some other rank died without such a record.
    victims = [r for r in dead if (tr := ev.ranks.get(r)) is not None and tr.failed]
    culprits = [r for r in dead if r not in victims] or dead
    d.culprit_ranks = culprits
    for r in culprits:
        how = d.dead_ranks.get(r)
        if r in ev.dead_ranks:
            d.evidence.append(f"rank {r} died ({how}), as the launcher recorded")
        else:
            d.evidence.append(f"rank {r} died ({how}), as its stacks file records")
        if len(d.per_rank) < MAX_PER_RANK:
            progress = _last_progress(ev, r)
            d.per_rank[r] = progress
            d.evidence.append(f"rank {r} last known progress: {progress}")
    for r in victims if culprits != dead else []:
        error = ev.ranks[r].failed[-1]
        d.consequences[r] = (
            f"died ({d.dead_ranks[r]}) after the backend failed its operation, on rank(s) "
            f"{compress_ranks(culprits)}'s death"
        )
        d.evidence.append(
            f"rank {r} died ({d.dead_ranks[r]}) after the backend failed its last operation "
            f"({error}): a consequence of rank(s) {compress_ranks(culprits)}'s death"
        )
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    if broken:
        error = next(iter(broken.values()))
        d.evidence.append(
            f"the backend failed the last operation of rank(s) {compress_ranks(list(broken))} "
            f"(not completed: no proof the dead rank took part): {error}"
        )
    blocked = [w for w in waits if set(w.blockers) & set(culprits)]
    if blocked:
        w = _first(hop, blocked)
        _locate(ev, d, w.group, w.seq, w.sig, w.kind)
        d.evidence.append(
            f"{len(blocked)} rank(s) wait for it in group {_gname(ev, w.group)}, "
            f"{_what(ev, w)}: {compress_ranks([w.rank for w in blocked])}"
        )
        _lost_side(ev, d, w, blocked, culprits)


def _lost_side(ev: Event, d: Diagnosis, w: Wait, blocked: list[Wait], culprits: list[int]) -> None:
    """The dead rank's record is gone: say that the survivors agree with each other, and that
    whether the dead rank issued the same cannot be told (a desync that made the backend abort
    it looks exactly like this)."""
    lost = [r for r in culprits if r not in ev.ranks]
    same = [x for x in blocked if x.group == w.group and x.seq == w.seq]
    if not lost or w.kind != "collective" or len({x.sig for x in same}) != 1:
        return
    aborted = any("SIGABRT" in d.dead_ranks.get(r, "") for r in lost)
    d.evidence.append(
        f"the survivors' records agree on {_what(ev, w)} in group {_gname(ev, w.group)} "
        f"({_describe(ev.sigs[w.sig])}, rank(s) {compress_ranks([x.rank for x in same])}); "
        f"rank(s) {compress_ranks(lost)}'s record is lost with it, so whether it issued the "
        "same cannot be told"
        + (f" (a desync looks like this: {deaths.ABORT_HINT})" if aborted else "")
    )


def _consequences(ev: Event, d: Diagnosis, waits: list[Wait]) -> None:
    """After a desync verdict: the dead ranks that are not among the odd ones died of it."""
    for r, how in sorted(d.dead_ranks.items()):
        if r in d.culprit_ranks:
            continue
        d.consequences[r] = f"died ({how}) at the mismatch"
        hint = f" ({deaths.ABORT_HINT})" if "SIGABRT" in how else ""
        d.evidence.append(
            f"rank {r} died ({how}), as the launcher recorded: a consequence of the mismatch, "
            f"not its cause{hint}"
        )
        if r in d.per_rank or len(d.per_rank) < MAX_PER_RANK:
            d.per_rank.setdefault(r, f"died ({how}); " + _last_progress(ev, r))
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    if broken:
        error = next(iter(broken.values()))
        d.evidence.append(
            f"then the backend failed the operation of rank(s) {compress_ranks(list(broken))}: "
            f"{error}"
        )
    del waits


def _outnumbered_by_aborts(ev: Event, d: Diagnosis, waits: list[Wait], hop: HangOp | None) -> bool:
    """The survivors agree, and more of the group died of SIGABRT at that operation than
    survived it (a broadcast root sending more than every receiver expects): each aborted rank
    expected fewer bytes than it was sent, so the survivors are the odd side. A desync, said to
    be an inference; False (nothing decided) otherwise."""
    lost_all = [r for r in d.dead_ranks if r not in ev.ranks]
    lost = sorted(r for r in lost_all if "SIGABRT" in d.dead_ranks[r])
    if not lost or len(lost) != len(lost_all):
        return False
    broken = [w for w in waits if w.kind == "collective" and set(w.blockers) & set(lost)]
    if not broken:
        return False
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
        return False
    d.verdict = "desync"
    d.culprit_ranks = survivors
    _locate(ev, d, w.group, w.seq, w.sig, w.kind)
    d.sizes = d.dtypes = None  # the majority's are lost with it
    issued = _describe(ev.sigs[w.sig])
    for r in survivors[:MAX_PER_RANK]:
        d.per_rank[r] = f"issued {issued}"
    d.evidence.append(
        f"rank(s) {compress_ranks(here)} died of SIGABRT at {_what(ev, w)} in group "
        f"{_gname(ev, w.group)}, which rank(s) {compress_ranks(survivors)} issued as {issued}: "
        f"{deaths.ABORT_HINT}, so each expected fewer bytes than it was sent; outnumbered, rank(s) "
        f"{compress_ranks(survivors)} are the odd side (an inference from how the others died: "
        "their records are lost)"
    )
    _consequences(ev, d, waits)
    return True


def _tie_by_abort(ev: Event, d: Diagnosis, z: Desync) -> Desync:
    """A tie among the dumps that exist, where a rank whose record is lost died of SIGABRT: gloo
    aborts the process that receives more bytes than it expects, so the lost rank held the
    smaller buffer of two. Counted on that side, it may make a majority."""
    info = ev.groups.get(z.group)
    members = set(info.ranks) if info else set()
    lost = [
        r
        for r, how in d.dead_ranks.items()
        if "SIGABRT" in how and r not in ev.ranks and r in members
    ]
    codes = sorted(set(z.by_rank.values()))
    if z.majority is not None or not lost or len(codes) != 2:
        return z
    a, b = (ev.sigs[c] for c in codes)
    na, nb = deaths.nbytes(a), deaths.nbytes(b)
    if canonical_op(a.op) != canonical_op(b.op) or na is None or nb is None or na == nb:
        return z
    small, big = (codes[0], codes[1]) if na < nb else (codes[1], codes[0])
    n_small = sum(1 for v in z.by_rank.values() if v == small) + len(lost)
    n_big = sum(1 for v in z.by_rank.values() if v == big)
    if n_small <= n_big:
        return z
    odd = sorted(r for r, v in z.by_rank.items() if v == big)
    d.evidence.append(
        f"the dumps that exist are split evenly; rank(s) {compress_ranks(sorted(lost))}, whose "
        f"record is lost, died of SIGABRT: {deaths.ABORT_HINT}, so it held the smaller buffer "
        f"({_describe(ev.sigs[small])}) and rank(s) {compress_ranks(odd)}, with the larger one, "
        "are the odd side (an inference from how it died)"
    )
    return dataclasses.replace(z, majority=small, odd=odd)


def _stuck_desync(desyncs: list[Desync], waits: list[Wait]) -> Desync | None:
    """A desync at the operation ranks are waiting in (or before it) explains the hang."""
    stuck = {(w.group, w.seq) for w in waits if w.seq is not None}
    frontier: dict[str, int] = {}
    for w in waits:
        if w.seq is not None:
            frontier[w.group] = min(frontier.get(w.group, w.seq), w.seq)
    hits = [z for z in desyncs if (z.group, z.seq) in stuck or z.seq <= frontier.get(z.group, -1)]
    return min(hits, key=lambda z: z.seq) if hits else None


def _desync(ev: Event, d: Diagnosis, z: Desync, hop: HangOp | None = None) -> None:
    d.verdict = "desync"
    d.culprit_ranks = z.odd
    ref = z.majority if z.majority is not None else z.by_rank[min(z.by_rank)]
    _locate(ev, d, z.group, z.seq, ref, "collective")
    sides: dict[int, list[int]] = {}
    for r, code in sorted(z.by_rank.items()):
        sides.setdefault(code, []).append(r)
    kinds = set()
    # The largest side first; equal sides in order of their lowest rank.
    for code, ranks in sorted(sides.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
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
        elif len(ranks) and ranks[0] not in d.per_rank:  # one of the majority, for contrast
            d.per_rank[ranks[0]] = f"issued {_describe(info)} (as rank(s) {compress_ranks(ranks)})"
    if z.majority is None:
        # No side is the reference: the sizes and dtypes are in the evidence, side by side.
        d.sizes = d.dtypes = None
        ops = {ev.sigs[code].op for code in sides}
        d.op = ops.pop() if len(ops) == 1 else None
        d.evidence.append("no majority: the sides are the same size, so each could be the odd one")
    else:
        d.evidence.append(
            f"the odd rank(s) differ from the group's majority ({len(sides.get(z.majority, []))} "
            f"of {len(z.by_rank)} dumps) in {', '.join(sorted(kinds))}"
        )
    if hop is not None and hop.group == z.group and 0 < z.seq < hop.seq:
        d.evidence.append(
            f"the alarm was about seq {hop.seq} in group {_gname(ev, hop.group)}: the mismatch "
            "is at or before it, so it explains it"
        )


def _difference(a: SigInfo, b: SigInfo) -> str:
    if a.key[0] != b.key[0]:
        return "op"
    if [x for x in a.key if isinstance(x, tuple)] != [x for x in b.key if isinstance(x, tuple)]:
        return "dtype"
    return "size"


def _hang(
    ev: Event, d: Diagnosis, waits: list[Wait], stacks_files: set[int], hop: HangOp | None
) -> None:
    d.verdict = "hang"
    roots = _roots(waits)
    if roots:
        _hang_roots(ev, d, waits, roots, stacks_files, hop)
        return
    cyc = sorted({b for w in waits for b in w.blockers})
    if cyc:
        if _majority_cycle(ev, d, waits):
            return
        d.culprit_ranks = cyc
        w = _first(hop, [w for w in waits if w.blockers])
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
    w = _first(hop, waits)
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
    ev: Event,
    d: Diagnosis,
    waits: list[Wait],
    roots: set[int],
    stacks_files: set[int],
    hop: HangOp | None,
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
    w = inside or _first(hop, direct or [w for w in waits if w.blockers])
    _locate(ev, d, w.group, w.seq, w.sig, w.kind)
    # Who waits in the operation shown: the direct waits of other groups are not in it.
    waiting_in = compress_ranks(
        [x.rank for x in direct if (x.group, x.seq) == (w.group, w.seq)] or [w.rank]
    )
    late = {m: ns for x in waits for m, ns in x.late.items() if m in roots}
    if inside is not None:
        info = ev.groups[w.group]
        d.evidence.append(
            f"rank(s) {compress_ranks(d.culprit_ranks)}, waited for and waiting on nothing, "
            f"likely never issued {_what(ev, w)} in group {_gname(ev, w.group)}, which rank(s) "
            f"{compress_ranks(sorted(x.rank for x in vague))} wait in: no dump's pg_config "
            f"records the group's members (taken as {compress_ranks(info.ranks)}, the ranks "
            "that recorded it), so they may belong to it"
        )
    elif late and set(w.blockers) & roots <= set(late):
        d.evidence.append(
            f"rank(s) {compress_ranks(sorted(late))} issued {_what(ev, w)} in group "
            f"{_gname(ev, w.group)} only after the alarm was raised, while rank(s) "
            f"{waiting_in} waited in it: they arrived late "
            "(held up elsewhere, e.g. in a stuck C call, then let go), so they are what the others "
            "waited for"
        )
    else:
        never = sorted(set(w.blockers) & roots)
        # A send or receive is waited in by one rank, and its peer never posted the other side.
        missing = (
            _what(ev, w)
            if w.kind == "collective"
            else f"the {'receive' if w.kind == 'send' else 'send'} matching {_what(ev, w)}"
        )
        d.evidence.append(
            f"rank(s) {compress_ranks(never)} never issued {missing} in group "
            f"{_gname(ev, w.group)}, which rank(s) {waiting_in} wait in"
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
        if r in late:
            continue
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
        if r in late:
            d.per_rank[r] = (
                f"arrived late: issued {_what(ev, w)} {late[r] / 1e9:.1f} s after the alarm was "
                "raised"
            )
        elif r in stuck:
            d.per_rank[r] = (
                f"stuck inside {_what(ev, stuck[r])} of group {_gname(ev, stuck[r].group)} "
                f"since {_age(ev, stuck[r])}"
            )
        elif r in ev.ranks:
            d.per_rank[r] = _where(ev, r, w.group)
        elif r in stacks_files and deaths.unresponsive(ev.stacks.get(r)):
            state = deaths.frozen_state(ev.stacks[r])
            d.per_rank[r] = f"no dump: {state}"
            d.evidence.append(
                f"rank {r} is {state}: it issued nothing since " + _last_progress(ev, r)
            )
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
    for r in d.culprit_ranks[MAX_PER_RANK:]:  # the loop above also decides crash or hang
        d.per_rank.pop(r, None)
    others = [x for x in waits if x is not w and x.group != w.group and x.blockers]
    if others:
        gs = sorted({_gname(ev, x.group) for x in others})
        d.evidence.append(
            f"ranks waiting in {', '.join(gs)} wait on it transitively ({len(others)} rank(s))"
        )


def _frozen(ev: Event, d: Diagnosis, frozen: list[int], hop: HangOp | None) -> None:
    """Nobody with a dump waits, but some rank is alive and never answered: it is the hang."""
    d.verdict = "hang"
    d.culprit_ranks = sorted(frozen)
    if hop is not None:
        _locate_alarm(ev, d, hop)
    for r in d.culprit_ranks[:MAX_PER_RANK]:
        state = deaths.frozen_state(ev.stacks[r])
        d.per_rank[r] = f"no dump: {state}"
        d.evidence.append(f"rank {r} is {state}: it issued nothing since {_last_progress(ev, r)}")


def _locate_alarm(ev: Event, d: Diagnosis, hop: HangOp) -> None:
    """The alarm's operation, as some rank recorded it."""
    for r in sorted(ev.ranks):
        c = ev.cols(r, hop.group)
        if c is None:
            continue
        for k in range(len(c.seq)):
            if c.seq[k] == hop.seq:
                _locate(ev, d, hop.group, hop.seq, c.sig[k], "collective")
                return
    info = ev.groups.get(hop.group)
    d.process_group = GroupRef(
        name=hop.group, desc=info.desc if info else "", ranks=list(info.ranks) if info else []
    )
    d.collective_seq_id = hop.seq or None


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
    if ev.reason == "signal":
        d.evidence.append("stopped by a signal; nothing was stuck")
    oldest = _oldest_in_flight(ev)
    if oldest is not None:
        age, r, what = oldest
        limit = findings.young_limit_ns(ev.hang_timeout_s)
        timeout = (
            f"the hang timeout is {ev.hang_timeout_s:g} s"
            if ev.hang_timeout_s
            else "the hang timeout is not recorded"
        )
        d.evidence.append(
            f"the oldest operation in flight at the dump, {what} on rank {r}, was "
            f"{age / 1e6:.0f} ms old: ordinary progress (under {limit / 1e9:g} s; {timeout})"
        )
    d.evidence.append(
        f"nothing wrong found: no rank waits for another, every group's ranks issued the same "
        f"collectives, no rank is consistently late ({n} collective records over "
        f"{len(ev.ranks)} rank(s) compared)"
    )


def _oldest_in_flight(ev: Event) -> tuple[int, int, str] | None:
    """(age at dump in ns, rank, what) of the oldest operation not completed at dump time."""
    best: tuple[int, int, str] | None = None
    for r, tr in sorted(ev.ranks.items()):
        if tr.dump_time_ns is None:
            continue
        now = tr.dump_time_ns + tr.clock_offset_ns
        for name, c in sorted(tr.groups.items()):
            k = c.done.find(0)
            if k >= 0 and (best is None or now - c.t[k] > best[0]):
                op = ev.sigs[c.sig[k]].op if 0 <= c.sig[k] < len(ev.sigs) else "?"
                best = (now - c.t[k], r, f"{op} seq {c.seq[k]} in group {_gname(ev, name)}")
        for p in tr.p2p:
            if not p.done:
                if best is None or now - p.t > best[0]:
                    best = (now - p.t, r, f"{p.kind} in group {_gname(ev, p.group)}")
                break
    return best


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


def _entry_of(ev: Event, d: Diagnosis, rank: int) -> int | None:
    """A desync culprit's entry of the mismatched operation (its call site is the line to show
    where its main thread says nothing); None otherwise (its last operation)."""
    if d.verdict != "desync" or d.process_group is None or d.collective_seq_id is None:
        return None
    c = ev.cols(rank, d.process_group.name)
    if c is None:
        return None
    for k in range(len(c.seq)):
        if c.seq[k] == d.collective_seq_id:
            return int(c.idx[k])
    return None


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
        where, frames, _src = culprit_stack(
            ev.path, r, tr.path if tr else None, _entry_of(ev, d, r)
        )
        if where:
            d.culprit_stacks[r] = where
            d.culprit_tracebacks[r] = frames
