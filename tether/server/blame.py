"""Which rank holds the job back, from every rank's ``/health``."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from tether.job.nodes import span

__all__ = ["Holdup", "group_label", "holding_back"]

Health = Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Holdup:
    rank: int
    reason: str


def holding_back(healths: Mapping[int, Health | None]) -> list[Holdup]:
    """The ranks holding the job back, each with why; ``healths`` maps every global rank to its
    ``/health``, or to None when it did not answer.

    In a group where some members wait in collective #N (the lowest in flight there), a member
    whose last enqueued collective is below N has not joined it: that member holds the others
    back. A rank that does not answer, or is unhealthy with nothing in flight, is a suspect too.
    A suspect that itself waits for another suspect is only held back in turn and is left out, so
    the chain ends at its cause; if every suspect waits for another (a cycle), all are kept.
    Point-to-point operations (``is_p2p``) are not attributed: their sequence number is not one
    their peer shares.
    """
    reasons: dict[int, list[str]] = defaultdict(list)
    waits_for: dict[int, set[int]] = defaultdict(set)
    for rank, health in healths.items():
        if health is None:
            reasons[rank].append("does not answer")
        elif not health.get("healthy", True) and not health.get("in_flight"):
            reasons[rank].append("unhealthy with nothing in flight")

    for name, (label, members) in _groups(healths).items():
        waiting = {
            rank: min(ops, key=lambda op: op["collective_seq_id"])
            for rank in members
            if (ops := [op for op in _in_flight(healths.get(rank)) if op["group"] == name])
        }
        if not waiting:
            continue
        first = min(waiting.values(), key=lambda op: op["collective_seq_id"])
        seq = first["collective_seq_id"]
        age = max(op["age_s"] for op in waiting.values())
        for rank in members:
            health = healths.get(rank)
            if health is not None:
                last = health.get("groups", {}).get(name, {}).get("last_enqueued_collective")
                if last is None or last >= seq:
                    continue
                reasons[rank].append(
                    f"has not joined {first['op']} #{seq} on group {label} (its last is #{last}); "
                    f"{span(waiting)} waited {age:.1f} s for it"
                )
            # A member that does not answer may be the one missing: the waiters wait for it too.
            for waiter in waiting:
                waits_for[waiter].add(rank)

    suspects = set(reasons)
    causes = [r for r in suspects if not (waits_for[r] & suspects) - {r}] or suspects
    return [Holdup(rank, "; ".join(reasons[rank])) for rank in sorted(causes)]


def _in_flight(health: Health | None) -> list[Mapping[str, Any]]:
    """The collectives in flight on a rank."""
    ops = health.get("in_flight", ()) if health is not None else ()
    return [op for op in ops if not op.get("is_p2p")]


def _groups(healths: Mapping[int, Health | None]) -> dict[str, tuple[str, list[int]]]:
    """Every group any rank reports: name -> (label for people, global ranks of its members)."""
    out: dict[str, tuple[str, list[int]]] = {}
    for health in healths.values():
        for name, group in (health or {}).get("groups", {}).items():
            out.setdefault(name, (group_label(name, group.get("desc")), list(group["ranks"])))
    return out


def group_label(name: str, desc: str | None) -> str:
    """A group as people know it: its description ("default_pg", "tp"), else torch's name."""
    return desc if desc and desc != "undefined" else name
