"""What the columns show, one finder per kind of trouble: who waits on whom (hang, p2p), where
ranks disagree (desync), who arrives late (straggler).

None of them compares with rank 0: a hang's culprit is the rank the waiting ranks wait for, a
desync's odd ranks are those that differ from the group's majority, a straggler's lag is measured
against each collective's median arrival.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from operator import gt

from tether.analyze.event import Event
from tether.analyze.model import GroupCols, P2POp

__all__ = [
    "STRAGGLER_LATE_FRACTION",
    "STRAGGLER_MIN_COLLECTIVES",
    "STRAGGLER_MIN_MS",
    "Desync",
    "Lag",
    "Wait",
    "find_desync",
    "find_lags",
    "find_waits",
]

TROUBLE_REASONS = frozenset({"hang", "crash", "timeout", "watchdog", "error"})
YOUNG_NS = 5_000_000_000
"""In a dump taken for no trouble (manual, exit, a signal), an operation in flight for less than
this (or than the hang timeout, if shorter; a tenth of it, if longer) is ordinary progress.
Why: a healthy step's collective waits for its slowest member for milliseconds, seldom seconds,
so 5 s is far outside normal jitter yet far below any hang timeout in use; a job that sets a
long timeout expects long waits (a checkpoint, a slow loader), and a tenth of it is still well
inside what it allows."""
FRESH_MARGIN_S = 1.0
"""In a hang event, an operation issued less than this (or a tenth of the hang timeout, if
shorter) before the alarm, or after it, is not what the alarm is about: its group still
progresses (a busy side group driven by background threads). Why it is safe: the alarm's
operation had waited a whole timeout, so what a rank issued in the last moment before the alarm
cannot explain that wait; the margin covers the time between the raise and each rank's dump."""


