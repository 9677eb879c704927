"""The training loop's side of an elastic job: steps that survive a rank's death.

    model = Net()
    ddp = tether.elastic.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = tether.elastic.Manager(state={"model": model, "optimizer": opt})
    for step in manager.steps(100):                 # regroups and heals between steps
        with manager.attempt():                     # a rank's death: the step is redone
            x, y = batch(step, manager.rank, manager.world_size)
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            if manager.should_commit():             # every member finished the step, or none
                opt.step()

torchft's names where torchft has the concept: ``should_commit``, ``register_state_dict_fn``,
``state_dict``/``load_state_dict``, ``batches_committed``, ``init_sync``; a quorum is a
*decision* here because no quorum is voted: the launchers decide, one decision per epoch.

A step is applied by a member whose collectives of the step all completed; a death ends them on
the others, but not always on all of them (a collective can complete on one survivor before the
dead rank's connections are shut, and fail on another). So at the regroup that follows, the
members say how far they got, and one a step behind takes the state of one that applied the step,
as a replacement would: replicas apply the same steps, bit for bit, and no step costs a store round
trip. What every member must agree on without a death, the step at which an admitted replacement
joins, travels in an 8-byte all_reduce started at ``should_commit``: step s's vote is waited at
the boundary after step s+1, so the ranks' skew is absorbed by step s+1's own collectives, not
by a wait of its own at every step (the loop cost 8.5 % of a step over torch's DDP with the vote
waited at the next boundary, 3.4 % waited one step later, 1.9 % of it the elastic DDP's own).
That vote is step s's commit for the job; :meth:`Manager.wait_committed` waits for every vote
in flight, before writing what must hold for the whole job.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tether._exceptions import RankFailedError, TetherError, WorldTooSmallError
from tether._log import get_logger
from tether.elastic import heal
from tether.elastic.world import DEFAULT_TIMEOUT, World
from tether.job.alarm import first_line
from tether.job.elastic import Decision
from tether.recorder.reconfigure import group_timeout

__all__ = ["Manager", "current_world", "healing_plans", "set_world"]

logger = get_logger(__name__)

_world: World | None = None


def set_world(world: World | None) -> None:
    """Set by the runtime when the default group of an elastic job exists."""
    global _world
    _world = world


def current_world() -> World:
    if _world is None:
        raise TetherError(
            "this process is not a worker of an elastic job: launch it with `tether run "
            "--elastic` (or TETHER_ELASTIC=1 with tether installed) and create the default "
            "process group first"
        )
    return _world


Stateful = Any
"""Anything with ``state_dict()`` and ``load_state_dict(sd)`` (a module, an optimizer)."""


Plan = tuple[int | None, tuple[int, ...]]
"""Who heals (None: nobody to heal) and whom."""


def healing_plans(
    decision: Decision, at: Mapping[int, int], part: Callable[[int], int]
) -> dict[int, Plan]:
    """Who heals whom, for each part of the state (``part(rank)``: HSDP's shard of a rank; DDP
    has one part, which every member holds), given the step each member of ``decision`` is at
    (``at``; fresh members hold nothing): the lowest member at the job's step heals the part's
    fresh members and its members at another step.

    The job's step is the lowest of the parts' furthest steps: a death can end a step's last
    collective on some survivors and not on others, and under HSDP a part whose replicas all
    missed the step has nothing to heal the others from, so its replicas that applied it are
    taken back. A part to heal none of whose members is at the job's step: :class:`TetherError`."""
    fresh = set(decision.fresh)
    held: dict[int, list[int]] = {part(r): [] for r in decision.members}
    for r in decision.members:
        if r not in fresh:
            held[part(r)].append(r)
    reached = [max(at[r] for r in ranks) for ranks in held.values() if ranks]
    job_step = min(reached, default=-1)
    plans: dict[int, Plan] = {}
    for p, ranks in held.items():
        healer = next((r for r in ranks if at[r] == job_step), None)
        off = tuple(r for r in ranks if at[r] != job_step)
        targets = (*(r for r in decision.fresh if part(r) == p), *off)
        if healer is None and targets:
            raise TetherError(
                f"no member holding part {p} of the state is at step {job_step}, the furthest "
                f"every part reached (of that part: ranks {ranks} at {[at[r] for r in ranks]}): "
                "the job cannot go on from memory"
            )
        if off:
            logger.info("rank(s) %s not at step %d: healed from rank %s", off, job_step, healer)
        plans[p] = (healer, targets)
    return plans


