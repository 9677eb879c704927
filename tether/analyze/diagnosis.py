"""What the analyzer concludes about one dump event: :class:`Diagnosis`, and its JSON form.

The JSON keys are a published interface (``tether analyze --json``, the demo, the fault corpus):
add keys, never rename or remove one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

__all__ = [
    "VERDICTS",
    "Diagnosis",
    "GroupRef",
    "NodeFault",
    "Straggler",
    "UnmatchedP2P",
    "Verdict",
]

Verdict = Literal[
    "hang",
    "desync",
    "crash",
    "node_lost",
    "node_unreachable",
    "node_frozen",
    "partition",
    "straggler",
    "healthy",
    "inconclusive",
]
VERDICTS: tuple[Verdict, ...] = get_args(Verdict)
NODE_VERDICTS: dict[str, Verdict] = {
    "lost": "node_lost",
    "unreachable": "node_unreachable",
    "frozen": "node_frozen",
}
"""A node fault's state (as its launcher declared it) -> the verdict."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class NodeFault:
    """A node its job's launchers declared failed, with every rank it ran."""

    host: str
    state: str
    """``lost`` (its launcher and ranks are gone), ``unreachable`` (nothing there answers: the
    host is down, or the link to it), ``frozen`` (its host answers, its processes do not)."""
    ranks: list[int]
    last_heard: str | None
    """When its launcher was last heard, ``19:51:01.7`` (UTC); None where unknown."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class GroupRef:
    """A process group as every member names it."""

    name: str
    desc: str
    ranks: list[int]
    """Members' global ranks, in group-rank order."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "desc": self.desc, "ranks": list(self.ranks)}


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Straggler:
    rank: int
    mean_lag_ms: float
    """Mean over the compared collectives of how much later than the collective's median arrival
    this rank issued it, on rank 0's clock (each dump's ``clock_offset_ns`` applied)."""
    late_fraction: float = 1.0
    """Share of the compared collectives this rank issued after the median."""
    collectives: int = 0
    """How many collectives were compared."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "mean_lag_ms": round(self.mean_lag_ms, 3),
            "late_fraction": round(self.late_fraction, 3),
            "collectives": self.collectives,
        }


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class UnmatchedP2P:
    """Sends from ``src`` to ``dst`` (global ranks) in ``group`` that the other side never
    matched: ``sends`` posted by ``src`` against ``recvs`` posted by ``dst``."""

    group: str
    src: int
    dst: int
    sends: int
    recvs: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True, slots=True)
class Diagnosis:
    """The analyzer's answer for one event. ``to_json()`` is the ``--json`` output."""

    event: str
    """The event id (the event directory's name)."""
    verdict: Verdict
    culprit_ranks: list[int] = dataclasses.field(default_factory=list)
    """Global ranks to look at first: those that never joined, died, or disagree with the
    majority. Empty when there is no culprit (healthy) or none can be named."""
    process_group: GroupRef | None = None
    collective_seq_id: int | None = None
    """The group's collective sequence number of the operation in question; None for a send or
    receive (p2p has no group sequence number: ``op`` and the evidence name the pair)."""
    op: str | None = None
    """The operation, without the backend prefix: ``all_reduce``, ``_allgather_base``, ``send``."""
    evidence: list[str] = dataclasses.field(default_factory=list)
    """Plain sentences: what was seen that led to the verdict, and the gaps in the input."""
    stragglers: list[Straggler] = dataclasses.field(default_factory=list)
    missing_dumps: list[int] = dataclasses.field(default_factory=list)
    """Global ranks of the job with no usable dump in the event (absent or unreadable)."""
    # --- beyond the keys -------------------------------------------------------------
    culprit_stacks: dict[int, str] = dataclasses.field(default_factory=dict)
    """Culprit rank -> its innermost frame of user code at dump time, ``file:line in func``
    (main thread first; from the dump's thread stacks or a ``stacks_<r>.txt`` file)."""
    culprit_tracebacks: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """Culprit rank -> its whole stack at dump time, innermost first, ``file:line in func``."""
    sizes: dict[str, list[list[int]]] | None = None
    """``{"input": [...], "output": [...]}`` of the operation in question (the majority's, or
    the only rank's; None on a desync tie, where the evidence gives every side's)."""
    dtypes: dict[str, list[str]] | None = None
    """``{"input": [...], "output": [...]}`` likewise."""
    per_rank: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> one line about it for the operation in question (what it issued or where it
    was), for the ranks worth listing (culprits and a sample of the others)."""
    unmatched_p2p: list[UnmatchedP2P] = dataclasses.field(default_factory=list)
    dead_ranks: dict[int, str] = dataclasses.field(default_factory=dict)
    """Ranks an alarm recorded as dead, with how they died."""
    unreadable: dict[str, str] = dataclasses.field(default_factory=dict)
    """File -> why it could not be used."""
    world_size: int | None = None
    ranks_loaded: int = 0
    reason: str | None = None
    """The dump reason (``hang``, ``crash``, ``manual``, ...) when the dumps say it."""
    consequences: dict[int, str] = dataclasses.field(default_factory=dict)
    """Ranks that died or failed because of the fault rather than causing it (a rank the backend
    aborted over a desync, a rank that exited on a dead peer's broken connection), with what
    became of them. Never among ``culprit_ranks``."""
    recovered_ranks: list[int] = dataclasses.field(default_factory=list)
    """Ranks whose record was recovered after their death (and used like a dump)."""
    unresponsive_ranks: dict[int, str] = dataclasses.field(default_factory=dict)
    """Ranks alive but not answering the alarm (no dump; a ``stacks_<r>.txt`` read from outside),
    with their state: ``stopped``, ``disk-sleep``, ``sleeping``, ..."""
    hang_timeout_s: float | None = None
    """The watchdog's hang timeout, as the dumps (or the alarm) record it."""
    regroups: list[str] = dataclasses.field(default_factory=list)
    """An elastic job's membership changes after this event's deaths, in sentences."""
    exceptions: dict[int, str] = dataclasses.field(default_factory=dict)
    """Culprit rank -> the exception it died of, ``ValueError: bad batch`` (its first line);
    its line is the rank's ``culprit_stacks``."""
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> the host it ran on, where the event says it."""
    nodes: list[NodeFault] = dataclasses.field(default_factory=list)
    """The nodes a node fault is about (verdicts ``node_*``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "verdict": self.verdict,
            "culprit_ranks": list(self.culprit_ranks),
            "process_group": None if self.process_group is None else self.process_group.to_json(),
            "collective_seq_id": self.collective_seq_id,
            "op": self.op,
            "evidence": list(self.evidence),
            "stragglers": [s.to_json() for s in self.stragglers],
            "missing_dumps": list(self.missing_dumps),
            "culprit_stacks": {str(r): s for r, s in self.culprit_stacks.items()},
            "culprit_tracebacks": {str(r): t for r, t in self.culprit_tracebacks.items()},
            "sizes": self.sizes,
            "dtypes": self.dtypes,
            "per_rank": {str(r): s for r, s in self.per_rank.items()},
            "unmatched_p2p": [u.to_json() for u in self.unmatched_p2p],
            "dead_ranks": {str(r): how for r, how in self.dead_ranks.items()},
            "unreadable": dict(self.unreadable),
            "world_size": self.world_size,
            "ranks_loaded": self.ranks_loaded,
            "reason": self.reason,
            "consequences": {str(r): s for r, s in self.consequences.items()},
            "recovered_ranks": list(self.recovered_ranks),
            "unresponsive_ranks": {str(r): s for r, s in self.unresponsive_ranks.items()},
            "hang_timeout_s": self.hang_timeout_s,
            "regroups": list(self.regroups),
            "exceptions": {str(r): s for r, s in self.exceptions.items()},
            "hosts": {str(r): h for r, h in self.hosts.items()},
            "nodes": [n.to_json() for n in self.nodes],
        }
