"""This worker's side of an elastic job: its heartbeat, the decisions it hears, its world group.

The launchers decide who is a member (:mod:`tether.launcher.elastic`); each worker

- heartbeats to its node's agent (``tether run``'s launcher) over the agent's relay, on a
  thread of its own, and in the same loop hears each decision the agent passes on (and the
  store's loss, which the agent's look sees first), so it hears one within its period, 0.1 s,
  of its agent; the job's store sees none of it. On etcd a node's workers also take turns to
  beat there, one beat every :data:`NODE_BEAT_S` for the whole node: what tells a frozen node
  from a launcher slow to answer a ping (:class:`~tether.job.elastic.NodePresence`). Without an
  agent to reach, it beats through the store and looks for the next decision there, with a
  ``check`` (a store wait that times out logs warnings). An agent that is gone ends the job for
  this worker as the store's loss does;
- on a decision that removes a member of its current group, shuts that group's connections
  down at once (:mod:`tether.elastic.sockets`), which fails any collective still waiting on the
  dead rank (the step's commit vote among them), here and on every survivor; and where one of
  this worker's still waits :data:`STUCK_S` later, its training thread blocked in it, leaves
  the job rather than hold the others' regroup until gloo's timeout (as after the job's store's
  loss, which a blocked training thread would otherwise never hear of);
- regroups when its training loop asks (:meth:`World.regroup`): connects a new gloo communicator
  among the decision's members through the store (under the decision's epoch), abandons it if
  a newer decision arrives meanwhile (a member died during the regroup), and swaps it into the
  world group, which keeps its identity (DDP and the user hold it) and is recorded throughout;
  the groups added with :meth:`World.add_subgroup` (an HSDP mesh's) are connected anew with it,
  each among the members its rule names.

A replacement worker's world group is created without connecting (gloo's lazy init); it becomes
a member when a decision admits it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

from tether._exceptions import (
    AgentGoneError,
    RankFailedError,
    StoreUnreachableError,
    WorldTooSmallError,
)
from tether._log import get_logger
from tether.elastic.sockets import Connections, snapshot
from tether.job.alarm import HANG_EXIT_CODE
from tether.job.client import StoreAddress
from tether.job.elastic import NODE_DECLARED_S, Decision, Membership, key
from tether.job.relay import MemberLink

if TYPE_CHECKING:
    from tether.recorder.ring import Entry

__all__ = ["World"]

logger = get_logger(__name__)

CLIENT_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT = timedelta(minutes=30)
"""A new communicator's timeout where the world group's is unknown (gloo's default). It bounds
the wait for its members too; a regroup gives up on that wait sooner, at the next decision (a
member that died meanwhile never connects)."""

NODE_BEAT_S = 0.25
"""On etcd, how often a node beats there, its workers taking turns (4 writes a second a node):
a node whose launcher leaves a ping unanswered is frozen once none of its workers' beats moved
for :data:`~tether.job.elastic.FROZEN_S`, 0.8 s, three turns (one worker dead leaves a gap of
two)."""

ABANDONED_JOIN_S = 2.0
"""How long a leaving worker waits for the connects it left to a superseded decision: an etcd
client's wait ends within its watch slice (1 s) once closed; a TCPStore's cannot be ended."""

STUCK_S = 10.0
"""How long an operation issued before a decision that broke its group may still wait after the
group's connections were shut, the training thread blocked in it all along, before this worker
gives up on it. Shut connections end a collective at once (1.00 s after a shutdown delayed 1 s,
:mod:`tether.elastic.sockets`), but not every one: gloo's tcp transport queues a send whose
write failed with EPIPE or ECONNRESET (no error for it in async mode), and a broken connection
signals the buffers of the sends it holds queued only where they are bound, so a collective's
send to a peer that asked for the data and then shut its end (a survivor hearing the decision)
waits out gloo's timeout (30 min by default) while the others wait for this worker in their
regroup (three times in roughly a hundred node losses here). It leaves the job instead
(:data:`~tether.job.alarm.HANG_EXIT_CODE`): its launcher declares it dead, the others regroup
without it, and a replacement takes its place where the job has one."""


@dataclasses.dataclass
class _Broken:
    """What broke the connected group (a decision, or the job's store's loss), and where the
    training thread has waited since it was heard."""

    cause: str
    """``decision 3``, ``the job's store's loss``."""
    heard_ns: int
    """When (wall clock, ns: the recorder's operations are timed so)."""
    where: tuple[int, Any, int] | None = None
    """The training thread's innermost frame when last looked at (id, code, instruction)."""
    since: float = 0.0
    """Since when it has been there (monotonic)."""


@dataclasses.dataclass(frozen=True)
class _Subgroup:
    """A group regrouped with the world group: connected anew at every regroup among
    ``members(decision)`` (global ranks, in group-rank order)."""

    name: str
    pg: Any
    members: Callable[[Decision], list[int]]


class World:
    """One worker's membership of an elastic job (created by the runtime once the default
    group exists)."""

    def __init__(
        self,
        *,
        store: Any,
        address: StoreAddress,
        stable_rank: int,
        world_size: int,
        heartbeat_timeout: float,
        replacement: int,
        sockets_before: dict[int, str],
        per_node: int = 0,
        in_flight: Callable[[], list[Entry]] = list,
        relay: str = "",
    ) -> None:
        """``in_flight``: the operations this process's recorder has in flight (what a training
        thread blocked after a decision waits on is among them); ``relay``: the name of its
        node's agent's relay (empty: none, it beats through the store)."""
        self.relay = relay
        self.stable_rank = stable_rank
        self.launched_size = world_size
        self.per_node = per_node
        """Workers per node (torchrun's ``LOCAL_WORLD_SIZE``; 0: unknown). torchrun numbers
        ranks node by node: rank r runs on node ``r // per_node``."""
        self.replacement = replacement
        self.heartbeat_timeout = heartbeat_timeout
        self.decision_wait_s = heartbeat_timeout + 3.0 + (NODE_DECLARED_S if address.etcd else 0)
        """How long a broken collective waits for the decision behind it: the launcher sees an
        exit within its 0.1 s poll, a silent rank within the heartbeat timeout, and (the store
        on etcd) a lost node within :data:`~tether.job.elastic.NODE_DECLARED_S`."""
        self.store_lost_s = heartbeat_timeout + (NODE_DECLARED_S if address.etcd else 0)
        """How long the job's store may answer nothing before this worker takes it for gone: a
        TCPStore's silence is its host's end; etcd answers nothing while it elects a leader (its
        node lost: 1-4 s here), which the launchers wait out as long."""
        self.address = address
        self.store = store
        """The job's store, as the default group's client (used from the main thread only: the
        heartbeat thread and each connect have clients of their own)."""
        self.membership = Membership(self.store)
        launched = Decision(0, tuple(range(world_size)))
        # A replacement is no member until a decision admits it.
        self.decision = Decision(-1, ()) if replacement else launched
        """The decision this worker's world group is connected for."""
        self._newest = self.membership.latest() or launched
        self._lock = threading.Lock()
        self._heard = threading.Condition(self._lock)
        self._lost: BaseException | None = None
        self._connections = Connections(sockets_before, snapshot(), address.ports)
        self._in_flight = in_flight
        self._trainer = threading.get_ident()
        """The thread that formed the default group: the training loop's."""
        self._connected_ns = 0
        """When the world group was connected for :attr:`decision` (wall clock, ns; 0: at
        launch)."""
        self._broken: _Broken | None = None
        """The decision that broke the connected group, while the training thread has not
        regrouped since."""
        self._abandoned: list[threading.Thread] = []
        """Connects left to a superseded decision (:meth:`_abandon`)."""
        self._group_clients: dict[str, Any] = {}
        """Each regrouped group's store client, by the group's name, kept alive: a
        store written in Python (etcd's) answers torch's C++ only while its Python object lives,
        and torch's PrefixStore does not keep it."""
        self._subgroups: list[_Subgroup] = []
        self._subgroups_at = -1
        """The decision the subgroups are connected for (-1: not yet; they connect together)."""
        self.mesh: Any = None
        """The HSDP mesh of :func:`tether.elastic.hsdp_mesh`, once made: a healed shard is
        rebuilt on it."""
        self.shard_of: Callable[[int], int] = lambda rank: 0
        """Which part of the state a member holds: members of one part are each other's
        replicas (one part: every member holds all; HSDP: a node's k-th rank holds shard k)."""
        # 10 looks a second (two store calls each): a decision is heard within 0.1 s.
        self._heartbeat = _Heartbeat(self, period=min(0.1, heartbeat_timeout / 10))
        self._heartbeat.start()

    @property
    def heartbeat_to(self) -> str:
        """Where this worker beats and hears the decisions: ``agent`` (its node's, over the
        relay) or ``store`` (the job's: no agent reached)."""
        return "agent" if self._heartbeat.link is not None else "store"

    # -- what the heartbeat thread hears --------------------------------------------------------
    def newest(self) -> Decision:
        """The newest decision heard (at least the one the group is connected for)."""
        with self._lock:
            self._check_store()
            return self._newest

    def wait_newer(self, epoch: int, timeout_s: float) -> Decision | None:
        """A decision newer than ``epoch`` once heard, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._heard:
            while self._newest.epoch <= epoch and self._lost is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._heard.wait(left)
            self._check_store()
            return self._newest

    def catch_up(self, epoch: int) -> None:
        """Hear every decision up to ``epoch`` now (from the store), not at the next beat."""
        while self.newest().epoch < epoch:
            self._hear(self.membership.get(self.newest().epoch + 1))

    def _hear(self, decision: Decision) -> None:
        """Take ``decision`` in."""
        with self._heard:
            if decision.epoch <= self._newest.epoch:
                return
            self._newest = decision
            current = self.decision
            broken = decision.stop or any(r in current.members for r in decision.dead)
            if broken or self.stable_rank not in decision.members:
                closed = self._connections.shutdown()
                if self._broken is None and self.stable_rank in current.members:
                    self._broken = _Broken(f"decision {decision.epoch}", time.time_ns())
                logger.info(
                    "decision %d: ranks %s dead; %d connection(s) of epoch %d shut down",
                    decision.epoch,
                    sorted(decision.dead),
                    closed,
                    current.epoch,
                )
            self._heard.notify_all()

    def give_up_if_stuck(self) -> None:
        """Leave the job (the process exits) if the training thread has been blocked for
        :data:`STUCK_S` in an operation that what broke its group (a decision, or the job's
        store's loss) should have ended: issued on this group before it, still in flight, the
        thread's innermost frame the same all along (a thread that moves is not stuck) and
        outside this module (which waits for decisions and regroups: what an operation that
        failed leads to). An operation issued before the last regroup never counts: one a failed
        attempt left unwaited may never say it ended."""
        broken = self._broken
        if broken is None:
            return
        frame = sys._current_frames().get(self._trainer)
        if frame is None or _here(frame):  # it ended, or waits on a decision or a regroup
            return
        where = (id(frame), frame.f_code, frame.f_lasti)
        if where != broken.where:  # it moved: the wait starts again
            broken.where, broken.since = where, time.monotonic()
            return
        waited = time.monotonic() - broken.since
        if waited < STUCK_S or self._broken is not broken:
            return
        try:
            entry = next(
                (
                    e
                    for e in self._in_flight()
                    if self._connected_ns <= e.time_created_ns < broken.heard_ns
                ),
                None,
            )
        except Exception as exc:  # the recorder's bug: it must not end the heartbeat
            logger.debug("could not read the operations in flight: %s", exc)
            return
        if entry is None:
            return
        group = entry.group
        logger.error(
            "%s #%d on group %s (%s) still waits %.1fs after %s shut its connections (issued "
            "before it): nothing but gloo's timeout would end it, and the job cannot go on "
            "without this rank. This rank leaves the job; its threads:",
            entry.profiling_name,
            entry.collective_seq_id,
            group.name,
            group.desc,
            waited,
            broken.cause,
        )
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(HANG_EXIT_CODE)

    def _lose(self, exc: BaseException) -> None:
        """The job's store is gone: the training thread raises at its next call into the world;
        one blocked in an operation is looked at as after a decision."""
        with self._heard:
            self._lost = exc
            self._connections.shutdown()
            if self._broken is None:
                self._broken = _Broken("the job's store's loss", time.time_ns())
            self._heard.notify_all()

    def _check_store(self) -> None:
        if isinstance(self._lost, AgentGoneError):
            raise AgentGoneError(
                f"this node's tether run is gone ({self._lost}): nothing watches this worker's "
                "heartbeat or tells it the job's decisions any more, and the job cannot go on "
                "with it"
            ) from self._lost
        if self._lost is not None:
            where = "" if self.address.etcd else ", hosted by the launcher of node 0"
            raise StoreUnreachableError(
                f"the job's store ({self.address}{where}) does not answer any more: "
                f"the job cannot go on ({self._lost})"
            ) from self._lost

    # -- regrouping -----------------------------------------------------------------------------
    def failure(self, decision: Decision) -> RankFailedError:
        """The error that says what ``decision`` did to this worker's group."""
        dead = sorted(decision.dead)
        if decision.stop:
            return WorldTooSmallError(
                f"the elastic job stops: {decision.stop} (ranks {dead} died; epoch "
                f"{decision.epoch})",
                dead_ranks=dead,
                epoch=decision.epoch,
            )
        if self.stable_rank not in decision.members:
            return RankFailedError(
                f"this rank ({self.stable_rank}) was declared dead in epoch {decision.epoch}",
                dead_ranks=[self.stable_rank],
                epoch=decision.epoch,
            )
        return RankFailedError(
            f"rank(s) {dead} died; epoch {decision.epoch} goes on with ranks "
            f"{list(decision.members)}",
            dead_ranks=dead,
            epoch=decision.epoch,
        )

    def add_subgroup(self, name: str, pg: Any, members: Callable[[Decision], list[int]]) -> None:
        """Regroup ``pg`` (a recorded gloo group of one member so far) with the world group from
        now on, among ``members(decision)``; it is connected at the next :meth:`regroup`, which
        the training loop's first step boundary makes (:attr:`unconnected`)."""
        self._subgroups.append(_Subgroup(name, pg, members))
        self._subgroups_at = -1

    @property
    def unconnected(self) -> bool:
        """Whether the groups added by :meth:`add_subgroup` wait for their first connect."""
        return bool(self._subgroups) and self._subgroups_at != self.decision.epoch

    def regroup(self, pg: Any) -> Decision:
        """Connect ``pg`` (the world group) and the added subgroups for the newest decision, and
        again while newer ones arrive during the connect; the decision it ends up connected for.
        Raises the decision's :class:`RankFailedError` where this worker cannot go on (dead, or
        the job stops)."""
        from tether.recorder.reconfigure import group_timeout

        while True:
            target = self.newest()
            if target.stop or self.stable_rank not in target.members:
                raise self.failure(target)
            moves = target.epoch != self.decision.epoch
            subgroups = self._subgroups if self._subgroups_at != target.epoch else []
            if not moves and not subgroups:
                return target
            plan = [("", pg, list(target.members))] if moves else []
            plan += [(sub.name, sub.pg, sub.members(target)) for sub in subgroups]
            made = []
            for name, group, members in plan:
                connected = self._connect(
                    target, group_timeout(pg) or DEFAULT_TIMEOUT, name=name, members=members
                )
                if connected is None:
                    break  # a newer decision came first: connect for it
                made.append((group, members, connected))
            else:
                self._swap_in(target, made, moves=moves)
                return target

    def _swap_in(self, target: Decision, made: list[Any], *, moves: bool) -> None:
        """Have each group of ``made`` (group, members, what :meth:`_connect` made) forward to
        its new communicator; the world group among them where this worker ``moves`` to
        ``target``, whose connections then replace (and shut down) those of the decision
        before. The subgroups are connected for ``target`` from now on."""
        from tether.recorder.reconfigure import swap_backend

        connections = Connections({}, {}, set())
        for group, members, (gloo, store, made_connections, client) in made:
            self._group_clients[group.group_name] = client
            swap_backend(
                group,
                gloo,
                store=store,
                rank=members.index(self.stable_rank),
                size=len(members),
                uuid=target.epoch,
                members=members,
            )
            connections.sockets.update(made_connections.sockets)
        self._subgroups_at = target.epoch
        with self._lock:
            old = self._connections
            if not moves:  # the subgroups' first connect: beside the world group's
                old.sockets.update(connections.sockets)
                return
            self._connections = connections
            self._connected_ns = time.time_ns()
            self._broken = None
            self.decision = target
        old.shutdown()  # already broken where a member died; released either way

    def _connect(
        self, target: Decision, timeout: timedelta, *, name: str, members: list[int]
    ) -> tuple[Any, Any, Connections, Any] | None:
        """A gloo communicator among ``members`` for ``target`` (the world group's, or the
        subgroup ``name``'s), or None once a newer decision is heard first (the connecting
        thread is left to its timeout); with its store, connections and store client."""
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

        rank = members.index(self.stable_rank)
        client = _client(self.address)
        store = PrefixStore(key("group", target.epoch, *([name] if name else [])), client)
        result: list[Any] = []

        def build() -> None:
            try:
                before = snapshot()
                gloo = ProcessGroupGloo(PrefixStore("gloo", store), rank, len(members), timeout)
                result.append((gloo, Connections(before, snapshot(), self.address.ports)))
            except Exception as exc:  # a member died before connecting; its decision follows
                result.append(exc)
            with self._heard:
                self._heard.notify_all()

        thread = threading.Thread(
            target=build, name=f"tether-elastic-connect-{target.epoch}{name}", daemon=True
        )
        thread.start()
        with self._heard:
            while not result and self._newest.epoch == target.epoch and self._lost is None:
                self._heard.wait(1.0)
        self._check_store()
        if not result:
            logger.info("epoch %d superseded while connecting", target.epoch)
            self._abandon(thread, client)
            return None
        outcome = result[0]
        if isinstance(outcome, Exception):
            newer = self.wait_newer(target.epoch, self.decision_wait_s)
            if newer is None:
                raise outcome
            return None
        gloo, connections = outcome
        return gloo, store, connections, client

    def _abandon(self, thread: threading.Thread, client: Any) -> None:
        """Leave ``thread`` connecting through ``client`` for a superseded decision, ending its
        wait where the client can (etcd's): a member that never came leaves it waiting for its
        address up to the client's timeout (30 s), and a thread still inside torch's C++ when
        the interpreter exits is aborted there (SIGABRT: "terminate called without an active
        exception"), after the job's last step."""
        close = getattr(client, "close", None)
        if close is not None:
            close()
        self._abandoned.append(thread)

    def close(self, *, leaving: bool = True) -> None:
        """Stop beating and, when this rank is ``leaving`` the job (its process exits), say so:
        the rest of the exit (closing tether, the interpreter's own) took over 1.5 s on 2 loaded
        cores, which the launcher would otherwise read as a hang; then give each connect left
        to a superseded decision :data:`ABANDONED_JOIN_S` to end."""
        self._heartbeat.close()
        if not leaving:
            return
        # A store found gone is not called again: torch 2.15's client retries a dead store's
        # connection with backoff (30 s and more), which kept the process alive.
        if self._lost is None:
            try:
                self.membership.announce_leave(self.stable_rank, self.replacement)
            except Exception as exc:  # the store is gone: so is the launcher that would watch
                logger.debug("could not announce leaving the job: %s", exc)
        deadline = time.monotonic() + ABANDONED_JOIN_S
        for thread in self._abandoned:
            thread.join(max(0.0, deadline - time.monotonic()))


def _here(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers runs this module's code."""
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return True
        frame = frame.f_back
    return False


def _client(address: StoreAddress) -> Any:
    """A store client of a thread's own. Its calls wait up to 30 s: on 2 loaded cores a
    connect took over 5 s (the default of :func:`tether.job.client.connect`) while four workers
    started at once."""
    return address.connect(timeout=CLIENT_TIMEOUT_S)


class _Heartbeat(threading.Thread):
    """Beats every ``period`` and hears each decision as it is made: through the node's agent
    once it reaches it, through the job's store until then (or where there is no agent)."""

    def __init__(self, world: World, *, period: float) -> None:
        super().__init__(name="tether-elastic-heartbeat", daemon=True)
        self.world, self.period = world, period
        self._closing = threading.Event()
        self._membership: Membership | None = None
        """This thread's own client of the job's store (made when first needed)."""
        self.link: MemberLink | None = None
        """The connection to the node's agent, once made."""
        self._turn = -1
        """The last turn this worker beat in etcd for its node (:meth:`_node_beat`)."""

    def run(self) -> None:
        world = self.world
        failing_since: float | None = None
        gone: tuple[float, AgentGoneError] | None = None
        while not self._closing.wait(self.period):
            if gone is not None:
                # The agent closes its relay as it ends the workers, which then exit at once;
                # a worker still here after the time a silent rank is given was left behind.
                if world._lost is None and time.monotonic() - gone[0] > world.heartbeat_timeout:
                    logger.error("%s", gone[1])
                    world._lose(gone[1])
            elif world._lost is None:  # once lost, nothing to beat to: only the thread to watch
                try:
                    if not self._beat_to_agent():
                        self._beat_to_store()
                    failing_since = None
                except AgentGoneError as exc:
                    gone = (time.monotonic(), exc)
                except StoreUnreachableError as exc:  # the agent's word: its look failed
                    logger.error("the job's store does not answer: %s", exc)
                    world._lose(exc)
                except Exception as exc:
                    self._membership = None
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > world.store_lost_s:
                        logger.error("the job's store does not answer: %s", exc)
                        world._lose(exc)
            world.give_up_if_stuck()  # a look at this process alone: the store need not answer
        if self.link is not None:
            self.link.close()

    def _beat_to_agent(self) -> bool:
        """One beat to the node's agent, and the decisions it passed on; False while it cannot
        be reached (not listening yet, or no agent)."""
        world = self.world
        if self.link is None:
            if not world.relay:
                return False
            try:
                self.link = MemberLink.join(world.relay, world.stable_rank)
            except OSError as exc:  # not yet (it starts its relay as its workers start)
                logger.debug("the agent's relay: %s", exc)
                return False
        for decision in self.link.beat():
            # The agent passes each decision on, but a worker joining hears only the newest:
            # the ones before it come from the store, in order.
            while world._newest.epoch + 1 < decision.epoch:
                world._hear(self._store().get(world._newest.epoch + 1))
            world._hear(decision)
        if world.address.etcd:
            self._node_beat()
        return True

    def _node_beat(self) -> None:
        """This worker's turn, if it is one, to beat in etcd for its node: the node's workers
        take turns by the host's monotonic clock (which they share), so that a node of 16 makes
        one write every :data:`NODE_BEAT_S`, not 160 a second."""
        world = self.world
        turn = int(time.monotonic() / NODE_BEAT_S)
        per_node = max(world.per_node, 1)
        if turn != self._turn and turn % per_node == world.stable_rank % per_node:
            self._turn = turn
            self._store().beat(world.stable_rank)

    def _beat_to_store(self) -> None:
        membership = self._store()
        membership.beat(self.world.stable_rank)
        newer = membership.newer(max(self.world._newest.epoch, 0))
        while newer is not None:  # several decisions may have been made since
            self.world._hear(newer)
            newer = membership.newer(newer.epoch)

    def _store(self) -> Membership:
        if self._membership is None:
            self._membership = Membership(_client(self.world.address))
        return self._membership

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=2.0)