class Manager:
    """Steps of a training loop over the members of an elastic job (see the module's text)."""

    def __init__(
        self,
        state: Mapping[str, Stateful] | None = None,
        *,
        on_reshard: Callable[[int, int], None] | None = None,
        init_sync: bool = True,
    ) -> None:
        """Args:
        state: what a new member takes from a survivor besides the step (model, optimizer,
            data position...), by name; each needs ``state_dict``/``load_state_dict``.
        on_reshard: called with (rank, world size) after every change of membership, to
            re-shard the data over the ranks alive.
        init_sync: at the first step, every member takes the modules' parameters and buffers
            from rank 0 (as DDP's constructor would).
        """
        self.world = current_world()
        self.pg = c10d._get_default_group()
        self._state: dict[str, Stateful] = dict(state or {})
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.on_reshard = on_reshard
        self.init_sync = init_sync
        self.step = 0
        """The step the loop is at: the next one to commit."""
        self.batches_committed = 0
        self.last_failure: RankFailedError | None = None
        """The death that made the last step be redone, if one did."""
        self.history: list[dict[str, Any]] = []
        """One entry per membership change this worker went through (epoch, seconds, ...)."""
        self._started = False
        self._failed: BaseException | None = None
        self._votes: collections.deque[tuple[int, Any, torch.Tensor]] = collections.deque()
        """The votes in flight, oldest first: (their step, their work, the newest epoch any
        member had heard); at most two (the last step's and the one before)."""
        self.committed = 0
        """How many steps the whole job has committed (every member applied them): the steps
        before the newest vote that completed."""

    # -- who we are --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.decision.members.index(self.world.stable_rank)

    @property
    def world_size(self) -> int:
        return len(self.world.decision.members)

    @property
    def stable_rank(self) -> int:
        return self.world.stable_rank

    @property
    def epoch(self) -> int:
        return self.world.decision.epoch

    # -- state -------------------------------------------------------------------------------------
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        self._fns[key] = (load_state_dict, state_dict)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "batches_committed": self.batches_committed}
        out.update({name: obj.state_dict() for name, obj in self._state.items()})
        out.update({name: save() for name, (_, save) in self._fns.items()})
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.batches_committed = int(state["batches_committed"])
        for name, obj in self._state.items():
            obj.load_state_dict(state[name])
        for name, (load, _) in self._fns.items():
            load(state[name])

    # -- the loop ----------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step to run, up to ``total``; the same step again when its attempt failed
        or did not commit. Between steps, regroup and heal when the membership changed. The
        step before the one yielded may not be committed yet (:meth:`wait_committed`); every
        step is, when the loop ends."""
        while True:
            self._boundary(last=self.step >= total)
            if self.step >= total:
                return
            self._failed = None
            yield self.step
            if self._failed is None:
                self.step += 1

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Run one attempt of the current step: a rank's death inside it (its collectives
        fail, or :class:`RankFailedError`) ends the attempt quietly, and the step is redone
        after the regroup. :class:`WorldTooSmallError` and any other error go through."""
        try:
            yield
        except Exception as exc:
            failure = self._as_failure(exc)
            if failure is None:
                raise
            self._failed = self.last_failure = failure
            why = f"{type(exc).__name__}: {first_line(exc)}"
            logger.warning("step %d abandoned: %s (%s)", self.step, failure, why[:160])
            self._reset_modules()

    def should_commit(self) -> bool:
        """Whether to apply this step (the optimizer's update): True, once reached, since every
        collective of the attempt completed here (a failure ends the attempt first). A member
        that a death left a step behind the others is healed at the regroup. Starts the step's
        vote, which the boundary after the next step waits for: the step is committed for the
        job there (every member applied it); a member cut off from others that did not apply it
        never gets past it (nor through the next step's collectives)."""
        vote = torch.tensor([self.world.newest().epoch], dtype=torch.int64)
        # The largest epoch any member heard comes back to all: every member moves to an
        # admission at the same step boundary.
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.pg, async_op=True)
        self._votes.append((self.step, work, vote))
        self.batches_committed += 1
        return True

    def wait_committed(self) -> int:
        """Wait for the votes in flight; how many steps the whole job has committed (at the top
        of an iteration: every step before it). Call it inside :meth:`attempt`, before writing
        what must hold for the whole job (a checkpoint, a published metric): a node cut off in
        the middle of a step may apply it while the others redo it, but its vote never
        completes, so it never gets past this call. A vote a death ended raises its
        :class:`RankFailedError` (the attempt is then redone after the regroup)."""
        for step, work, _ in list(self._votes):  # the boundaries act on them, as they come
            failure = self._wait_vote(step, work)
            if failure is not None:
                raise failure
        return self.committed

    # -- inside ------------------------------------------------------------------------------------
    def _as_failure(self, exc: BaseException) -> RankFailedError | None:
        """The death behind ``exc``, if a decision names one (waited for a while: a dead peer's
        connections break before the launcher has declared it)."""
        if isinstance(exc, WorldTooSmallError):
            return None
        if isinstance(exc, RankFailedError):
            return exc
        if isinstance(exc, TetherError) or not isinstance(exc, RuntimeError):
            return None
        newer = self.world.wait_newer(self.epoch, self.world.decision_wait_s)
        if newer is None:
            return None
        failure = self.world.failure(newer)
        if isinstance(failure, WorldTooSmallError) or self.stable_rank not in newer.members:
            raise failure from exc
        failure.__cause__ = exc
        return failure

    def _boundary(self, *, last: bool) -> None:
        """Regroup where every member regroups: after a step given up or a vote a death ended
        (every member sees the death), or when a vote names a newer decision (the newest any
        member had heard, which the vote's all_reduce gave every member). A member that merely
        heard of a replacement's admission before the others goes on with them for now: one
        regrouping while another runs a step on the old group would wait on each other. The
        last step's vote stays in flight unless the loop ends or a regroup comes (the next
        step's collectives wait on the slowest rank anyway)."""
        world = self.world
        first = not self._started
        self._started = True
        switch_to = self._settle_votes(keep=0 if last or self._failed is not None else 1)
        if self._failed is not None:
            # Its decision has come, or comes within the heartbeat timeout.
            if world.wait_newer(self.epoch, world.decision_wait_s) is None:
                raise self._failed
            due = True
        elif first:
            if world.replacement:
                self._join()
            due = world.newest().epoch != self.epoch
            if not due and world.unconnected:  # an HSDP mesh's groups: their first connect
                launched = self.epoch
                world.regroup(self.pg)
                due = self.epoch != launched  # a decision came meanwhile: heal as for it
        else:
            due = switch_to > self.epoch
            if due:  # named by the vote: this member may not have heard of it yet
                world.catch_up(switch_to)
        while due:
            began = time.monotonic()
            decision = world.regroup(self.pg)
            healed = self._heal(decision)
            if healed is None:
                continue  # superseded while healing: regroup again
            self._regrouped(decision, time.monotonic() - began, *healed)
            self.committed = self.step  # the members agreed on it, and each now holds it
            due = False
        if first and self.init_sync and not world.replacement:
            self._sync_modules()

    def _settle_votes(self, *, keep: int) -> int:
        """Wait for the votes in flight but the newest ``keep``, and for all of them once one
        names a newer decision or fails (a regroup follows, on a new group): the newest epoch
        they name (-1: none). A vote that a death ended is a failure like a collective's."""
        switch_to = -1
        while len(self._votes) > keep:
            step, work, vote = self._votes.popleft()
            failure = self._wait_vote(step, work)
            if failure is not None:
                self._failed = self.last_failure = failure
                logger.warning("step %d's vote ended: %s", step, failure)
                keep = 0
                continue
            switch_to = max(switch_to, int(vote.item()))
            if switch_to > self.epoch:
                keep = 0
        return switch_to

    def _wait_vote(self, step: int, work: Any) -> RankFailedError | None:
        """Wait for step ``step``'s vote: None once it completed (the step is committed), or
        the death that ended it."""
        try:
            work.wait()
        except Exception as exc:
            failure = self._as_failure(exc)
            if failure is None:
                raise
            return failure
        self.committed = max(self.committed, step + 1)
        return None

    def _reset_modules(self) -> None:
        """An attempt ended mid-forward or mid-backward leaves an FSDP2 root's per-step state
        half done (parameters unsharded, hooks waiting for a backward that never ends): the
        next attempt would skip its collectives. torch's ``reset_iter_state`` discards it; where
        it cannot, this worker stops rather than train on a module that no longer communicates
        (under HSDP its node is then dropped as a whole)."""
        for name, obj in self._state.items():
            reset = getattr(obj, "reset_iter_state", None)
            if reset is None or not isinstance(obj, torch.nn.Module):
                continue
            state_of = getattr(obj, "_get_fsdp_state", None)
            if state_of is not None and getattr(state_of(), "_is_root", None) is False:
                continue  # a module FSDP2 wraps inside another: that root resets it
            try:
                reset()
            except Exception as exc:
                raise TetherError(
                    f"could not reset FSDP2's step state of {name!r} after a death "
                    f"({first_line(exc)}): this worker cannot redo the step"
                ) from exc

    def _sync_modules(self) -> None:
        """Every member takes rank 0's parameters and buffers (DDP's constructor does so; the
        elastic DDP's does not, its group being this process alone); an FSDP2 shard, those of
        its first replica."""
        from torch.distributed.tensor import DTensor

        mesh = self.world.mesh
        replicas = mesh.get_group("replicate") if mesh is not None else None
        with torch.no_grad():
            for obj in self._state.values():
                if isinstance(obj, torch.nn.Module):
                    for tensor in obj.state_dict().values():
                        if isinstance(tensor, DTensor) and replicas is not None:
                            dist.broadcast(tensor.to_local(), group_src=0, group=replicas)
                        else:
                            dist.broadcast(tensor, src=0, group=self.pg)

    def _join(self) -> None:
        """Wait to be admitted: at the members' step boundary where a vote names it (two steps
        at most), within the world group's timeout (the launcher ends a replacement still
        waiting when the job ends)."""
        world = self.world
        world.membership.announce_join(self.stable_rank, world.replacement)
        logger.info("replacement %d waits to be admitted", world.replacement)
        limit = (group_timeout(self.pg) or DEFAULT_TIMEOUT).total_seconds()
        deadline = time.monotonic() + limit
        while self.stable_rank not in world.newest().members:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TetherError(
                    f"replacement {world.replacement} of rank {self.stable_rank} was not "
                    f"admitted within {limit:g}s (the group's timeout)"
                )
            world.wait_newer(world.newest().epoch, left)

    def _parties(self, decision: Decision) -> dict[int, Plan] | None:
        """Who heals whom at this regroup, for each part of the state (one, or HSDP's shards):
        the decision's fresh members, and any member a death left at another step than the
        job's, healed from the lowest member at the job's step. None if a member died meanwhile.

        Every member says how far it got in one all_gather over the new group; the plans are
        :func:`healing_plans`'s."""
        fresh = set(decision.fresh)
        mine = torch.tensor([-1 if self.stable_rank in fresh else self.step], dtype=torch.int64)
        steps = [torch.empty_like(mine) for _ in decision.members]
        try:
            dist.all_gather(steps, mine, group=self.pg)
        except Exception:
            if self.world.wait_newer(decision.epoch, self.world.decision_wait_s) is None:
                raise
            return None
        at = {r: int(t.item()) for r, t in zip(decision.members, steps, strict=True)}
        return healing_plans(decision, at, self.world.shard_of)

    def _heal(self, decision: Decision) -> tuple[dict[int, Plan], heal.Healing] | None:
        """Heal this worker's part of the state as this regroup's plans say (:meth:`_parties`):
        the plans, and what this worker moved (0 bytes where it had nothing to do); None if a
        newer decision came first."""
        plans = self._parties(decision)
        if plans is None:
            return None
        healer, targets = plans[self.world.shard_of(self.stable_rank)]
        me = self.stable_rank
        if not targets or (me != healer and me not in targets):
            return plans, heal.Healing(0, 0.0)

        def abandoned() -> bool:
            # Only the death of a party to the healing ends it: every member has connected for
            # this decision, and one that is not a party may already be in the next step (an
            # admission decided meanwhile waits for the next step's vote to name it).
            alive = self.world.newest().members
            return any(r not in alive for r in (healer, *targets))

        timeout = self.world.heartbeat_timeout + 5.0
        host = heal.own_address(self.world.address.host)
        try:
            if me == healer:
                total = heal.Healing(0, 0.0)
                state = self.state_dict()
                for rank in targets:
                    sent = heal.send(
                        self.world.store,
                        host=host,
                        epoch=decision.epoch,
                        to=rank,
                        state=state,
                        timeout_s=timeout,
                        abandoned=abandoned,
                    )
                    if sent is None:
                        return None
                    total = heal.Healing(
                        total.nbytes + sent.nbytes, total.seconds + sent.seconds, sent.over
                    )
                return plans, total
            got = heal.receive(
                self.world.store,
                host=host,
                epoch=decision.epoch,
                me=me,
                timeout_s=timeout,
                abandoned=abandoned,
                mesh=self.world.mesh,
            )
        except Exception:
            deadline = time.monotonic() + timeout
            while not abandoned() and time.monotonic() < deadline:
                self.world.wait_newer(self.world.newest().epoch, deadline - time.monotonic())
            if abandoned():
                return None  # the peer died while healing: the next decision says who heals
            raise
        if got is None:
            return None
        state, healing = got
        self.load_state_dict(state)
        if me in decision.fresh:
            self.world.membership.mark_healed(me, self.world.replacement, decision.epoch)
        logger.info(
            "healed from rank %s: %d bytes in %.3fs over %s",
            healer,
            healing.nbytes,
            healing.seconds,
            healing.over,
        )
        return plans, healing

    def _regrouped(
        self, decision: Decision, seconds: float, plans: dict[int, Plan], healing: heal.Healing
    ) -> None:
        healer = plans[self.world.shard_of(self.stable_rank)][0]
        entry = {
            "epoch": decision.epoch,
            "members": list(decision.members),
            "step": self.step,
            "seconds": round(seconds, 4),
            "since_decision_s": round(time.time() - decision.at, 4),
            "heal_bytes": healing.nbytes,
            "heal_s": round(healing.seconds, 4),
            "heal_over": healing.over,
            "healer": healer,
        }
        self.history.append(entry)
        if self.stable_rank == healer:
            healers = sum(1 for _, targets in plans.values() if targets)  # HSDP: one a shard
            self.world.membership.report_regrouped(decision.epoch, entry, healers=healers)
        if self.on_reshard is not None:
            self.on_reshard(self.rank, self.world_size)
