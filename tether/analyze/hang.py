"""The hang verdict: the root of the graph of who waits on whom, late arrivals at the alarm's
operation, live ranks that never answered, and wait cycles."""

from __future__ import annotations

from tether.analyze import deaths
from tether.analyze.diagnosis import GroupRef
from tether.analyze.event import Event, compress_ranks
from tether.analyze.findings import HangOp, Wait
from tether.analyze.verdict import Finding, Where
from tether.analyze.words import MAX_PER_RANK
from tether.analyze.words import age as _age
from tether.analyze.words import completed_by as _completed_by
from tether.analyze.words import first as _first
from tether.analyze.words import gname as _gname
from tether.analyze.words import group_ref as _group_ref
from tether.analyze.words import last_progress as _last_progress
from tether.analyze.words import locate as _locate
from tether.analyze.words import unreadable as _unreadable
from tether.analyze.words import what as _what
from tether.analyze.words import where as _where

__all__ = ["creation", "frozen", "hang", "resolved"]


def hang(ev: Event, waits: list[Wait], stacks_files: set[int], hop: HangOp | None) -> Finding:
    """Ranks wait for others: the root of who waits on whom, else the ranks of a wait cycle,
    else the operation every member joined that did not complete. ``stacks_files``: ranks with
    no dump but a stacks file."""
    roots = _roots(waits)
    if roots:
        return _hang_roots(ev, waits, roots, stacks_files, hop)
    cyc = sorted({b for w in waits for b in w.blockers})
    if cyc:
        majority = _majority_cycle(ev, waits)
        if majority is not None:
            return majority
        w = _first(hop, [w for w in waits if w.blockers])
        cycle_groups = {x.group for x in waits if x.blockers}
        if len(cycle_groups) > 1:
            said = (
                f"ranks {compress_ranks(cyc)} wait on each other in different groups: they "
                "issue the groups' operations in different orders (a deadlock)"
            )
        else:
            said = (
                f"ranks {compress_ranks(cyc)} wait on each other in group {_gname(ev, w.group)}: "
                "each waits for an operation another never posted (a deadlock)"
            )
        return Finding(
            verdict="hang",
            culprits=tuple(cyc),
            where=_locate(ev, w.group, w.seq, w.sig, w.kind),
            evidence=(said,),
            per_rank={
                x.rank: f"waits in {_what(ev, x)} of group {_gname(ev, x.group)}"
                for x in waits[:MAX_PER_RANK]
            },
        )
    # Everyone joined and it still did not complete.
    w = _first(hop, waits)
    same = [x for x in waits if x.group == w.group and x.seq == w.seq]
    evidence = [
        f"every member issued {_what(ev, w)} in group {_gname(ev, w.group)} and it did not "
        f"complete on {compress_ranks([x.rank for x in same])}: no rank is missing from it; "
        "look at the transport (network, a dead peer process) and the stacks"
    ]
    done_elsewhere = _completed_by(ev, w)
    culprits: list[int] = []
    if done_elsewhere:
        culprits = sorted(x.rank for x in same)
        evidence.append(
            f"rank(s) {compress_ranks(done_elsewhere)} completed it: the others are stuck inside"
        )
    return Finding(
        verdict="hang",
        culprits=tuple(culprits),
        where=_locate(ev, w.group, w.seq, w.sig, w.kind),
        evidence=tuple(evidence),
        per_rank={
            x.rank: f"inside {_what(ev, x)} since {_age(ev, x)}" for x in same[:MAX_PER_RANK]
        },
    )


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
    waits: list[Wait],
    roots: set[int],
    stacks_files: set[int],
    hop: HangOp | None,
) -> Finding:
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
    culprits = sorted(roots)
    # The group where the culprits are missing and nothing else is: the root cause, not the
    # groups merely waiting on it transitively.
    direct = [w for w in waits if w.blockers and set(w.blockers) <= roots]
    w = inside or _first(hop, direct or [w for w in waits if w.blockers])
    # Who waits in the operation shown: the direct waits of other groups are not in it.
    waiting_in = compress_ranks(
        [x.rank for x in direct if (x.group, x.seq) == (w.group, w.seq)] or [w.rank]
    )
    late = {m: ns for x in waits for m, ns in x.late.items() if m in roots}
    evidence: list[str] = []
    if inside is not None:
        info = ev.groups[w.group]
        evidence.append(
            f"rank(s) {compress_ranks(culprits)}, waited for and waiting on nothing, "
            f"likely never issued {_what(ev, w)} in group {_gname(ev, w.group)}, which rank(s) "
            f"{compress_ranks(sorted(x.rank for x in vague))} wait in: no dump's pg_config "
            f"records the group's members (taken as {compress_ranks(info.ranks)}, the ranks "
            "that recorded it), so they may belong to it"
        )
    elif late and set(w.blockers) & roots <= set(late):
        evidence.append(
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
        evidence.append(
            f"rank(s) {compress_ranks(never)} never issued {missing} in group "
            f"{_gname(ev, w.group)}, which rank(s) {waiting_in} wait in"
        )
    unknown = sorted({u for x in waits for u in x.unknown} - roots)
    if unknown:
        evidence.append(
            f"rank(s) {compress_ranks(unknown)} left no usable dump: whether they joined "
            "cannot be told; the ranks above certainly did not"
        )
    if w.kind == "collective" and w.joined:
        evidence.append(f"rank(s) {compress_ranks(w.joined)} joined it and are stuck inside")
    for r, x in sorted(stuck.items()):
        if r in late:
            continue
        both = (
            f"every member issued (rank(s) {compress_ranks(x.joined)} are in it)"
            if x.kind == "collective"
            else f"rank {x.peer} posted the other side of"
        )
        evidence.append(
            f"rank {r} waits on no one: it is stuck inside {_what(ev, x)} of group "
            f"{_gname(ev, x.group)}, which {both}"
        )
    per_rank: dict[int, str] = {}
    unheard: list[int] = []
    for r in culprits:
        if r in late:
            said = (
                f"arrived late: issued {_what(ev, w)} {late[r] / 1e9:.1f} s after the alarm was "
                "raised"
            )
        elif r in stuck:
            said = (
                f"stuck inside {_what(ev, stuck[r])} of group {_gname(ev, stuck[r].group)} "
                f"since {_age(ev, stuck[r])}"
            )
        elif r in ev.ranks:
            said = _where(ev, r, w.group)
        elif r in stacks_files and deaths.unresponsive(ev.stacks.get(r)):
            state = deaths.frozen_state(ev.stacks[r])
            said = f"no dump: {state}"
            evidence.append(
                f"rank {r} is {state}: it issued nothing since " + _last_progress(ev, r)
            )
        elif r in stacks_files:
            said = "no dump: stuck holding the GIL (stacks written by faulthandler)"
        else:
            said = "no dump; " + _last_progress(ev, r)
            if not _unreadable(ev, r):  # an unreadable dump was written: the rank was alive
                unheard.append(r)
                evidence.append(
                    f"rank {r} left no dump and no stacks while others wait for it: it died or "
                    "never answered"
                )
        if len(per_rank) < MAX_PER_RANK:  # every culprit's evidence, a few culprits' lines
            per_rank[r] = said
    others = [x for x in waits if x is not w and x.group != w.group and x.blockers]
    if others:
        gs = sorted({_gname(ev, x.group) for x in others})
        evidence.append(
            f"ranks waiting in {', '.join(gs)} wait on it transitively ({len(others)} rank(s))"
        )
    return Finding(
        verdict="hang",
        culprits=tuple(culprits),
        where=_locate(ev, w.group, w.seq, w.sig, w.kind),
        evidence=tuple(evidence),
        per_rank=per_rank,
        unheard=tuple(unheard),
    )


def frozen(ev: Event, frozen: list[int], hop: HangOp | None) -> Finding:
    """Nobody with a dump waits, but some rank is alive and never answered: it is the hang."""
    culprits = sorted(frozen)
    evidence = []
    per_rank = {}
    for r in culprits[:MAX_PER_RANK]:
        state = deaths.frozen_state(ev.stacks[r])
        per_rank[r] = f"no dump: {state}"
        evidence.append(f"rank {r} is {state}: it issued nothing since {_last_progress(ev, r)}")
    return Finding(
        verdict="hang",
        culprits=tuple(culprits),
        where=_locate_alarm(ev, hop) if hop is not None else None,
        evidence=tuple(evidence),
        per_rank=per_rank,
    )


def resolved(ev: Event, hop: HangOp) -> Finding | None:
    """Nobody waits any more, but the alarm's operation was issued by some ranks only after the
    alarm was raised (a late rank caught up before the dumps were written): they held it up.
    None where the records show no such rank."""
    if hop.seq <= 0 or not hop.raised_ns:
        return None
    entries = _entries_of(ev, hop)
    late = {
        r: t - hop.raised_ns for r, (t, _) in entries.items() if t > hop.raised_ns + hop.error_ns
    }
    if not late or len(late) == len(entries):
        return None  # nobody, or everybody, issued it after the alarm: no one to blame
    culprits = sorted(late)
    sig = entries[min(entries)][1]
    op = f"{ev.sigs[sig].op if 0 <= sig < len(ev.sigs) else '?'} seq {hop.seq}"
    raiser = f"rank {hop.seen_by}" if hop.seen_by >= 0 else "a rank"
    return Finding(
        verdict="hang",
        culprits=tuple(culprits),
        where=_locate(ev, hop.group, hop.seq, sig, "collective"),
        evidence=(
            f"{op} in group {_gname(ev, hop.group)} outlived the hang timeout on {raiser}, "
            f"which raised the alarm; rank(s) {compress_ranks(culprits)} issued it only after "
            "that, and it completed once they had: they arrived late (held up elsewhere, e.g. "
            "in a stuck C call, then let go), so they are what the others waited for",
        ),
        per_rank={
            r: f"arrived late: issued {op} {late[r] / 1e9:.1f} s after the alarm was raised"
            for r in culprits[:MAX_PER_RANK]
        },
    )


def _entries_of(ev: Event, hop: HangOp) -> dict[int, tuple[int, int]]:
    """Each rank's record of the alarm's collective: rank -> (issue time on rank 0's clock,
    signature), in rank order."""
    entries: dict[int, tuple[int, int]] = {}
    for r in sorted(ev.ranks):
        c = ev.cols(r, hop.group)
        if c is None:
            continue
        for k in range(len(c.seq)):
            if c.seq[k] == hop.seq:
                entries[r] = (c.t[k], c.sig[k])
                break
    return entries


def _locate_alarm(ev: Event, hop: HangOp) -> Where:
    """The alarm's operation, as some rank recorded it."""
    for _t, sig in _entries_of(ev, hop).values():
        return _locate(ev, hop.group, hop.seq, sig, "collective")
    return Where(process_group=_group_ref(ev, hop.group), collective_seq_id=hop.seq or None)


def _guessed_members(ev: Event, group: str) -> bool:
    """The group's membership was taken from the ranks that recorded it (and is not the world)."""
    info = ev.groups.get(group)
    return info is not None and info.inferred and len(info.ranks) < ev.world_size


def _majority_cycle(ev: Event, waits: list[Wait]) -> Finding | None:
    """A wait cycle in which one of the awaited operations is a collective most of its group
    has issued: the culprits are the members that did not issue it (they are off waiting on
    something else, a send or receive nobody matches), not the majority waiting for them. A
    cycle without such a collective (a symmetric deadlock) is left to the caller (None)."""
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
        return None
    w = best
    absent = sorted(w.blockers)
    waiting_in = sorted(x.rank for x in waits if x.group == w.group and x.seq == w.seq)
    evidence = [
        f"rank(s) {compress_ranks(absent)} never issued {_what(ev, w)} in group "
        f"{_gname(ev, w.group)}, which rank(s) {compress_ranks(waiting_in)} of "
        f"{len(ev.groups[w.group].ranks)} wait in"
    ]
    per_rank = {}
    own = {x.rank: x for x in waits}
    for r in absent[:MAX_PER_RANK]:
        x = own.get(r)
        if x is None:
            per_rank[r] = _where(ev, r, w.group)
            continue
        per_rank[r] = f"waits in {_what(ev, x)} of group {_gname(ev, x.group)}"
        if x.kind in ("send", "recv") and x.blockers:
            other = "receive" if x.kind == "send" else "send"
            peer = x.blockers[0]
            theirs = own.get(peer)
            also = (
                f" (rank {peer} waits in {_what(ev, theirs)} of group {_gname(ev, theirs.group)})"
                if theirs is not None
                else ""
            )
            evidence.append(
                f"rank {r} waits in {_what(ev, x)} for a {other} rank {peer} never posted{also}"
            )
        elif x.blockers:
            evidence.append(
                f"rank {r} waits in {_what(ev, x)} of group {_gname(ev, x.group)} for rank(s) "
                f"{compress_ranks(x.blockers)}"
            )
    return Finding(
        verdict="hang",
        culprits=tuple(absent),
        where=_locate(ev, w.group, w.seq, w.sig, w.kind),
        evidence=tuple(evidence),
        per_rank=per_rank,
    )


def creation(ev: Event) -> Finding | None:
    """Ranks waited in a group's creation (``init_process_group``, ``new_group``) past the hang
    timeout: the members that never arrived are the hang. Who they are is what a waiting rank
    found in the store, else the members without such a wait in their dumps. None where no
    dump waits in a creation."""
    waiting: dict[tuple[str, str], list[int]] = {}
    for r, tr in sorted(ev.ranks.items()):
        if tr.forming is not None:
            waiting.setdefault((tr.forming.group, tr.forming.op), []).append(r)
    if not waiting:
        return None
    # The creation most ranks wait in (ties: the first group by name).
    (group, op), waiters = min(waiting.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    forms = [f for r in waiters if (f := ev.ranks[r].forming) is not None]
    found = {m for f in forms if f.missing is not None for m in f.missing}
    members = forms[0].ranks
    missing = sorted(found) if found else [m for m in members if m not in waiters]
    if not missing:
        return None
    waited = max(f.waited_s for f in forms)
    per_rank = {}
    for r in missing[:MAX_PER_RANK]:
        if r in ev.ranks:
            per_rank[r] = f"never arrived at {op}: it was elsewhere"
        elif r in ev.stacks:
            state = deaths.frozen_state(ev.stacks[r])
            per_rank[r] = f"never arrived at {op}; no dump: {state}"
        else:
            per_rank[r] = f"never arrived at {op}; no dump, no stacks"
    return Finding(
        verdict="hang",
        culprits=tuple(missing),
        where=Where(
            process_group=GroupRef(name=group, desc=forms[0].group_desc, ranks=list(members)),
            op=op,
        ),
        evidence=(
            f"rank(s) {compress_ranks(waiters)} waited {waited:.1f}s in {op} of group "
            f"{group} ({forms[0].group_desc}, ranks {compress_ranks(members)}) for rank(s) "
            f"{compress_ranks(missing)}, which never arrived",
        ),
        per_rank=per_rank,
    )
