"""The analysis of one event: read every rank into columns, find what is wrong, decide.

Order of the verdicts, most specific first: a whole node its launchers declared failed (node
lost, unreachable or frozen); ranks recorded dead (crash); ranks that disagree on
the collective they are stuck in (desync); ranks waiting for others (hang, its root cause found
through the graph of who waits on whom; a crash when that root left no dump); a desync not (yet)
stuck; ranks that are consistently late (straggler); a missing dump nobody waits on
(inconclusive); healthy. Each of the first three is decided and worded in its own module
(:mod:`~tether.analyze.crash`, :mod:`~tether.analyze.desync`, :mod:`~tether.analyze.hang`).
"""

from __future__ import annotations

from pathlib import Path

from tether._exceptions import AnalysisError, UnsafeDumpError
from tether.analyze import crash, deaths, desync, findings, hang, nodes
from tether.analyze.diagnosis import Diagnosis, Straggler, UnmatchedP2P
from tether.analyze.event import Event, compress_ranks, load_event_columns
from tether.analyze.regroups import regroup_sentences
from tether.analyze.stacks import culprit_stack
from tether.analyze.words import MAX_PER_RANK
from tether.analyze.words import gname as _gname
from tether.analyze.words import last_progress as _last_progress
from tether.events.load import find_dump_files, resolve_dump_event

__all__ = ["analyze", "analyze_event", "load"]


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
        hosts=dict(ev.hosts) if len(set(ev.hosts.values())) > 1 else {},
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
    if nodes.node_fault(ev, d, waits, hop):
        pass
    elif dead:
        # A mismatch among the dumps that exist explains a death the backend caused (gloo
        # aborts the side that receives more than it expects): the dead are its consequences.
        dz = desync.stuck_desync(desyncs, waits) or (desyncs[0] if desyncs else None)
        if dz is not None:
            desync.desync(ev, d, desync.tie_by_abort(ev, d, dz), hop)
            desync.consequences(ev, d, waits)
        elif not desync.outnumbered_by_aborts(ev, d, waits, hop):
            crash.crash(ev, d, waits, hop)
    elif hang.creation(ev, d):
        pass
    elif (dz := desync.stuck_desync(desyncs, waits)) is not None:
        desync.desync(ev, d, dz, hop)
    elif waits:
        hang.hang(ev, d, waits, stacks_files, hop)
    elif desyncs:
        desync.desync(ev, d, desyncs[0], hop)
    elif frozen:
        hang.frozen(ev, d, frozen, hop)
    elif hop is not None and hang.resolved(ev, d, hop):
        pass
    else:
        _straggler_or_healthy(ev, d)
    if d.verdict not in ("straggler", "healthy", "inconclusive"):
        # Beside another verdict, only a lag that could matter to it: tens of ms is any job's noise.
        d.stragglers = [
            s for s in _stragglers(ev) if s.mean_lag_ms >= findings.STRAGGLER_CONTEXT_MS
        ]
    d.evidence.extend(deaths.death_notes(ev, dead))
    d.regroups = regroup_sentences(ev.path)
    _gaps(ev, d)
    _stacks(ev, d)
    return d


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


def _entry_of(ev: Event, d: Diagnosis, rank: int) -> int | None:
    """A culprit's entry of the operation shown (the mismatched one of a desync, the one a late
    rank caught up with): its call site is the line to show where its main thread says nothing;
    None where it never issued it (its last operation)."""
    if d.verdict not in ("desync", "hang") or d.process_group is None or not d.collective_seq_id:
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
    dropped = {r: tr.dropped for r, tr in ev.ranks.items() if tr.dropped}
    firsts = {tr.first_record_id for tr in ev.ranks.values() if tr.first_record_id}
    if dropped:
        d.evidence.append(
            f"the rings of rank(s) {compress_ranks(sorted(dropped))} dropped completed entries "
            f"for newer ones (up to {max(dropped.values())}; never one still in flight): "
            "compared over the sequence numbers every rank still holds"
        )
    elif len(firsts) > 1:
        d.evidence.append(
            "ranks' rings start at different records (wrap-around): compared over the "
            "sequence numbers every rank still holds"
        )
    d.evidence.extend(ev.notes)


def _stacks(ev: Event, d: Diagnosis) -> None:
    for r in d.culprit_ranks[:MAX_PER_RANK]:
        tr = ev.ranks.get(r)
        where, frames, _src = culprit_stack(
            ev.path,
            r,
            tr.path if tr else None,
            _entry_of(ev, d, r),
            entry_first=d.verdict == "desync",  # it may have run on past the mismatched call
        )
        if where:
            d.culprit_stacks[r] = where
            d.culprit_tracebacks[r] = frames
