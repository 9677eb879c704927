"""An elastic job's membership, as its store holds it: who heartbeats, who is a member, who joins.

Written by the launchers (the decisions) and by the workers (heartbeats, joins, healings), read by
both; torch-free but for the store it is handed. Every key lives under ``tether/elastic/``:

    hb/<rank>              a worker's heartbeat counter (``add``)
    epoch                  the number of the latest decision (``add(epoch, 0)`` reads it)
    decision/<e>           Decision e, as JSON; claimed with compare_set, so there is one per e
    incarnation/<rank>     how many replacements of a stable rank were started (``add``): the
                           next one's n, whichever launcher starts it (its own node's, or a
                           launcher that replaces the lost node)
    join/<rank>/<n>        replacement n of a stable rank is up and waits to be admitted
    healed/<rank>/<n>      replacement n of a stable rank has taken a survivor's state
    regrouped/<e>          what the survivors report once epoch e's group is connected
    node/<k>               node k's launcher is present (its host, ranks, lease and where it
                           listens), under that lease (etcd stores only: :class:`NodePresence`)
    evicted/<k>/<lease>    why node k's lease was revoked before it expired (its launcher gone)
    left-node/<k>          node k's launcher left at the job's end: its key's going is no loss

Ranks here are *stable* ranks: the global rank a worker was launched as (``RANK``), which it keeps
while the group renumbers its members (the n-th member is group rank n).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

from tether._log import get_logger
from tether.job.alarm import NEWS_KEY, first_line
from tether.job.nodes import ping_state

__all__ = [
    "NODE_DECLARED_S",
    "PREFIX",
    "Decision",
    "Membership",
    "NodePresence",
    "key",
]

logger = get_logger(__name__)

PREFIX = "tether/elastic"


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
    joined_on: str = ""
    """The host the joined members run on (their launcher's)."""
    fresh: tuple[int, ...] = ()
    """Members whose state must still be healed from a survivor (joined, not yet healed)."""
    stop: str = ""
    """Non-empty: the job stops (fewer members than its minimum); why."""
    at: float = 0.0
    """When it was decided (the decider's wall clock)."""

    def to_json(self) -> str:
        return json.dumps(self.to_data(), sort_keys=True)

    def to_data(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "members": list(self.members),
            "dead": {str(r): how for r, how in self.dead.items()},
            "joined": list(self.joined),
            "joined_on": self.joined_on,
            "fresh": list(self.fresh),
            "stop": self.stop,
            "at": self.at,
        }

    @classmethod
    def from_json(cls, raw: bytes | str) -> Decision:
        return cls.from_data(json.loads(raw))

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Decision:
        return cls(
            epoch=int(data["epoch"]),
            members=tuple(int(r) for r in data["members"]),
            dead={int(r): str(how) for r, how in data.get("dead", {}).items()},
            joined=tuple(int(r) for r in data.get("joined", [])),
            joined_on=str(data.get("joined_on", "")),
            fresh=tuple(int(r) for r in data.get("fresh", [])),
            stop=str(data.get("stop", "")),
            at=float(data.get("at", 0.0)),
        )


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
        if won == decision:  # ours: the agents' next look reads it
            self.store.add(NEWS_KEY, 1)
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

    def incarnation(self, rank: int) -> int:
        """The number of ``rank``'s latest replacement (0: none was started)."""
        return int(self.store.add(key("incarnation", rank), 0))

    def next_incarnation(self, rank: int) -> int:
        """The number of ``rank``'s next replacement (1, 2, ...), drawn once."""
        return int(self.store.add(key("incarnation", rank), 1))

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

    def report_regrouped(self, epoch: int, info: dict[str, Any], *, healers: int = 1) -> None:
        """A healer's report of the regroup of ``epoch``. Where ``healers`` healed (HSDP: one
        per shard), the last to report writes it, with the bytes they all moved: each adds its
        own before it counts itself in, so the last counted reads every one's."""
        if healers > 1:
            self.store.add(key("regrouped", epoch, "heal_bytes"), int(info["heal_bytes"]))
            if self.store.add(key("regrouped", epoch, "healers"), 1) < healers:
                return
            total = self.store.add(key("regrouped", epoch, "heal_bytes"), 0)
            info = {**info, "heal_bytes": total, "healers": healers}
        self.store.set(key("regrouped", epoch), json.dumps(info, sort_keys=True))

    def regrouped(self, epoch: int) -> dict[str, Any] | None:
        if not self.store.check([key("regrouped", epoch)]):
            return None
        data = json.loads(self.store.get(key("regrouped", epoch)))
        return data if isinstance(data, dict) else None


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """A node of the job as its launcher announced it."""

    index: int
    host: str
    ranks: tuple[int, ...]
    """Its workers' stable ranks."""
    address: str = ""
    port: int = 0
    """Where its launcher listens (0: nowhere known)."""
    token: str = ""
    """What a request to that port carries (its event port's)."""
    lease: int = 0


NODE_LEASE_S = 2
"""A node's lease (etcd counts whole seconds). One second expired healthy nodes' leases on 2
loaded cores (three etcd members, three launchers and six workers): a renewal waited that long."""
CUT_OFF_LEASES = 3
"""How many TTLs a launcher's renewals may all fail before it takes itself for cut off. Not one:
while etcd elects a new leader (its node lost) no member renews anything, and the new leader
extends every lease; that took over 2 s here."""


WATCH_S = 0.1
"""How often a launcher looks whether the next node's launcher still listens: one connection
(about 0.1 ms on a LAN), to one node whatever the job's size."""

UNREACHABLE_S = 0.6
"""How long every connection to the next node's launcher may go unanswered (each given
``2 * WATCH_S``: at least two in a row) before its lease is revoked: its host is down or its link
cut. A host that is up answers a connection from its kernel within milliseconds, even while its
processes are stopped or starved of CPU (under 5 ms here with both cores busy), so this does not
wait for the 2 s lease; without a quorum the revocation fails, so a node cut off evicts nobody."""

FROZEN_S = 0.8
"""How long the next node's launcher may leave every ping unanswered, while its host takes the
connections and none of its workers' heartbeats moves, before its lease is revoked: the node is
frozen (its processes stopped). A launcher answers in a millisecond, but a loaded one took 0.8 s
while every rank dumped: its workers' heartbeats in etcd (the node's workers take turns, one beat
every 0.25 s for the node: three missed) are what tells a slow launcher from a stopped node, and
a node none of whose workers has beaten yet (starting) is left to its lease."""


NODE_DECLARED_S = float((CUT_OFF_LEASES + 1) * NODE_LEASE_S)
"""The longest a lost node takes to be declared: its lease, which a new etcd leader restarts (the
lost node may have held the leader), elected within the cut-off (the others take themselves for
cut off past it)."""


_EXPIRED = "this node's lease expired: the job declared it lost"


class NodePresence:
    """Each node's launcher is present while an etcd lease lives: ``node/<k>`` holds its host and
    ranks under a lease of ``ttl_s`` that a thread of its own renews eight times a TTL. A node
    whose key is gone was lost whole: etcd itself times its lease out (its host down, its link
    cut, or frozen). A node lost is found sooner: each launcher pings the next node's every
    :data:`WATCH_S`, and revokes its lease when nothing listens there any more (its launcher
    gone, its host up), when nothing answers the connections (its host down, or its link), or
    when its host takes them but the node is stopped (:data:`FROZEN_S`). A launcher told that
    its lease expired, or whose renewals have all failed for :data:`CUT_OFF_LEASES` TTLs, is the
    one cut off (:attr:`cut_off` says why) and ends its workers. Until then they can do no harm:
    without a quorum they cannot commit a step."""

    def __init__(self, kv: Any, node: Node, *, ttl_s: int = NODE_LEASE_S) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self.lease = kv.grant(ttl_s)
        self.node = node = dataclasses.replace(node, lease=self.lease)
        value = json.dumps(
            {
                "host": node.host,
                "ranks": list(node.ranks),
                "address": node.address,
                "port": node.port,
                "token": node.token,
                "lease": node.lease,
            }
        ).encode()
        kv.put(key("node", node.index), value, lease=self.lease)
        self.cut_off = ""
        self._seen: dict[int, Node] = {}
        """The nodes present at the last :meth:`present`."""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="tether-node-lease", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(
            target=self._watch_next, name="tether-node-watch", daemon=True
        )
        self._watch.start()

    def present(self) -> dict[int, Node]:
        """The nodes whose launcher is present now (one read)."""
        nodes = {}
        for name, raw in self.kv.items(key("node", "")).items():
            data = json.loads(raw)
            index = int(name.rsplit("/", 1)[1])
            nodes[index] = Node(
                index,
                str(data["host"]),
                tuple(int(r) for r in data["ranks"]),
                str(data.get("address", "")),
                int(data.get("port", 0)),
                str(data.get("token", "")),
                int(data.get("lease", 0)),
            )
        self._seen = nodes
        return nodes

    def _watch_next(self) -> None:
        """Revoke the lease of the next node present (by index, round the ring) once nothing
        listens where its launcher did, nothing has answered the connections there for
        :data:`UNREACHABLE_S`, or its launcher has answered no ping for :data:`FROZEN_S`: its
        lease would expire anyway, later."""
        evicted: set[int] = set()
        unanswered: dict[int, float] = {}  # lease -> when its launcher stopped answering
        beating: dict[int, dict[str, bytes]] = {}  # lease -> its workers' heartbeats meanwhile
        while not self._closing.wait(WATCH_S):
            me = self.node.index
            others = sorted(k for k in self._seen if k != me)
            if not others:
                continue
            peer = self._seen[next((k for k in others if k > me), others[0])]
            if not peer.port or not peer.lease or peer.lease in evicted:
                continue
            asked = time.monotonic()
            state = ping_state(peer.address, peer.port, peer.token, WATCH_S * 2)
            if state == "alive":
                unanswered.pop(peer.lease, None)
                beating.pop(peer.lease, None)
                continue
            where = f"{peer.address}:{peer.port}"
            silent = time.monotonic() - unanswered.setdefault(peer.lease, asked)
            if state == "unreachable":
                if silent < UNREACHABLE_S:
                    continue
                why = (
                    f"unreachable: its host down or its link cut ({self.node.host} had no "
                    f"answer from {where} for {silent:.1f}s)"
                )
            elif state == "frozen":
                beats = self._beats(peer)
                if not beats:  # unknown (None), or none yet: the lease decides
                    continue
                if beating.get(peer.lease) != beats:  # first seen, or moved: silent from this ping
                    beating[peer.lease] = beats
                    unanswered[peer.lease] = asked
                    continue
                if silent < FROZEN_S:
                    continue
                why = (
                    f"frozen: its host takes connections, but neither its launcher nor its "
                    f"workers have answered for {silent:.1f}s ({self.node.host} pinged {where})"
                )
            else:
                why = f"its launcher is gone ({self.node.host} found nothing listening at {where})"
            try:
                self.kv.put(key("evicted", peer.index, peer.lease), why.encode())
                self.kv.revoke(peer.lease)
            except Exception as exc:  # no quorum now: the next look tries again, or it expires
                logger.debug("could not revoke %s's lease: %s", peer.host, exc)
                continue
            evicted.add(peer.lease)
            logger.info("%s (node %d): %s; its lease revoked", peer.host, peer.index, why)

    def _beats(self, node: Node) -> dict[str, bytes] | None:
        """The heartbeat counters of ``node``'s workers now (one read; None: the store did not
        answer)."""
        try:
            beats = self.kv.items(key("hb", ""))
        except Exception as exc:  # no quorum now: nothing can be revoked either
            logger.debug("could not read %s's heartbeats: %s", node.host, exc)
            return None
        ranks = {key("hb", rank) for rank in node.ranks}
        return {name: count for name, count in beats.items() if name in ranks}

    def why_lost(self, node: Node) -> str:
        """Why ``node``'s key went: its eviction's reason, or its lease's expiry."""
        try:
            raw = self.kv.get(key("evicted", node.index, node.lease)) if node.lease else None
        except Exception as exc:  # the verdict stands; only its reason is unknown
            logger.debug("could not read why %s was evicted: %s", node.host, exc)
            raw = None
        return raw.decode() if raw else "its lease expired"

    def _renew(self) -> None:
        period = self.ttl_s / 8
        renewed = time.monotonic()  # when the last renewal that succeeded was sent
        failing: float | None = None  # since when every renewal has failed
        while not self._closing.wait(period):
            sent = time.monotonic()
            try:
                alive = self._renew_once()
            except Exception as exc:  # no member with a quorum answers: maybe only for now
                if failing is None:
                    failing = sent
                    logger.warning("could not renew this node's lease: %s", first_line(exc))
                if time.monotonic() - renewed >= CUT_OFF_LEASES * self.ttl_s:
                    self.cut_off = (
                        f"no member of the job's etcd store with a quorum has renewed this "
                        f"node's lease for {CUT_OFF_LEASES * self.ttl_s}s ({exc})"
                    )
                    return
                continue
            if self.cut_off:  # the others have declared this node lost
                return
            if failing is not None:
                logger.warning(
                    "this node's lease renewed again after %.1fs of failures (%.1fs since the "
                    "last renewal)%s",
                    sent - failing,
                    sent - renewed,
                    "" if alive else "; a member said it expired, the quorum still holds its key",
                )
                failing = None
            renewed = sent

    def expired(self) -> bool:
        """Whether this node is cut off, its lease asked now: for a launcher that was itself
        stopped (its node frozen, then thawed) before it acts on what it sees, as the renewing
        thread, stopped too, may not have asked yet. A failed call is no answer: the renewals
        decide."""
        if not self.cut_off:
            try:
                self._renew_once()
            except Exception as exc:
                logger.debug("could not renew the node's lease: %s", exc)
        return bool(self.cut_off)

    def _renew_once(self) -> bool:
        """Renew the lease; whether the member asked still had it. :attr:`cut_off` is set when
        the quorum has dropped this node's key. Raises when no member with a quorum answers."""
        alive = bool(self.kv.keep_alive(self.lease, timeout=self.ttl_s / 2))
        if not alive and self._key_gone():
            self.cut_off = _EXPIRED
        return alive

    def _key_gone(self) -> bool:
        """Whether this node's key is gone, read through the quorum. A renewal's "expired" is
        one member's word: a member that was stopped (its node frozen) and runs again answers
        from its own lease table, in which every lease ran out while it was stopped, until it
        hears of the leader elected meanwhile; the quorum's own read cannot be stale."""
        try:
            return self.kv.get(key("node", self.node.index)) is None
        except Exception as exc:  # no quorum answers: no verdict, the renewals go on
            logger.debug("could not read this node's key: %s", exc)
            return False

    def left(self) -> set[int]:
        """The nodes whose launcher left at the job's end (one read)."""
        return {int(name.rsplit("/", 1)[1]) for name in self.kv.items(key("left-node", ""))}

    def close(self, *, leaving: bool) -> None:
        """Stop renewing; ``leaving``: the job ends here, and the others are told first that this
        node's going is no loss."""
        self._closing.set()
        self._thread.join(timeout=2.0)
        self._watch.join(timeout=2.0)
        try:
            if leaving:
                self.kv.put(key("left-node", self.node.index), b"1")
            self.kv.revoke(self.lease)
        except Exception as exc:  # it expires by itself within its TTL
            logger.debug("could not revoke the node's lease: %s", exc)
