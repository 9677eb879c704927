"""The crash verdict: ranks recorded dead, the survivors' failed operations, and what is lost
with a dead rank's record."""

from __future__ import annotations

from tether.analyze import deaths
from tether.analyze.event import Event, compress_ranks
from tether.analyze.findings import HangOp, Wait
from tether.analyze.verdict import Finding, Where
from tether.analyze.words import MAX_PER_RANK
from tether.analyze.words import describe as _describe
from tether.analyze.words import first as _first
from tether.analyze.words import gname as _gname
from tether.analyze.words import last_progress as _last_progress
from tether.analyze.words import locate as _locate
from tether.analyze.words import what as _what
from tether.events.exception import describe
from tether.events.frames import format_frame, pick
from tether.events.schema import LEFT

__all__ = ["crash"]


def crash(ev: Event, dead_ranks: dict[int, str], waits: list[Wait], hop: HangOp | None) -> Finding:
    """The ranks recorded dead (``dead_ranks``: rank -> how) that died first, and what the
    survivors saw of it."""
    dead = sorted(dead_ranks)
    # A dead rank whose own record shows the backend failed its last operation died of a peer's
    # death (a broken connection), when some other rank died without such a record.
    victims = [r for r in dead if (tr := ev.ranks.get(r)) is not None and tr.failed]
    # So is a dead rank that was waiting, when it died, for another dead rank (a rank that
    # returned early, or died first) in an operation that one never joined.
    waited = {
        w.rank for w in waits if w.rank in dead_ranks and (set(w.blockers) - {w.rank}) & set(dead)
    }
    culprits = [r for r in dead if r not in victims and r not in waited] or dead
    evidence: list[str] = []
    per_rank: dict[int, str] = {}
    exceptions: dict[int, str] = {}
    consequences: dict[int, str] = {}
    for r in culprits:
        how = dead_ranks.get(r)
        raised = ev.exceptions.get(r)
        if raised is not None:
            exceptions[r] = describe(raised)
            frame = pick(raised["frames"])
            at = f" at {format_frame(frame)}" if frame else ""
            evidence.append(
                f"rank {r} died ({how}) of an exception it raised{at}: {describe(raised)} "
                f"(from {raised['source']})"
            )
        elif how == LEFT:
            evidence.append(
                f"rank {r} {how} while still a member of the job's groups: it returned while the "
                "others went on"
            )
        elif r in ev.dead_ranks:
            evidence.append(f"rank {r} died ({how}), as the launcher recorded")
        else:
            evidence.append(f"rank {r} died ({how}), as its stacks file records")
        if len(per_rank) < MAX_PER_RANK:
            progress = _last_progress(ev, r)
            per_rank[r] = progress
            evidence.append(f"rank {r} last known progress: {progress}")
    for r in sorted(waited - set(victims)) if culprits != dead else []:
        w = next(w for w in waits if w.rank == r)
        consequences[r] = (
            f"died ({dead_ranks[r]}) waiting in {_what(ev, w)} for rank(s) "
            f"{compress_ranks(culprits)}"
        )
    for r in victims if culprits != dead else []:
        error = ev.ranks[r].failed[-1]
        consequences[r] = (
            f"died ({dead_ranks[r]}) after the backend failed its operation, on rank(s) "
            f"{compress_ranks(culprits)}'s death"
        )
        evidence.append(
            f"rank {r} died ({dead_ranks[r]}) after the backend failed its last operation "
            f"({error}): a consequence of rank(s) {compress_ranks(culprits)}'s death"
        )
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    if broken:
        error = next(iter(broken.values()))
        evidence.append(
            f"the backend failed the last operation of rank(s) {compress_ranks(list(broken))} "
            f"(not completed: no proof the dead rank took part): {error}"
        )
    blocked = [w for w in waits if set(w.blockers) & set(culprits)]
    where: Where | None = None
    if blocked:
        # Where a survivor waits for the dead alone: a rank that also waits for live ranks
        # waits for them too (they wait for the dead one elsewhere), so it is not the death's
        # first consequence, even when it began waiting earlier.
        direct = [w for w in blocked if set(w.blockers) <= set(culprits)]
        w = _first(hop, direct or blocked)
        where = _locate(ev, w.group, w.seq, w.sig, w.kind)
        there = [x.rank for x in blocked if (x.group, x.seq) == (w.group, w.seq)]
        evidence.append(
            f"{len(there)} rank(s) wait for it in group {_gname(ev, w.group)}, "
            f"{_what(ev, w)}: {compress_ranks(there)}"
        )
        evidence.extend(_lost_side(ev, dead_ranks, w, blocked, culprits))
    return Finding(
        verdict="crash",
        culprits=tuple(culprits),
        where=where,
        evidence=tuple(evidence),
        per_rank=per_rank,
        consequences=consequences,
        exceptions=exceptions,
    )


def _lost_side(
    ev: Event, dead_ranks: dict[int, str], w: Wait, blocked: list[Wait], culprits: list[int]
) -> list[str]:
    """The dead rank's record is gone: say that the survivors agree with each other, and that
    whether the dead rank issued the same cannot be told (a desync that made the backend abort
    it looks exactly like this)."""
    lost = [r for r in culprits if r not in ev.ranks]
    same = [x for x in blocked if x.group == w.group and x.seq == w.seq]
    if not lost or w.kind != "collective" or len({x.sig for x in same}) != 1:
        return []
    aborted = any("SIGABRT" in dead_ranks.get(r, "") for r in lost)
    return [
        f"the survivors' records agree on {_what(ev, w)} in group {_gname(ev, w.group)} "
        f"({_describe(ev.sigs[w.sig])}, rank(s) {compress_ranks([x.rank for x in same])}); "
        f"rank(s) {compress_ranks(lost)}'s record is lost with it, so whether it issued the "
        "same cannot be told"
        + (f" (a desync looks like this: {deaths.ABORT_HINT})" if aborted else "")
    ]
