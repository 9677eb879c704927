"""``tether run --elastic``: a dead worker is declared dead, the survivors regroup, and this
launcher starts a replacement for that worker alone.

torch's process context ends the whole job at the first failed worker (``SubprocessContext._poll``
closes every process). Here its failure capture is wrapped: before torch looks, each poll (every
``--monitor-interval``, 0.1 s) this launcher

- declares dead the local workers that exited non-zero, and those still running whose heartbeat
  stopped for ``--heartbeat-timeout`` (stopped, or stuck in C holding the GIL) without their
  saying they are leaving (a closing process's exit decides), and kills the latter (a rank
  declared dead must never come back into the job);
- claims the job's next membership decision in the store (:class:`tether.job.elastic.Decision`:
  one per epoch, however many ranks died in the same poll, and whichever launcher claims it);
- has the survivors dump into one event (as a crash without ``--elastic`` would), keeps the dead
  rank's ring, and writes the event's ``elastic.json`` timeline as the job goes on;
- starts a replacement in the dead worker's slot (same ``RANK``, ``TETHER_ELASTIC_REPLACEMENT``
  counting its incarnations), and admits it in the next decision once it has announced itself;
- started on a node the job lost (``tether run ... --node-rank k`` again, on a fresh host), starts
  all its workers as replacements of the ranks the job dropped (:func:`rejoining`), and admits them
  the same way: the survivors heal them at a step boundary;
- hides those failures from torch, so that the job ends as torch would end it: when every worker
  left has exited (0 for success), or with a failure once the job stops (a decision below
  ``--min-world-size``, which the survivors answer by raising ``WorldTooSmallError``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._exceptions import ConfigError, StoreUnreachableError
from tether._log import get_logger, say
from tether.config import Config
from tether.events.layout import elastic_timeline_file, write_atomic
from tether.job.alarm import first_line
from tether.job.elastic import Decision, Membership, Node, NodePresence
from tether.job.nodes import NodeInfo, span
from tether.job.relay import AlarmLook, RelayServer
from tether.launcher.stackread import proc_state, stacks_or_why
from tether.launcher.teardown import Incident, JobView, describe_exit, dump_before_teardown

__all__ = ["REPLACEMENT_ENV", "ElasticLauncher", "rejoining"]

logger = get_logger(__name__)

STORE_STALL_S = 1.0
"""A read of the job's store slower than this (it answers in milliseconds) means it answered no
one meanwhile (an etcd cluster electing a leader took 3.6 s): the workers' beats waited too."""

STOP_GRACE_S = 10.0
"""Once the job stops, how long the survivors have to raise ``WorldTooSmallError`` and exit on
their own (they do within a step) before torch's teardown ends them: torch ends a node's workers
as soon as it sees one exit that failed, which would cut their last words short."""

REPLACEMENT_ENV = "TETHER_ELASTIC_REPLACEMENT"
"""Set in a replacement worker's environment: which replacement of its rank it is (1, 2, ...)."""