def young_limit_ns(hang_timeout_s: float | None) -> int:
    """How young an operation in flight is ordinary progress in a dump taken for no trouble."""
    if hang_timeout_s is None:
        return YOUNG_NS
    t = int(hang_timeout_s * 1e9)
    return max(min(t, YOUNG_NS), t // 10)


STRAGGLER_MIN_MS = 10.0
"""A rank is a straggler when it issues collectives, on average, at least this much later than
the collective's median rank (clock offsets applied) ..."""
STRAGGLER_LATE_FRACTION = 0.6
"""... is later than the median in at least this share of them ..."""
STRAGGLER_MIN_COLLECTIVES = 5
"""... over at least this many completed collectives."""
STRAGGLER_CONTEXT_MS = 1000.0
"""Beside another verdict (a hang, a crash), a straggler is named only this late on average."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Wait:
    """A rank's oldest operation that has not completed, and whom it waits for."""

    rank: int
    group: str
    kind: str
    """``collective``, ``send`` or ``recv``."""
    seq: int | None
    sig: int
    t: int
    peer: int = -1
    blockers: list[int] = dataclasses.field(default_factory=list)
    """Members that never issued the operation (or the p2p peer that never posted its side)."""
    joined: list[int] = dataclasses.field(default_factory=list)
    unknown: list[int] = dataclasses.field(default_factory=list)
    """Members without a usable dump: whether they issued it cannot be told."""
    late: dict[int, int] = dataclasses.field(default_factory=dict)
    """Members that issued this operation (the alarm's) only after the alarm was raised: member
    -> how long after, in ns. They count among ``blockers``: they arrived late."""


def _last_enqueued(ev: Event, rank: int, group: str) -> int:
    tr = ev.ranks[rank]
    cols = tr.groups.get(group)
    return max(cols.last_seq() if cols else 0, tr.last_enqueued.get(group, 0))


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class HangOp:
    """The operation a hang alarm is about, and when the alarm was raised (rank 0's clock)."""

    group: str
    seq: int
    """0 for a send or receive."""
    raised_ns: int
    """When the alarm was raised, on rank 0's clock; 0 where unknown."""
    seen_by: int
    """The rank that raised it (-1: unknown)."""
    fresh_ns: int
    """Operations issued after this (rank 0's clock) are not waits, the alarm's own excepted."""
    error_ns: int = 0
    """How far off ``raised_ns`` may be: the raiser's clock error, or, where the raiser left no
    dump (its clock offset unknown), half the spread of the other ranks' offsets."""

    def covers(self, group: str, seq: int | None) -> bool:
        """Whether an operation of ``group`` with ``seq`` (None: p2p) is the alarm's."""
        if group != self.group:
            return False
        return seq is None if self.seq <= 0 else seq == self.seq


def hang_op(ev: Event) -> HangOp | None:
    """What the event's hang alarm names (its group and seq, and when it was raised)."""
    a = ev.alarm
    if a is None or a.reason != "hang" or not a.group:
        return None
    raised = error = 0
    raiser = ev.ranks.get(a.seen_by)
    if a.time_ns > 0 and raiser is not None:
        raised, error = a.time_ns + raiser.clock_offset_ns, raiser.clock_error_ns
    elif a.time_ns > 0 and ev.ranks:
        # The raiser's offset to rank 0 died with its dump. Ranks on one host share a clock, so
        # it likely lies among the others' offsets: take their midpoint, and their spread as
        # the error, so that no rank is called late (or its operation fresh) on a guess.
        offsets = [tr.clock_offset_ns for tr in ev.ranks.values()]
        lo, hi = min(offsets), max(offsets)
        raised = a.time_ns + (lo + hi) // 2
        error = (hi - lo + 1) // 2 + max(tr.clock_error_ns for tr in ev.ranks.values())
    timeout = ev.hang_timeout_s or a.timeout_s or 0.0
    margin = int(min(FRESH_MARGIN_S, timeout / 10) * 1e9) if timeout > 0 else 0
    return HangOp(
        group=a.group,
        seq=a.seq,
        raised_ns=raised,
        seen_by=a.seen_by,
        fresh_ns=raised - error - margin if raised else 0,
        error_ns=error,
    )


def find_waits(ev: Event) -> list[Wait]:
    """Each rank's oldest operation that has not completed (and is a wait: see below), with whom
    it waits for.

    In a hang event, an operation issued around or after the alarm is no wait, unless it is the
    alarm's own: its group was still progressing when the alarm was raised (a side group that
    background threads drive, in flight for microseconds at dump time). In a dump taken for no
    trouble (manual, exit, a signal), an operation far younger than the hang timeout is progress.
    """
    waits: list[Wait] = []
    trouble = ev.reason is None or ev.reason in TROUBLE_REASONS
    hop = hang_op(ev) if ev.reason == "hang" else None
    fresh = hop.fresh_ns if hop is not None and hop.raised_ns else None
    young_ns = young_limit_ns(ev.hang_timeout_s)

    def is_fresh(group: str, seq: int | None, t: int) -> bool:
        return fresh is not None and t > fresh and not (hop is not None and hop.covers(group, seq))

    for rank, tr in sorted(ev.ranks.items()):
        best: tuple[int, Wait] | None = None
        for name, cols in tr.groups.items():
            k = cols.done.find(0)
            if k < 0 or is_fresh(name, cols.seq[k], cols.t[k]):
                continue
            w = Wait(
                rank=rank,
                group=name,
                kind="collective",
                seq=cols.seq[k],
                sig=cols.sig[k],
                t=cols.t[k],
            )
            if best is None or cols.idx[k] < best[0]:
                best = (cols.idx[k], w)
        for p in tr.p2p:
            if not p.done:
                if (best is None or p.idx < best[0]) and not is_fresh(p.group, None, p.t):
                    w = Wait(rank=rank, group=p.group, kind=p.kind, seq=None, sig=p.sig, t=p.t)
                    w.peer = p.peer
                    best = (p.idx, w)
                break
        if best is None:
            continue
        w = best[1]
        young = tr.dump_time_ns is not None and (
            tr.dump_time_ns + tr.clock_offset_ns - w.t < young_ns
        )
        if not trouble and young:
            continue
        waits.append(w)
    last: dict[tuple[int, str], int] = {}  # (member, group) -> its last enqueued seq
    # Member -> how late it issued the alarm's collective (None: not late). Every waiting rank
    # asks about every other member: worked out once each, not once per pair (512 ranks: 0.5 s).
    lateness: dict[int, int | None] = {}
    # Ranks waiting in the same collective wait for the same members: worked out once per
    # collective and shared, read-only (16,384 ranks in one all_reduce: 20 s and 16,384 lists
    # of 16,384 members when worked out per wait). A late member's own wait is its own.
    shared: dict[tuple[str, int, bool], tuple[Wait, set[int]]] = {}
    for w in waits:
        if w.kind != "collective" or w.seq is None:
            _blockers(ev, w, last)
            continue
        late = bool(hop is not None and hop.raised_ns and _late_applies(hop, w))
        key = (w.group, w.seq, late)
        if key not in shared:
            one = Wait(rank=-1, group=w.group, kind=w.kind, seq=w.seq, sig=w.sig, t=w.t)
            _blockers(ev, one, last)
            if hop is not None and hop.seen_by in one.unknown and hop.covers(w.group, w.seq):
                # The raiser saw the alarm's collective in flight, so it issued it, dump or not.
                one.unknown.remove(hop.seen_by)
                one.joined.append(hop.seen_by)
            if late and hop is not None:
                _late(ev, one, hop, lateness)
            shared[key] = (one, set(one.joined))
        one, joined = shared[key]
        w.blockers, w.joined, w.unknown, w.late = one.blockers, one.joined, one.unknown, one.late
        if w.rank in one.late:  # never its own blocker: it is in the operation
            w.blockers = [m for m in one.blockers if m != w.rank]
            w.late = {m: ns for m, ns in one.late.items() if m != w.rank}
        if w.rank not in joined:
            w.joined = [*one.joined, w.rank]
    # A rank without a dump is a suspect only when no rank with a dump explains this wait:
    # decided per wait, so one rank waiting on a dumped rank does not hide another's wait on a
    # rank that left no dump (a cascade ending in a silent death).
    for w in waits:
        if not w.blockers:
            w.blockers, w.unknown = w.unknown, []
    return waits


def _late_applies(hop: HangOp, w: Wait) -> bool:
    """Whether lateness counts for ``w``: it waits in the alarm's collective, issued before the
    alarm (a late rank waits for nobody's lateness: it came after them all)."""
    return hop.covers(w.group, w.seq) and w.t <= hop.raised_ns and w.seq is not None


def _late(ev: Event, w: Wait, hop: HangOp, lateness: dict[int, int | None]) -> None:
    """Members of the alarm's collective that issued it only after the alarm was raised: they
    arrived late (held up elsewhere, then let go), so they are what the others waited for.
    ``lateness``: what is known of each member already (the alarm's collective is one). For a
    wait where lateness counts (:func:`_late_applies`)."""
    assert w.seq is not None
    joined = []
    for m in w.joined:
        if m not in lateness:
            c = ev.cols(m, w.group)  # None for the raiser without a dump: counted as joined
            t = _issued_at(c, w.seq) if c is not None else None
            # Late beyond doubt: past the alarm by more than the two clocks' error.
            limit = hop.raised_ns + hop.error_ns + (ev.ranks[m].clock_error_ns if t else 0)
            lateness[m] = t - hop.raised_ns if t is not None and t > limit else None
        ns = lateness[m]
        if ns is None or m == w.rank:
            joined.append(m)
        else:
            w.blockers.append(m)
            w.late[m] = ns
    w.joined = joined
    w.blockers.sort()


def _issued_at(c: GroupCols, seq: int) -> int | None:
    """When the rank issued ``seq`` of the group (its first entry), or None if not recorded."""
    for k in range(len(c.seq) - 1, -1, -1):  # the alarm's op is among the newest
        if c.seq[k] == seq and (k == 0 or c.seq[k - 1] != seq):
            return int(c.t[k])
        if c.seq[k] < seq:
            break
    return None


def _pending_p2p(ev: Event, rank: int, group: str, kind: str, peer: int) -> int:
    tr = ev.ranks.get(rank)
    if tr is None:
        return 0
    return sum(
        1 for p in tr.p2p if not p.done and p.group == group and p.kind == kind and (p.peer == peer)
    )


def _blockers(ev: Event, w: Wait, last: dict[tuple[int, str], int] | None = None) -> None:
    """Whom ``w`` waits for. A collective's members are split whoever waits (``w.rank`` -1):
    a waiting rank has issued the operation, so it lands among those that joined it."""
    if w.kind == "collective":
        assert w.seq is not None
        info = ev.groups.get(w.group)
        members = info.ranks if info else []
        cache = {} if last is None else last
        for m in members:
            if m not in ev.ranks:
                w.unknown.append(m)
                continue
            seq = cache.get((m, w.group))
            if seq is None:
                seq = cache[m, w.group] = _last_enqueued(ev, m, w.group)
            if seq < w.seq:
                w.blockers.append(m)
            else:
                w.joined.append(m)
        return
    if w.peer < 0:
        return
    other = "recv" if w.kind == "send" else "send"
    if w.peer not in ev.ranks:
        w.unknown.append(w.peer)
    elif _pending_p2p(ev, w.peer, w.group, other, w.rank) == 0:
        w.blockers.append(w.peer)


@dataclasses.dataclass(kw_only=True, slots=True)
class Desync:
    group: str
    seq: int
    by_rank: dict[int, int]
    """Member -> its signature code at ``seq`` (of a coalesced seq: the first entry where the
    members differ)."""
    majority: int | None
    """The signature most members issued; None on a tie."""
    odd: list[int]


Sigs = tuple[int, ...]
"""The signature codes a rank recorded under one seq: one, or several for a coalesced
collective (torch records each op of a coalescing group under the group's one seq)."""


class _SeqSigs:
    """A rank's signatures by seq, in one group, over the seqs it holds whole."""

    __slots__ = ("by_seq", "cols", "first", "last")

    def __init__(self, cols: GroupCols, partial_first: bool) -> None:
        self.cols = cols
        seq = cols.seq
        # One seq per entry, in order (what at() reads by position): the last is the highest.
        # (max() over every rank's seqs took 0.6 s at 16,384 ranks.)
        self.last = seq[-1]
        self.by_seq: dict[int, Sigs] | None = None
        if seq[-1] - seq[0] + 1 != len(seq):  # coalesced, or entries kept beyond the ring
            self.last = max(seq)
            by: dict[int, list[int]] = {}
            for s, code in zip(seq, cols.sig, strict=True):
                by.setdefault(s, []).append(code)
            self.by_seq = {s: tuple(v) for s, v in by.items()}
        # A ring that wrapped inside a coalesced seq holds only its tail: not compared.
        self.first = seq[0] + 1 if partial_first else seq[0]

    def at(self, s: int) -> Sigs | None:
        if s < self.first:
            return None
        if self.by_seq is not None:
            return self.by_seq.get(s)
        k = s - self.cols.seq[0]
        return (self.cols.sig[k],) if 0 <= k < len(self.cols.seq) else None


def _partial_first(ev: Event, rank: int, cols: GroupCols) -> bool:
    """Whether the group's first seq on ``rank`` may have lost entries to the ring: its first
    entry opens a ring that dropped records (a coalesced seq's entries are recorded together,
    so only the one at the ring's start can be cut)."""
    tr = ev.ranks[rank]
    return bool(tr.first_record_id) and cols.idx[0] == 0


def _window(sq: _SeqSigs, lo: int, hi: int) -> bytes | None:
    """The signatures of seqs lo..hi as bytes, when the rank holds them one per seq."""
    seq = sq.cols.seq
    if sq.by_seq is not None or seq[0] > lo or seq[-1] < hi:
        return None
    a = lo - seq[0]
    return sq.cols.sig[a : a + hi - lo + 1].tobytes()


def find_desync(ev: Event) -> list[Desync]:
    """The earliest disagreement in each group, over the sequence numbers every member that
    recorded the group still holds whole."""
    found: list[Desync] = []
    for name, info in ev.groups.items():
        present = [
            (m, _SeqSigs(c, _partial_first(ev, m, c)))
            for m in info.ranks
            if (c := ev.cols(m, name)) is not None and len(c.seq)
        ]
        if len(present) < 2:
            continue
        lo = max(sq.first for _, sq in present)
        hi = min(sq.cols.seq[-1] for _, sq in present)
        first_bad: int | None = None
        if lo <= hi:
            windows: dict[bytes | None, list[int]] = {}
            for m, sq in present:
                windows.setdefault(_window(sq, lo, hi), []).append(m)
            if len(windows) > 1 or None in windows:
                first_bad = _first_mismatch(present, lo, hi)
        # The seq just beyond the common window, issued by some: compare those too (a desync
        # at the hang's collective is the most common kind).
        if first_bad is None:
            for s in range(hi + 1, hi + 3):
                if len(set(_sigs_at(present, s).values())) > 1:
                    first_bad = s
                    break
        if first_bad is None:
            continue
        found.append(_desync_at(name, first_bad, present))
    return found


def _sigs_at(present: list[tuple[int, _SeqSigs]], s: int) -> dict[int, Sigs]:
    got = {m: v for m, sq in present if sq.last >= s and (v := sq.at(s)) is not None}
    # A rank may still be issuing the ops of its newest seq: there, compare what all hold.
    if got and any(sq.last == s for _, sq in present):
        n = min(map(len, got.values()))
        got = {m: v[:n] for m, v in got.items()}
    return got


def _desync_at(name: str, s: int, present: list[tuple[int, _SeqSigs]]) -> Desync:
    by_seq = _sigs_at(present, s)
    counts = Counter(by_seq.values())
    ranked = counts.most_common()
    top = ranked[0][0] if len(ranked) == 1 or ranked[0][1] > ranked[1][1] else None
    if top is not None:
        odd = sorted(m for m, v in by_seq.items() if v != top)
    else:
        odd = sorted(m for m, v in by_seq.items() if counts[v] <= ranked[0][1])
    # One code per member for the report: the seq's first entry where the members differ.
    width = max(map(len, by_seq.values()))
    k = next((i for i in range(width) if len({v[i : i + 1] for v in by_seq.values()}) > 1), 0)
    by_rank = {m: v[min(k, len(v) - 1)] for m, v in by_seq.items()}
    majority = None if top is None else top[min(k, len(top) - 1)]
    return Desync(group=name, seq=s, by_rank=by_rank, majority=majority, odd=odd)


def _first_mismatch(present: list[tuple[int, _SeqSigs]], lo: int, hi: int) -> int | None:
    # Walk seq by seq only where windows differ. Cheap: this runs only once a difference is
    # known (or for a coalesced group).
    for q in range(lo, hi + 1):
        if len(set(_sigs_at(present, q).values())) > 1:
            return q
    return None


@dataclasses.dataclass(kw_only=True, slots=True)
class Lag:
    rank: int
    total_ns: float = 0.0
    late: int = 0
    """Collectives it issued after the reference: counted only for a rank whose mean lag
    reaches :data:`STRAGGLER_MIN_MS` (no other can be a straggler)."""
    n: int = 0

    @property
    def mean_ms(self) -> float:
        return self.total_ns / self.n / 1e6 if self.n else 0.0


REF_MEMBERS = 255
"""The most members whose issue times make each collective's reference time (their median): in
a larger group, this many spread evenly over its members, in rank order. At 16,384 ranks the
whole group's medians took 10 s and a gigabyte; a straggler stands out of the sample's median
as it does of the group's (it is one rank of many, or a node of few)."""


def find_lags(ev: Event) -> dict[int, Lag]:
    """Per rank, how much later than each completed collective's median member it issued it.
    Two passes: the sums of every row first (C loops), then the count of late collectives of
    the few ranks whose mean lag could make them stragglers (a comparison per entry of every
    rank took 1.3 s of the 2.7 s this took at 16,384 ranks)."""
    lags: dict[int, Lag] = {}
    refs: list[tuple[list[tuple[int, GroupCols]], int, int, list[int]]] = []
    for name, info in ev.groups.items():
        present = [(m, c) for m in info.ranks if (c := ev.cols(m, name)) is not None and c.seq]
        if len(present) < 2 or len(present) < len(info.ranks) // 2:
            continue
        lo = max(c.seq[0] + _partial_first(ev, m, c) for m, c in present)
        hi = min(_last_done_seq(c) for _, c in present)
        if hi < lo:
            continue
        # Those that hold every seq from lo to hi (each row is read twice: for the reference,
        # then against it; never all of them at once).
        full = [(m, c) for m, c in present if _times(c, lo, hi) is not None]
        if len(full) < 2:
            continue
        n = len(full)
        sample = (
            full if n <= REF_MEMBERS else [full[i * n // REF_MEMBERS] for i in range(REF_MEMBERS)]
        )
        columns = zip(*(_times(c, lo, hi) or () for _, c in sample), strict=True)
        if n == 2:
            ref = [min(col) for col in columns]
        else:
            mid = len(sample) // 2
            ref = [sorted(col)[mid] for col in columns]
        ref_sum = sum(ref)
        for m, c in full:
            row = _times(c, lo, hi) or ()
            lag = lags.setdefault(m, Lag(rank=m))
            lag.total_ns += sum(row) - ref_sum
            lag.n += len(row)
        refs.append((full, lo, hi, ref))
    slow = {m for m, lag in lags.items() if lag.mean_ms >= STRAGGLER_MIN_MS}
    for full, lo, hi, ref in refs if slow else ():
        for m, c in full:
            if m in slow:
                lags[m].late += sum(map(gt, _times(c, lo, hi) or (), ref))
    return lags


def _times(c: GroupCols, lo: int, hi: int) -> Sequence[int] | None:
    """When the rank issued each of seqs lo..hi (a coalesced seq: its first entry), or None
    when it does not hold them all."""
    seq = c.seq
    if seq[-1] - seq[0] + 1 == len(seq):
        a = lo - seq[0]
        return c.t[a : a + hi - lo + 1]
    first = dict(zip(reversed(seq), reversed(c.t), strict=True))  # the earliest entry wins
    seqs = range(lo, hi + 1)
    return [first[s] for s in seqs] if all(s in first for s in seqs) else None


def _last_done_seq(c: GroupCols) -> int:
    k = c.done.find(0)
    if k < 0:
        return c.seq[-1]
    return c.seq[k] - 1


def unmatched_p2p(ev: Event, waits: list[Wait]) -> list[tuple[str, int, int, int, int]]:
    """(group, src, dst, pending sends, pending receives) for every pending send or receive
    whose other side was never posted."""
    out: dict[tuple[str, int, int], tuple[str, int, int, int, int]] = {}
    for rank, tr in ev.ranks.items():
        for p in tr.p2p:
            if p.done or p.peer < 0:
                continue
            src, dst = (rank, p.peer) if p.kind == "send" else (p.peer, rank)
            key = (p.group, src, dst)
            if key in out:
                continue
            sends = _pending_p2p(ev, src, p.group, "send", dst)
            recvs = _pending_p2p(ev, dst, p.group, "recv", src)
            if sends != recvs:
                out[key] = (p.group, src, dst, sends, recvs)
    del waits
    return list(out.values())


def p2p_of(ev: Event, rank: int) -> list[P2POp]:
    tr = ev.ranks.get(rank)
    return [] if tr is None else tr.p2p
