"""The analysis of one event: read every rank into columns, find what is wrong, decide.

Order of the verdicts, most specific first: a whole node its launchers declared failed (node
lost, unreachable or frozen); ranks recorded dead (crash); ranks that disagree on
the collective they are stuck in (desync); ranks waiting for others (hang, its root cause found
through the graph of who waits on whom; a crash when that root left no dump); a desync not (yet)
stuck; ranks that are consistently late (straggler); a missing dump nobody waits on
(inconclusive); healthy. Each verdict module (:mod:`~tether.analyze.nodes`,
:mod:`~tether.analyze.crash`, :mod:`~tether.analyze.desync`, :mod:`~tether.analyze.hang`) words
what it finds and returns it as a :class:`~tether.analyze.verdict.Finding`; this module alone
decides which finding is the verdict (:func:`_decide`) and builds the :class:`Diagnosis` once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tether._exceptions import AnalysisError, UnsafeDumpError
from tether.analyze import crash, deaths, desync, findings, hang, nodes
from tether.analyze.diagnosis import Diagnosis, Straggler, UnmatchedP2P
from tether.analyze.event import Event, compress_ranks, load_event_columns
from tether.analyze.findings import Desync, HangOp, Wait
from tether.analyze.regroups import regroup_sentences
from tether.analyze.stacks import culprit_stack
from tether.analyze.verdict import Finding, Where
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
    hop = findings.hang_op(ev)
    waits = findings.find_waits(ev)
    # Earliest first, ties by group name: the answer must not depend on the order of the files.
    desyncs = sorted(findings.find_desync(ev), key=lambda z: (z.seq, z.group))
    frozen = [r for r in ev.missing if deaths.unresponsive(ev.stacks.get(r)) and r not in dead]
    found = _decide(ev, dead, waits, desyncs, frozen, hop)
    if found.verdict in ("straggler", "healthy", "inconclusive"):
        stragglers = list(found.stragglers)
    else:
        # Beside another verdict, only a lag that could matter to it: tens of ms is any job's noise.
        stragglers = [s for s in _stragglers(ev) if s.mean_lag_ms >= findings.STRAGGLER_CONTEXT_MS]
    where = found.where or Where()
    culprit_stacks, culprit_tracebacks = _stacks(ev, found)
    return Diagnosis(
        event=ev.name,
        verdict=found.verdict,
        culprit_ranks=list(found.culprits),
        process_group=where.process_group,
        collective_seq_id=where.collective_seq_id,
        op=where.op,
        evidence=[*found.evidence, *deaths.death_notes(ev, dead), *_gaps(ev)],
        stragglers=stragglers,
        missing_dumps=ev.missing,
        culprit_stacks=culprit_stacks,
        culprit_tracebacks=culprit_tracebacks,
        sizes=where.sizes,
        dtypes=where.dtypes,
        per_rank=dict(found.per_rank),
        unmatched_p2p=[
            UnmatchedP2P(group=g, src=s, dst=t, sends=ns, recvs=nr)
            for g, s, t, ns, nr in findings.unmatched_p2p(ev, waits)
        ],
        dead_ranks=dead,
        unreadable=dict(ev.unreadable),
        world_size=ev.world_size,
        ranks_loaded=len(ev.ranks),
        reason=ev.reason,
        consequences=dict(found.consequences),
        recovered_ranks=sorted(ev.recovered),
        unresponsive_ranks={r: ev.stacks[r].get("state") or "unknown" for r in frozen},
        hang_timeout_s=ev.hang_timeout_s,
        regroups=regroup_sentences(ev.path),
        exceptions=dict(found.exceptions),
        hosts=dict(ev.hosts) if len(set(ev.hosts.values())) > 1 else {},
        nodes=list(found.nodes),
    )


def _decide(
    ev: Event,
    dead: dict[int, str],
    waits: list[Wait],
    desyncs: list[Desync],
    frozen: list[int],
    hop: HangOp | None,
) -> Finding:
    """The one place that decides between the verdict modules' findings, most specific first
    (the order in this module's docstring)."""
    if (node := nodes.node_fault(ev, waits, hop)) is not None:
        return node
    if dead:
        # A mismatch among the dumps that exist explains a death the backend caused (gloo
        # aborts the side that receives more than it expects): the dead are its consequences.
        dz = desync.stuck_desync(desyncs, waits) or (desyncs[0] if desyncs else None)
        if dz is not None:
            return desync.desync_with_deaths(ev, dead, dz, hop)
        outnumbered = desync.outnumbered_by_aborts(ev, dead, waits, hop)
        return outnumbered if outnumbered is not None else crash.crash(ev, dead, waits, hop)
    if (formed := hang.creation(ev)) is not None:
        return formed
    if (dz := desync.stuck_desync(desyncs, waits)) is not None:
        return desync.desync(ev, dz, hop)
    if waits:
        stacks_files = {r for r in ev.missing if r in ev.stacks}
        waited = hang.hang(ev, waits, stacks_files, hop)
        # Ranks others wait for that left nothing at all (no dump, no stacks, not even an
        # unreadable file) died or never answered: that is a crash, not a hang.
        return dataclasses.replace(waited, verdict="crash") if waited.unheard else waited
    if desyncs:
        return desync.desync(ev, desyncs[0], hop)
    if frozen:
        return hang.frozen(ev, frozen, hop)
    if hop is not None and (late := hang.resolved(ev, hop)) is not None:
        return late
    return _straggler_or_healthy(ev)


def _straggler_or_healthy(ev: Event) -> Finding:
    stragglers = _stragglers(ev)
    if stragglers:
        worst = stragglers[0]
        said = (
            f"rank {worst.rank} issued {worst.collectives} collectives on average "
            f"{worst.mean_lag_ms:.1f} ms after the median rank, late in "
            f"{worst.late_fraction:.0%} of them (threshold: {findings.STRAGGLER_MIN_MS:g} ms mean "
            f"lag, late in ≥{findings.STRAGGLER_LATE_FRACTION:.0%} of ≥"
            f"{findings.STRAGGLER_MIN_COLLECTIVES} collectives; clock offsets to rank 0 applied)"
        )
        return Finding(
            verdict="straggler",
            culprits=tuple(s.rank for s in stragglers),
            evidence=(said,),
            stragglers=tuple(stragglers),
        )
    if ev.missing:
        return _inconclusive(ev)
    n = sum(len(c.seq) for tr in ev.ranks.values() for c in tr.groups.values())
    evidence = []
    if ev.reason == "signal":
        evidence.append("stopped by a signal; nothing was stuck")
    oldest = _oldest_in_flight(ev)
    if oldest is not None:
        age, r, what = oldest
        limit = findings.young_limit_ns(ev.hang_timeout_s)
        timeout = (
            f"the hang timeout is {ev.hang_timeout_s:g} s"
            if ev.hang_timeout_s
            else "the hang timeout is not recorded"
        )
        evidence.append(
            f"the oldest operation in flight at the dump, {what} on rank {r}, was "
            f"{age / 1e6:.0f} ms old: ordinary progress (under {limit / 1e9:g} s; {timeout})"
        )
    evidence.append(
        f"nothing wrong found: no rank waits for another, every group's ranks issued the same "
        f"collectives, no rank is consistently late ({n} collective records over "
        f"{len(ev.ranks)} rank(s) compared)"
    )
    return Finding(verdict="healthy", evidence=tuple(evidence))


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


def _inconclusive(ev: Event) -> Finding:
    """Nothing wrong among the dumps read, but some are missing with nothing that says what
    became of their ranks (no alarm, nobody waiting on them): a dump may just not have been
    collected, or the rank may have died after the others' last records."""
    n = sum(len(c.seq) for tr in ev.ranks.values() for c in tr.groups.values())
    said = (
        f"nothing wrong found among the {len(ev.ranks)} rank(s) read ({n} collective records), "
        f"but rank(s) {compress_ranks(ev.missing)} left no usable dump and nothing says why: no "
        "alarm recorded them dead, no rank waits for them"
    )
    return Finding(
        verdict="inconclusive",
        evidence=(said,),
        per_rank={r: "no usable dump; " + _last_progress(ev, r) for r in ev.missing[:MAX_PER_RANK]},
    )


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


def _entry_of(ev: Event, found: Finding, rank: int) -> int | None:
    """A culprit's entry of the operation shown (the mismatched one of a desync, the one a late
    rank caught up with): its call site is the line to show where its main thread says nothing;
    None where it never issued it (its last operation)."""
    where = found.where
    if (
        found.verdict not in ("desync", "hang")
        or where is None
        or where.process_group is None
        or not where.collective_seq_id
    ):
        return None
    c = ev.cols(rank, where.process_group.name)
    if c is None:
        return None
    for k in range(len(c.seq)):
        if c.seq[k] == where.collective_seq_id:
            return int(c.idx[k])
    return None


def _gaps(ev: Event) -> list[str]:
    """What the input lacks (missing and unreadable dumps, dropped records), then the event's
    own notes."""
    notes = []
    if ev.missing:
        notes.append(f"no usable dump from rank(s) {compress_ranks(ev.missing)} of {ev.world_size}")
    for path, why in list(ev.unreadable.items())[:10]:
        notes.append(f"unreadable: {why}" if path in why else f"unreadable: {path}: {why}")
    if len(ev.unreadable) > 10:
        notes.append(f"… and {len(ev.unreadable) - 10} more unreadable files")
    dropped = {r: tr.dropped for r, tr in ev.ranks.items() if tr.dropped}
    firsts = {tr.first_record_id for tr in ev.ranks.values() if tr.first_record_id}
    if dropped:
        notes.append(
            f"the rings of rank(s) {compress_ranks(sorted(dropped))} dropped completed entries "
            f"for newer ones (up to {max(dropped.values())}; never one still in flight): "
            "compared over the sequence numbers every rank still holds"
        )
    elif len(firsts) > 1:
        notes.append(
            "ranks' rings start at different records (wrap-around): compared over the "
            "sequence numbers every rank still holds"
        )
    notes.extend(ev.notes)
    return notes


def _stacks(ev: Event, found: Finding) -> tuple[dict[int, str], dict[int, list[str]]]:
    """The first culprits' innermost line of user code and whole stack at dump time."""
    lines: dict[int, str] = {}
    tracebacks: dict[int, list[str]] = {}
    for r in found.culprits[:MAX_PER_RANK]:
        tr = ev.ranks.get(r)
        where, frames, _src = culprit_stack(
            ev.path,
            r,
            tr.path if tr else None,
            _entry_of(ev, found, r),
            entry_first=found.verdict == "desync",  # it may have run on past the mismatched call
        )
        if where:
            lines[r] = where
            tracebacks[r] = frames
    return lines, tracebacks