class ElasticLauncher:
    """One start of the workers, kept going through their deaths (see the module's text)."""

    def __init__(
        self,
        pcontext: Any,
        worker_group: Any,
        job: Callable[[], JobView],
        *,
        config: Config,
        dump_dir: Path,
        rejoining: dict[int, int] | None = None,
        listening: NodeInfo | None = None,
        relay: RelayServer | None = None,
        look: AlarmLook | None = None,
    ) -> None:
        """``rejoining``: stable rank -> incarnation, for workers started as replacements of
        ranks the job dropped (:func:`rejoining`); ``listening``: where this launcher takes
        connections from the other nodes (its event port), watched by another node;
        ``relay``: where this node's workers beat and hear the decisions (None: they do both
        through the store), ``look``: the node's look, whose news counter says when there is a
        decision to read."""
        self.pcontext = pcontext
        self.worker_group = worker_group
        self.workers = {w.local_rank: w.global_rank for w in worker_group.workers}
        self.world_size = int(worker_group.workers[0].world_size) if worker_group.workers else 0
        self.job = job
        self.config = config
        self.dump_dir = dump_dir
        view = job()
        self.membership = Membership(view.store.connect())
        self.relay = relay
        self._look = look
        self._news = -1
        """The news counter when this launcher last read the decisions."""
        self._passed_on = 0
        """The newest decision epoch passed on to the workers."""
        self._lost_said = False
        """The workers were told the job's store is gone."""
        if relay is not None:  # what a worker that joins the relay hears first
            latest = self.membership.latest()
            if latest is not None:
                self._send(latest)
        self.incarnation = dict.fromkeys(self.workers.values(), 0)
        self.incarnation.update(rejoining or {})
        self.replacements_left = config.max_replacements
        self.pending: set[int] = set(rejoining or ())
        """Stable ranks whose replacement runs but has not been admitted yet."""
        self.rejoined = bool(rejoining)
        """This launcher replaces a node the job lost."""
        self._together = set(rejoining or ())
        """A replacement node's workers, admitted in one decision once all have joined."""
        self.retired: set[int] = set()
        """Stable ranks of this launcher that are out of the job for good."""
        self.finished = False
        """A member exited 0: the job is ending, nobody is admitted or replaced any more."""
        self.stopped = ""
        """The stop decision's reason, once the job stops."""
        self._stop_by = 0.0
        """Once the job stops: when torch may end the survivors that have not exited yet."""
        self._beats: dict[int, tuple[int, float]] = {}
        """Stable rank -> (last heartbeat count, when it changed), once it has beaten."""
        self._store_back = 0.0
        """When the job's store last answered after a stall, or this launcher ran again after
        it was stopped: silence is counted from there."""
        self._polled = time.monotonic()
        spec = getattr(worker_group, "spec", None)
        self._stopped_after = float(getattr(spec, "monitor_interval", 0.1)) + STORE_STALL_S
        """A gap between two polls longer than this: this launcher was stopped meanwhile."""
        self._timeline: list[dict[str, Any]] = []
        self.event: Path | None = None
        """The event of the last death declared (where the timeline is written)."""
        self._dumping: list[threading.Thread] = []
        self.presence: NodePresence | None = None
        """This node's lease, in a job on several nodes whose store is etcd: a node whose lease
        expires is lost whole, and its ranks are declared dead in one decision."""
        self._nodes: dict[int, Node] = {}
        """Every node seen present (their ranks, for when they are lost)."""
        self._gone_nodes: set[int] = set()
        self.lost_nodes: list[str] = []
        """The hosts of the nodes this job lost (their leases expired while it ran)."""
        kv = getattr(self.membership.store, "kv", None)
        nodes = int(getattr(worker_group, "group_world_size", None) or 1)
        if nodes > 1 and view.store.etcd and kv is not None:
            where = (listening.address, listening.port, listening.token) if listening else ()
            node = Node(
                int(worker_group.group_rank or 0),
                socket.gethostname(),
                tuple(sorted(self.workers.values())),
                *where,
            )
            self.presence = NodePresence(kv, node)
        self.closed = False
        """torch is stopping the workers: their exits are torch's to see, not deaths to survive."""
        capture = pcontext._capture_process_failures

        def capture_after_elastic(done_local_ranks: set[int]) -> None:
            try:
                seen = self.poll()
            except StoreUnreachableError as exc:  # cut off, or for now: this node's lease decides
                logger.warning("elastic membership poll: %s", exc)
                seen = None
            except Exception:  # the job goes on as torch runs it; say why elasticity did not
                logger.exception("elastic membership poll failed")
                seen = None
            if seen is None:
                capture(done_local_ranks)
                return
            # torch looks only at the exits this poll dealt with: a worker that died after the
            # poll looked at it (a second death while the first one's alarm went out) is the
            # next poll's, not a failure that would end the job.
            running = pcontext._running_local_ranks
            pcontext._running_local_ranks = running & seen
            try:
                capture(done_local_ranks)
            finally:
                pcontext._running_local_ranks = running

        pcontext._capture_process_failures = capture_after_elastic

    # -- each poll ------------------------------------------------------------------------------
    def poll(self) -> set[int] | None:
        """Deal with this poll's deaths and joins; the local ranks whose exit torch may see now
        (None: all of them, once the job stops or torch closes it)."""
        if self.closed:
            return None
        if self.stopped:  # the survivors are leaving: torch sees their exits once they have
            return None if self._left() else set()
        now, last = time.monotonic(), self._polled
        self._polled = now
        if now - last > self._stopped_after:
            # This launcher was stopped with its workers (a frozen node, thawed): their silence
            # is its own, and the job may have dropped this node meanwhile.
            self._store_back = now
            if self.presence is not None:
                self.presence.expired()
        if self.presence is not None and self.presence.cut_off:
            # Before any read of the store: cut off, this node can read none.
            self._fence(self.presence.cut_off)
            return None
        dead: dict[int, str] = {}
        admitted: list[int] = []
        handlers = self.pcontext.subprocess_handlers
        exited: dict[int, Any] = {}  # local rank -> the handler whose exit this poll saw
        for local, stable in self.workers.items():
            if stable in self.retired or local not in self.pcontext._running_local_ranks:
                continue
            code = handlers[local].proc.poll()
            if code is not None:
                exited[local] = handlers[local]
            if code == 0:
                # Finished: the job is ending (a member that leaves the loop before the others
                # is a program error they see as a broken collective, not a death to survive).
                self.finished = self.finished or stable not in self.pending
                continue
            if code is not None:
                if stable in self.pending:  # a replacement that died before it was admitted
                    self.pending.discard(stable)
                    self._together.discard(stable)  # its own replacement joins on its own
                    say(
                        f"tether run: the replacement for rank {stable} died "
                        f"({describe_exit(code)})"
                    )
                    self._replace_or_retire(local, stable)
                else:
                    dead[stable] = describe_exit(code)
                continue
            if stable in self.pending:
                if not self.finished and self.membership.joined(stable, self.incarnation[stable]):
                    admitted.append(stable)
                continue
            stale = self._stale(local, stable)
            if stale:
                dead[stable] = stale
        if self._together:
            if self._together <= {*admitted}:
                self._together.clear()
            else:  # a node rejoins whole: one decision, one regroup, one heal
                admitted = [r for r in admitted if r not in self._together]
        hosts: list[str] = []
        if self.presence is not None and not self.finished:
            lost, hosts = self._lost_nodes()
            dead.update(lost)
        if self.finished and self.pending:
            for local, stable in self.workers.items():
                if stable in self.pending:  # the job ends: no one is admitted any more
                    self.pending.discard(stable)
                    self._kill(local)
                    self._retire(local, stable)
        if dead or admitted:
            self._decide(dead, admitted, nodes=dict.fromkeys(hosts, "lost"))
        self._pass_on()
        if self.event is not None:
            self._follow()
        if any("regrouped" not in entry for entry in self._timeline):
            self.note_regroups()
        if self.stopped:
            return None if self._left() else set()
        # A replaced worker's new handler runs: its predecessor's exit is hidden from torch.
        return {local for local, handler in exited.items() if handlers[local] is handler}

    def _pass_on(self) -> None:
        """Pass the decisions made since the last poll (by any launcher) on to this node's
        workers: read when the node's look saw the news counter move, or at every poll where
        the node has no look."""
        relay, look = self.relay, self._look
        if relay is None:
            return  # the workers look in the store themselves
        if look is not None and look.error is not None and not self._lost_said:
            # The store is gone (the look ends at its first failure on a TCPStore): the
            # workers, which ask it nothing, hear it from here.
            relay.send_lost(f"its node's look for alarms failed: {first_line(look.error)}")
            self._lost_said = True
            return
        if look is not None and look.looking:
            if look.news == self._news:
                return
            self._news = look.news
        newer = self.membership.newer(self._passed_on)
        while newer is not None:
            self._send(newer)
            newer = self.membership.newer(newer.epoch)

    def _send(self, decision: Decision) -> None:
        if self.relay is not None and decision.epoch > self._passed_on:
            self.relay.send_decision(decision)
            self._passed_on = decision.epoch

    def _lost_nodes(self) -> tuple[dict[int, str], list[str]]:
        """The ranks and hosts of the nodes lost since the last poll (their lease expired, and
        they did not leave at the job's end), as the lowest node present decides them."""
        assert self.presence is not None
        present = self.presence.present()
        self._nodes.update(present)
        self._gone_nodes -= present.keys()  # a lost node replaced: watched again
        gone = [k for k in self._nodes if k not in present and k not in self._gone_nodes]
        if not gone:
            return {}, []
        left = self.presence.left()
        self._gone_nodes.update(gone)
        lost = [self._nodes[k] for k in gone if k not in left]
        self.lost_nodes += [node.host for node in lost]
        if not lost or min(present, default=-1) != self.presence.node.index:
            return {}, []  # the lowest node present decides (the others would decide the same)
        dead: dict[int, str] = {}
        for node in lost:
            say(
                f"tether run: {node.host} ({span(node.ranks)}) lost: {self.presence.why_lost(node)}"
            )
            dead.update(dict.fromkeys(node.ranks, f"{node.host} lost"))
        return dead, [node.host for node in lost]

    def _fence(self, why: str) -> None:
        """This node is cut off from the job (no quorum of the store reachable): the others
        declare its ranks dead, so they must never come back; its workers end here."""
        for local in self.workers:
            self._kill(local)
        self.stopped = f"this node ({socket.gethostname()}) is cut off from the job: {why}"
        say(f"tether run: {self.stopped}; its workers were stopped, the others go on")

    def _left(self) -> bool:
        """The job stopped and every worker of this node has exited (or had its time)."""
        if not self._stop_by:
            self._stop_by = time.monotonic() + STOP_GRACE_S
        handlers = self.pcontext.subprocess_handlers
        ranks = self.pcontext._running_local_ranks
        running = any(handlers[local].proc.poll() is None for local in ranks)
        return not running or time.monotonic() > self._stop_by

    def _stale(self, local: int, stable: int) -> str:
        """Why ``stable`` counts as dead by its heartbeat, or ""."""
        count = self.relay.beats(stable) if self.relay is not None else None
        now = time.monotonic()
        if count is None:  # it beats through the store (no relay reached yet)
            asked, count = now, self.membership.beats(stable)
            now = time.monotonic()
            if now - asked > STORE_STALL_S:
                self._store_back = now  # no worker could beat meanwhile either
        last = self._beats.get(stable)
        if last is None or count != last[0]:
            if count:  # watched from its first beat on (imports and group formation come first)
                self._beats[stable] = (count, now)
            return ""
        silent = now - max(last[1], self._store_back)
        if silent < self.config.heartbeat_timeout:
            return ""
        if self.membership.left(stable, self.incarnation[stable]):
            return ""  # it is exiting: its exit status decides
        pid = self.pcontext.subprocess_handlers[local].proc.pid
        state = proc_state(pid).state or "unknown"
        # It is killed next: its stacks are all that is left of why it went silent.
        logger.warning(
            "rank %d is silent; what it was doing:\n%s", stable, stacks_or_why(pid, timeout=2.0)
        )
        return f"no heartbeat for {silent:.1f}s (process {state})"

    # -- a decision -----------------------------------------------------------------------------
    def _decide(self, dead: dict[int, str], admitted: list[int], *, nodes: dict[str, str]) -> None:
        """``nodes``: the hosts lost whole among ``dead`` (named in the event's alarm, so that
        every launcher takes them for failed, and the next node assembles the event)."""
        for local, stable in self.workers.items():
            if stable in dead:
                self._kill(local)  # fenced before anyone is told: it never rejoins on its own
        if dead:
            # The crash alarm goes out before the decision: the survivors regroup only once
            # told, so every entry of their dumps that follows the alarm's time ran on a
            # communicator formed after it (the analyzer leaves those out of the incident).
            self._dump(dead, nodes=nodes)
        while True:
            previous = self.membership.latest() or Decision(0, tuple(range(self.world_size)))
            members = [r for r in previous.members if r not in dead]
            joined = [r for r in admitted if r not in members]
            members = sorted({*members, *joined})
            fresh = [r for r in previous.fresh if r in members and not self._healed(r)]
            fresh = sorted({*fresh, *joined})
            stop = ""
            if len(members) < self.config.min_world_size:
                stop = (
                    f"{len(members)} rank(s) left, fewer than --min-world-size "
                    f"{self.config.min_world_size}"
                )
            lost = {r: how for r, how in dead.items() if r in previous.members}
            if not lost and not joined:
                return  # decided already (by another launcher that saw the same)
            decision = Decision(
                epoch=previous.epoch + 1,
                members=tuple(members),
                dead=lost,
                joined=tuple(joined),
                joined_on=socket.gethostname() if joined else "",
                fresh=tuple(fresh),
                stop=stop,
                at=time.time(),
            )
            won = self.membership.propose(decision)
            if won == decision:
                break
        self._after(decision)

    def _after(self, decision: Decision) -> None:
        self._pass_on()  # the ones before it first, in order
        self._send(decision)
        for rank in decision.joined:
            self.pending.discard(rank)
        lost = ", ".join(f"rank {r} ({how})" for r, how in sorted(decision.dead.items()))
        if decision.dead:
            say(
                f"tether run: {lost} declared dead; epoch {decision.epoch}: "
                f"{len(decision.members)} rank(s) {list(decision.members)}"
            )
        if decision.joined:
            say(
                f"tether run: rank(s) {list(decision.joined)} joined; epoch {decision.epoch}: "
                f"{len(decision.members)} rank(s)"
            )
        self._follow(decision)
        if decision.stop:
            self.stopped = decision.stop
            say(f"tether run: the job stops: {decision.stop}")
            return
        for local, stable in self.workers.items():
            if stable in decision.dead:
                self._replace_or_retire(local, stable)

    def _healed(self, stable: int) -> bool:
        # Another launcher's rank (a replacement node's, still fresh): its latest incarnation.
        incarnation = self.incarnation.get(stable)
        if incarnation is None:
            incarnation = self.membership.incarnation(stable)
        return self.membership.healed(stable, incarnation)

    # -- replacements ---------------------------------------------------------------------------
    def _replace_or_retire(self, local: int, stable: int) -> None:
        if self.finished or self.stopped or self.replacements_left <= 0:
            self._retire(local, stable)
            return
        if 0 in self._gone_nodes:
            # A worker's default group starts through torchrun's store, in node 0's launcher: a
            # replacement would wait on it for its whole timeout (30 min).
            say(f"tether run: no replacement for rank {stable}: node0 took torchrun's store along")
            self._retire(local, stable)
            return
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            get_subprocess_handler,
        )

        self.replacements_left -= 1
        self.incarnation[stable] = self.membership.next_incarnation(stable)
        pc = self.pcontext
        env = {**pc.envs[local], REPLACEMENT_ENV: str(self.incarnation[stable])}
        pc.subprocess_handlers[local] = get_subprocess_handler(
            entrypoint=pc.entrypoint,
            args=pc.args[local],
            env=env,
            stdout=pc.stdouts[local],
            stderr=pc.stderrs[local],
            local_rank_id=local,
        )
        for worker in self.worker_group.workers:  # torch checks its workers' pids every poll
            if worker.local_rank == local:
                worker.id = pc.subprocess_handlers[local].proc.pid
        self.pending.add(stable)
        self._beats.pop(stable, None)
        say(
            f"tether run: started replacement {self.incarnation[stable]} for rank {stable} "
            f"(pid {pc.subprocess_handlers[local].proc.pid})"
        )

    def _retire(self, local: int, stable: int) -> None:
        """Out of the job for good, without failing it: torch never sees this worker again."""
        self.retired.add(stable)
        self.pcontext._running_local_ranks.discard(local)

    def _kill(self, local: int) -> None:
        proc = self.pcontext.subprocess_handlers[local].proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)

    # -- what the job's event says --------------------------------------------------------------
    def _dump(self, dead: dict[int, str], *, nodes: dict[str, str]) -> None:
        """Every survivor dumps into one event, beside the dead ranks' recovered records; the
        answers are awaited in the background, the alarm itself (up to 2 s) here."""
        job = self.job()
        incident = Incident("crash", "ranks died in an elastic job", dict(dead), nodes=nodes)
        raised_one = threading.Event()

        def raised(alarm: Any) -> None:
            self.event = self.dump_dir / alarm.event_id
            raised_one.set()

        def dump() -> None:
            try:
                dump_before_teardown(
                    job, incident, dump_dir=self.dump_dir, grace=5.0, on_alarm=raised
                )
            finally:
                raised_one.set()

        thread = threading.Thread(target=dump, name="tether-elastic-dump", daemon=True)
        thread.start()
        self._dumping.append(thread)
        raised_one.wait(2.0)

    def _follow(self, decided: Decision | None = None) -> None:
        """Bring the timeline up to ``decided``, or to the store's latest decision: every epoch,
        this launcher's decisions and the others' (a replacement node admits its own ranks)."""
        known = self._timeline[-1]["decision"]["epoch"] if self._timeline else 0
        latest = decided.epoch if decided is not None else self.membership.latest_epoch()
        if latest <= known:
            return
        for epoch in range(known + 1, latest + 1):
            decision = decided if decided and decided.epoch == epoch else self.membership.get(epoch)
            self._timeline.append({"decision": json.loads(decision.to_json())})
        self._write_timeline()

    def note_regroups(self) -> None:
        """Add what the survivors reported about each regroup to the timeline."""
        changed = False
        for entry in self._timeline:
            epoch = entry["decision"]["epoch"]
            if "regrouped" not in entry:
                report = self.membership.regrouped(epoch)
                if report is not None:
                    entry["regrouped"] = report
                    changed = True
        if changed:
            self._write_timeline()

    def _write_timeline(self) -> None:
        if self.event is None:
            return
        try:
            self.event.mkdir(parents=True, exist_ok=True)
            data = {"world_size": self.world_size, "epochs": self._timeline}
            write_atomic(elastic_timeline_file(self.event), json.dumps(data, indent=1).encode())
        except OSError as exc:
            logger.warning("could not write the elastic timeline: %s", exc)

    def close(self) -> None:
        self.closed = True
        if self.presence is not None:
            self.presence.close(leaving=not self.stopped)
        with contextlib.suppress(Exception):
            self.note_regroups()
        for thread in self._dumping:
            thread.join(timeout=6.0)
        with contextlib.suppress(Exception):
            self.note_regroups()


def rejoining(store: Any, ranks: list[int]) -> dict[int, int]:
    """Stable rank -> incarnation for the workers of a launcher about to start ``ranks``: none
    at the job's start; on a node the job has dropped (a replacement of a lost node), a fresh
    incarnation each, so that they start as replacements and wait to be admitted. Raises
    :class:`~tether._exceptions.ConfigError` when the job has stopped."""
    membership = Membership(store)
    latest = membership.latest()
    if latest is None or all(r in latest.members for r in ranks):
        return {}
    if latest.stop:
        raise ConfigError(f"the elastic job has stopped ({latest.stop}): nothing to rejoin")
    say(
        f"tether run: the job dropped {socket.gethostname()}'s {span(ranks)} in epoch "
        f"{latest.epoch}: they start as replacements and join at a step boundary"
    )
    return {r: membership.next_incarnation(r) for r in ranks}
