"""What one verdict module concludes, as a value: :class:`Finding` (the verdict it would give,
its culprits, its sentences and per-rank lines) and :class:`Where` (the operation in question).

The verdict modules (:mod:`~tether.analyze.nodes`, :mod:`~tether.analyze.crash`,
:mod:`~tether.analyze.desync`, :mod:`~tether.analyze.hang`) each return a finding or None and
never touch a :class:`~tether.analyze.diagnosis.Diagnosis`: :mod:`~tether.analyze.engine` alone
decides which finding wins and builds the diagnosis from it once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tether.analyze.diagnosis import GroupRef, NodeFault, Straggler, Verdict

__all__ = ["Finding", "Where"]


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Where:
    """The operation a verdict is about (the diagnosis' fields of the same names)."""

    process_group: GroupRef | None = None
    collective_seq_id: int | None = None
    op: str | None = None
    sizes: dict[str, list[list[int]]] | None = None
    dtypes: dict[str, list[str]] | None = None


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Finding:
    """What one verdict module found. The mappings are read in insertion order (the JSON's)."""

    verdict: Verdict
    culprits: tuple[int, ...] = ()
    where: Where | None = None
    evidence: tuple[str, ...] = ()
    """Sentences, in the order the report gives them (before the event's own notes)."""
    per_rank: Mapping[int, str] = dataclasses.field(default_factory=dict)
    consequences: Mapping[int, str] = dataclasses.field(default_factory=dict)
    exceptions: Mapping[int, str] = dataclasses.field(default_factory=dict)
    nodes: tuple[NodeFault, ...] = ()
    stragglers: tuple[Straggler, ...] = ()
    """The stragglers of a ``straggler`` verdict (the engine adds context to the others)."""
    unheard: tuple[int, ...] = ()
    """Culprits of a hang that left nothing at all (no dump, no stacks, no unreadable file)
    while others wait for them: dead, or never answered. The engine makes such a hang a crash."""
