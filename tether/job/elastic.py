"""An elastic job's membership, as its store holds it: who heartbeats, who is a member, who joins.

Written by the launchers (the decisions) and by the workers (heartbeats, joins, commits), read by
both; torch-free but for the store it is handed. Every key lives under ``tether/elastic/``:

    hb/<rank>              a worker's heartbeat counter (``add``)
    epoch                  the number of the latest decision (``add(epoch, 0)`` reads it)
    decision/<e>           Decision e, as JSON; claimed with compare_set, so there is one per e
    join/<rank>/<n>        replacement n of a stable rank is up and waits to be admitted
    healed/<rank>/<n>      replacement n of a stable rank has taken a survivor's state
    commit/<e>/<step>      how many members finished the step's collectives (``add``)
    outcome/<e>/<step>     "commit" or "abort": the first writer (compare_set) decides
    regrouped/<e>          what the survivors report once epoch e's group is connected

Ranks here are *stable* ranks: the global rank a worker was launched as (``RANK``), which it keeps
while the group renumbers its members (the n-th member is group rank n).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

__all__ = [
    "ABORT",
    "COMMIT",
    "PREFIX",
    "Decision",
    "Membership",
    "key",
]

PREFIX = "tether/elastic"
COMMIT = "commit"
ABORT = "abort"


def key(*parts: object) -> str:
    """The store key of ``parts`` under :data:`PREFIX` (``key("hb", 3)``: ``.../hb/3``)."""
    return "/".join([PREFIX, *(str(p) for p in parts)])


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One membership of the job, and what changed to reach it."""

    epoch: int
    members: tuple[int, ...]
    """Stable ranks, in group-rank order."""
    dead: dict[int, str] = dataclasses.field(default_factory=dict)
    """Stable rank -> how it ended ("signal SIGKILL", "no heartbeat for 2.0s")."""
    joined: tuple[int, ...] = ()
    """Members new in this epoch (replacements)."""
    fresh: tuple[int, ...] = ()
    """Members whose state must still be healed from a survivor (joined, not yet healed)."""
    stop: str = ""
    """Non-empty: the job stops (fewer members than its minimum); why."""
    at: float = 0.0
    """When it was decided (the decider's wall clock)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": list(self.members),
                "dead": {str(r): how for r, how in self.dead.items()},
                "joined": list(self.joined),
                "fresh": list(self.fresh),
                "stop": self.stop,
                "at": self.at,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Decision:
        data = json.loads(raw)
        return cls(
            epoch=int(data["epoch"]),
            members=tuple(int(r) for r in data["members"]),
            dead={int(r): str(how) for r, how in data.get("dead", {}).items()},
            joined=tuple(int(r) for r in data.get("joined", [])),
            fresh=tuple(int(r) for r in data.get("fresh", [])),
            stop=str(data.get("stop", "")),
            at=float(data.get("at", 0.0)),
        )

    def healer(self) -> int | None:
        """The member that heals the fresh ones: the lowest-ranked member that is not fresh."""
        return next((r for r in self.members if r not in self.fresh), None)


class Membership:
    """The decisions of one job, through its store (a client of its own: not thread-safe)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def latest_epoch(self) -> int:
        return int(self.store.add(key("epoch"), 0))

    def get(self, epoch: int) -> Decision:
        return Decision.from_json(self.store.get(key("decision", epoch)))

    def latest(self) -> Decision | None:
        epoch = self.latest_epoch()
        return self.get(epoch) if epoch > 0 else None

    def propose(self, decision: Decision) -> Decision:
        """Claim ``decision.epoch``; the decision that holds it (another launcher's may win)."""
        raw = decision.to_json()
        got = self.store.compare_set(key("decision", decision.epoch), "", raw)
        won = Decision.from_json(got)
        if won.epoch == decision.epoch:
            # latest() reads the counter: raise it only to an epoch whose decision is in, and by
            # compare-and-set: two deciders of one epoch both get here, and two adds would skip
            # an epoch that then never comes (latest() would wait on it for ever).
            current = self.latest_epoch()
            while current < won.epoch:
                got = self.store.compare_set(key("epoch"), str(current), str(won.epoch))
                current = int(got)
        return won

    def newer(self, epoch: int) -> Decision | None:
        """The decision after ``epoch`` if it is in the store (one ``check``, never a wait: a
        TCPStore wait that times out logs two warnings)."""
        if not self.store.check([key("decision", epoch + 1)]):
            return None
        return self.get(epoch + 1)

    def beat(self, rank: int) -> None:
        self.store.add(key("hb", rank), 1)

    def beats(self, rank: int) -> int:
        """``rank``'s heartbeat count, 0 before its first (``add`` of 0: a ``get`` of a missing
        key would wait for it)."""
        return int(self.store.add(key("hb", rank), 0))

    def announce_join(self, rank: int, incarnation: int) -> None:
        self.store.set(key("join", rank, incarnation), json.dumps({"at": time.time()}))

    def joined(self, rank: int, incarnation: int) -> bool:
        return bool(self.store.check([key("join", rank, incarnation)]))

    def announce_leave(self, rank: int, incarnation: int) -> None:
        """``rank`` stopped beating on purpose (its process is closing tether): from now on its
        exit, not its silence, says how it ended."""
        self.store.set(key("left", rank, incarnation), json.dumps({"at": time.time()}))

    def left(self, rank: int, incarnation: int) -> bool:
        return bool(self.store.check([key("left", rank, incarnation)]))

    def mark_healed(self, rank: int, incarnation: int, epoch: int) -> None:
        self.store.set(key("healed", rank, incarnation), str(epoch))

    def healed(self, rank: int, incarnation: int) -> bool:
        return bool(self.store.check([key("healed", rank, incarnation)]))

    def report_regrouped(self, epoch: int, info: dict[str, Any]) -> None:
        self.store.set(key("regrouped", epoch), json.dumps(info, sort_keys=True))

    def regrouped(self, epoch: int) -> dict[str, Any] | None:
        if not self.store.check([key("regrouped", epoch)]):
            return None
        data = json.loads(self.store.get(key("regrouped", epoch)))
        return data if isinstance(data, dict) else None
