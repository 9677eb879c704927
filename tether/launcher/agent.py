"""torchrun's elastic agent, with the survivors' dumps taken before every teardown.

The seam: ``torch.distributed.launcher.api.launch_agent`` builds its agent by calling the module
name ``LocalElasticAgent``; :func:`tether_agent` points that name at :class:`TetherAgent` while
``tether run`` runs torchrun in-process. The subclass adds two hooks, both before any worker is
stopped:

- a crash: torch's process context stops the survivors *inside* its poll, the moment it sees a
  failed worker (``SubprocessContext._poll`` calls ``close()``), so by the time
  ``_monitor_workers`` returns FAILED they are gone. We therefore wrap that context's ``close``:
  when it is about to stop workers and some have failed, the survivors dump first.
- a death signal (SIGTERM, SIGINT to the launcher): torch raises ``SignalException`` in the
  agent's run loop and then stops the workers; ``_invoke_run`` catches it on the way out.

While the workers run, a :class:`~tether.launcher.stackwatch.StackWatch` follows the job's
alarms and reads the stacks of the local workers that do not answer. When the job ends badly
(a failure, a tether abort, a death signal), the workers that never answered the alarm that ended
it are killed at once (a stopped process ignores torch's SIGTERM, whose grace is 30 s), and every
worker's process group is killed after torch's own teardown: torch starts each worker in a
session of its own and signals only the groups of workers still running, so the children of a
worker that already exited (a rank blocked in ``subprocess.run``) would outlive the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from tether._log import get_logger, say
from tether.config import AGENT_RELAY_ENV, Config
from tether.events.exception import from_error_file
from tether.events.layout import dump_root
from tether.events.ringfile import ring_file
from tether.job.alarm import HANG_EXIT_CODE, Alarm
from tether.job.client import StoreAddress, connect
from tether.job.jobfile import default_job_id, job_file, targets_file
from tether.job.nodes import span
from tether.job.relay import relay_name
from tether.job.stacks import STACKS_DIR, stack_file
from tether.launcher.cluster import Cluster
from tether.launcher.elastic import REPLACEMENT_ENV, ElasticLauncher, rejoining
from tether.launcher.stackread import proc_state
from tether.launcher.stackwatch import StackWatch
from tether.launcher.teardown import (
    DUMP_GRACE_S,
    Incident,
    JobView,
    describe_exit,
    dump_before_teardown,
    recover_record,
    worker_alive,
)

__all__ = ["Session", "TetherAgent", "tether_agent"]

logger = get_logger(__name__)

_AGENT_NAME = "LocalElasticAgent"


class _Started:
    """One start of the workers (its process context): the dumps are asked for at most once,
    before its first close."""

    def __init__(self, pcontext: Any, worker_group: WorkerGroup) -> None:
        self.pcontext = pcontext
        self.worker_group = worker_group
        self.closing = False
        self.ended_badly = False
        """A failure, a tether abort or a death signal: nothing of the job may outlive it."""
        self.ending: Alarm | None = None
        """The alarm of the incident that ends this start (hang, crash, signal), if any."""
        self.watch: StackWatch | None = None
        self.elastic: ElasticLauncher | None = None
        self.cluster: Cluster | None = None
        """This node's place in a job on several nodes (None on one node)."""
        self.node_fault: Alarm | None = None
        """The alarm that declared another node failed, once this launcher ended its workers."""
        self.ended_for_fault: set[int] = set()
        """The local ranks this launcher killed after they answered that alarm."""
        self.store: StoreAddress | None = None
        """The job's store, once agreed (:meth:`TetherAgent._job_store`)."""


@dataclasses.dataclass
class Session:
    """What ``tether run`` learns from its agents, for its last line."""

    events: list[tuple[str, Path]] = dataclasses.field(default_factory=list)
    """(reason, event directory) of each incident that ended a start of the workers."""
    ended_by_abort: bool = False
    """The last start ended in tether's abort after a hang (whatever each rank's exit said)."""
    stopped: str = ""
    """Why an elastic job stopped (too few ranks left), if it did."""
    node_fault: str = ""
    """What became of the node whose fault ended the job, if one did."""
    elsewhere: str = ""
    """The failure on another node that ended the job (this node's ranks failed after it)."""
    raised: list[int] = dataclasses.field(default_factory=list)
    """The ranks that died of their own exception and said so (their crash alarm), in the
    last incident: the failure to name, whatever the others' exit times."""
    assembled: dict[Path, str] = dataclasses.field(default_factory=dict)
    """Event directory here -> where the whole event is (another node), for the events this
    node sent its part of."""

    def last_event(self) -> Path | None:
        return self.events[-1][1] if self.events else None

    def last_whole(self) -> str | None:
        """Where the last event is whole, when that is on another node."""
        event = self.last_event()
        return self.assembled.get(event) if event is not None else None


class TetherAgent(LocalElasticAgent):
    def __init__(
        self,
        *args: Any,
        dump_dir: Path,
        grace: float = DUMP_GRACE_S,
        session: Session | None = None,
        config: Config | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tether_config = config
        self._tether_dump_dir = dump_dir
        self._tether_grace = grace
        self._tether_started: _Started | None = None
        self._tether_session = session if session is not None else Session()
        self._tether_rejoining: dict[int, int] = {}
        """Stable rank -> incarnation of the workers this start runs as replacements."""
        self._tether_relay = ""
        """Where this start's workers hear of the job's alarms from this agent."""

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        # torch's last look at each worker's environment before it starts them.
        super()._setup_local_watchdog(envs)
        # A name per start: the last start's relay may not be closed yet.
        self._tether_relay = relay_name()
        for env in envs.values():
            env[AGENT_RELAY_ENV] = self._tether_relay
        if self._tether_rejoining:
            group = self._worker_group
            for worker in group.workers:
                incarnation = self._tether_rejoining.get(worker.global_rank)
                if incarnation is not None:
                    envs[worker.local_rank][REPLACEMENT_ENV] = str(incarnation)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        config = self._tether_config
        store: StoreAddress | None = None
        self._tether_rejoining = {}
        if config is not None and config.elastic and config.store:
            # A launcher started on a node the job lost (on etcd, which outlives every node):
            # its workers start as replacements.
            store = self._agree_store(worker_group)
            ranks = [w.global_rank for w in worker_group.workers]
            self._tether_rejoining = rejoining(store.connect(), ranks)
        pids: dict[int, Any] = super()._start_workers(worker_group)
        pcontext = self._pcontext
        if pcontext is not None:
            started = self._tether_started = _Started(pcontext, worker_group)
            started.store = store
            # What ended an earlier start (a restart followed) is not this one's last line.
            self._tether_session.node_fault = self._tether_session.elsewhere = ""
            started.cluster = self._cluster(started)
            started.watch = self._watch(started)
            config = self._tether_config
            if config is not None and config.elastic:
                started.elastic = ElasticLauncher(
                    pcontext,
                    worker_group,
                    lambda: self._job(started),
                    config=config,
                    dump_dir=self._tether_dump_dir,
                    rejoining=self._tether_rejoining,
                    listening=started.cluster.info if started.cluster is not None else None,
                    relay=started.watch.relay if started.watch is not None else None,
                    look=started.watch.look if started.watch is not None else None,
                )
            close = pcontext.close

            def close_after_dumps(
                death_sig: signal.Signals | None = None, timeout: int = 30
            ) -> None:
                try:
                    if started.elastic is not None:
                        started.elastic.close()
                        self._tether_session.stopped = started.elastic.stopped
                    self._before_close(started)
                    if started.ended_badly:
                        self._end_unanswered(started)
                finally:
                    try:
                        close(death_sig, timeout)
                    finally:
                        if started.ended_badly:
                            _kill_groups(started)
                        if started.cluster is not None:
                            started.cluster.close(ended="failed" if started.ended_badly else "")
                        self._clean_up(started)

            # An instance attribute, because the context calls self.close() from its own poll.
            pcontext.close = close_after_dumps  # type: ignore[method-assign]
        return pids

    def _before_close(self, started: _Started) -> None:
        if started.closing:
            return
        started.closing = True
        # SubprocessContext records failures here before it closes; a clean end records none.
        failures: dict[int, Any] = getattr(started.pcontext, "_failures", None) or {}
        if not failures:
            self._close_watch(started)
            return  # every worker succeeded, or a planned restart: nothing to explain
        started.ended_badly = True
        workers = started.worker_group.workers
        dead = {
            workers[local].global_rank: describe_exit(f.exitcode) for local, f in failures.items()
        }
        watch = started.watch
        if started.cluster is not None and (
            self._after_node_fault(started, failures, dead)
            or self._after_crash_elsewhere(started, dead)
        ):
            return
        hang = watch.latest("hang") if watch is not None else None
        aborted = any(f.exitcode == HANG_EXIT_CODE for f in failures.values())
        if aborted or (hang is not None and watch is not None and watch.aborting(hang)):
            # tether aborted the job after a hang: every rank that could has dumped already. A
            # rank that died otherwise meanwhile is part of that teardown, not a new incident.
            if hang is not None:
                started.ending = hang
                self._tether_session.events.append(("hang", self._tether_dump_dir / hang.event_id))
                self._tether_session.ended_by_abort = True
                for rank, how in sorted(dead.items()):
                    if how != describe_exit(HANG_EXIT_CODE):
                        say(f"tether run: rank {rank} died ({how}) during the abort after a hang")
            self._close_watch(started)
            return
        self._tether_session.ended_by_abort = False
        elastic = started.elastic
        if elastic is not None and elastic.stopped and elastic.event is not None:
            # The death that left too few ranks was dumped as it was declared; the survivors'
            # exits (WorldTooSmallError) are its consequence, not a second incident.
            self._tether_session.events.append(("crash", elastic.event))
            self._close_watch(started)
            return
        exceptions = {
            workers[local].global_rank: record
            for local, f in failures.items()
            if (record := from_error_file(f.error_file)) is not None
        }
        own = _raised_by_the_dead(watch, dead) if watch is not None else None
        self._tether_session.raised = sorted(int(r) for r in own.dead_ranks) if own else []
        incident = Incident("crash", f"{len(dead)} worker(s) failed", dead, exceptions, own)
        self._dump(started, incident)
        self._close_watch(started)

    def _after_node_fault(
        self, started: _Started, failures: dict[int, Any], dead: dict[int, str]
    ) -> bool:
        """The workers end because another node failed (declared already, or found now: a rank
        that died of a failed collective may have lost a peer with its node). Dump into that
        node fault's event; True if there was one."""
        assert started.cluster is not None
        cut_off = started.cluster.lost_store()
        if cut_off is None and started.cluster.port.ended and started.cluster.store_gone():
            # Node 0's launcher ended the job (this node's workers were stopped, or slow to
            # follow): the job's last event is the one this node already took part in.
            watch = started.watch
            last = watch.alarms[-1] if watch is not None and watch.alarms else None
            if last is not None:
                self._tether_session.events.append(
                    (last.reason, self._tether_dump_dir / last.event_id)
                )
                self._tether_session.ended_by_abort = last.reason == "hang"
                started.ending = last
            else:
                how = started.cluster.port.ended
                self._tether_session.node_fault = f"node0's launcher ended the job ({how})"
            self._close_watch(started)
            return True
        if cut_off is not None:  # this node lost the job: its own event, joined to the others'
            event_dir = self._tether_dump_dir / cut_off.event_id
            self._tether_session.node_fault = cut_off.detail
            self._tether_session.events.append(("cut_off", event_dir))
            started.ending = cut_off
            self._close_watch(started)
            if (where := started.cluster.rejoin(cut_off)) is not None:
                self._tether_session.assembled[event_dir] = where
            return True
        fault = started.node_fault or (started.watch.latest_node_fault() if started.watch else None)
        if fault is None:
            fault = started.cluster.sweep()
        if fault is None:
            return False
        workers = started.worker_group.workers
        exceptions = {
            workers[local].global_rank: record
            for local, f in failures.items()
            if (record := from_error_file(f.error_file)) is not None
        }
        # The ranks this launcher ended after they answered are not deaths of their own.
        own = {r: how for r, how in dead.items() if r not in started.ended_for_fault}
        lost = {int(r): how for r, how in fault.dead_ranks.items() if r.isdigit()}
        self._tether_session.node_fault = fault.detail
        started.ending = fault
        if own:  # a rank here died before it answered (of the broken connection): dump now
            incident = Incident("crash", fault.detail, {**lost, **own}, exceptions, fault)
            self._dump(started, incident)
        else:
            self._tether_session.events.append(("crash", self._tether_dump_dir / fault.event_id))
        self._close_watch(started)
        return True

    def _after_crash_elsewhere(self, started: _Started, dead: dict[int, str]) -> bool:
        """A rank of another node died and every rank here that died answered its crash alarm
        first: they died of its consequence (the broken connection). That event is the job's,
        not a new one; True if so."""
        watch = started.watch
        alarm = watch.latest("crash") if watch is not None else None
        if watch is None or alarm is None:
            return False
        local = self._job(started).local_pids
        remote = {
            int(r): how
            for r, how in alarm.dead_ranks.items()
            if r.isdigit() and int(r) not in local
        }
        silent = watch.unanswered(alarm)
        if not remote or any(r in silent for r in dead):
            return False
        assert started.cluster is not None
        hosts = started.cluster.host_of()
        what = ", ".join(
            f"rank {r} ({hosts.get(r, '?')}) died ({how})" for r, how in remote.items()
        )
        if alarm.origin.startswith("rank ") and alarm.detail:  # it said what it raised
            what += f": {alarm.detail}"
        self._tether_session.elsewhere = f"{what}; {span(dead)} here failed after it"
        self._tether_session.events.append(("crash", self._tether_dump_dir / alarm.event_id))
        started.ending = alarm
        self._close_watch(started)
        return True

    def _cut_off(self, started: _Started, alarm: Alarm) -> None:
        """This node lost the job's store while its workers ran: nobody can alarm them. End
        them and recover their records from their ring files into this node's own event."""
        self._end_for_node_fault(started, alarm)
        root = dump_root(self._tether_dump_dir)
        host = socket.gethostname()
        event_dir = self._tether_dump_dir / alarm.event_id
        for rank, pid in sorted(self._job(started).local_pids.items()):
            path = ring_file(root, host, pid)
            for _ in range(50):  # SIGKILL is delivered at once; the exit takes a moment
                if not worker_alive(pid):
                    break
                time.sleep(0.02)
            if path.is_file():
                recover_record(event_dir, alarm, rank, path, "ended by its launcher, cut off")

    def _end_for_node_fault(self, started: _Started, alarm: Alarm) -> None:
        """Another node failed and this node's ranks have answered (they wait on ranks that will
        never come): end them, so that the launchers end the job."""
        started.node_fault = alarm
        self._end_workers(started)

    def _end_workers(self, started: _Started) -> None:
        """Kill this node's workers still running (the job is over for them; whatever they had
        to say is in its event already)."""
        for rank, pid in self._job(started).local_pids.items():
            if not worker_alive(pid):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                started.ended_for_fault.add(rank)

    def _exit_barrier(self) -> None:
        # torch's barrier waits for every node's agent (up to 300 s): a node an elastic job lost
        # never comes, and node 0 may have taken torchrun's store along; the nodes that lost
        # one do not wait, so neither does the node that replaced it.
        started = self._tether_started
        elastic = started.elastic if started is not None else None
        if elastic is not None and elastic.lost_nodes:
            logger.info("no exit barrier: the job lost node(s) %s", elastic.lost_nodes)
            return
        if elastic is not None and elastic.rejoined:
            logger.info("no exit barrier: this node replaced one the job lost")
            return
        super()._exit_barrier()  # type: ignore[no-untyped-call]  # torch leaves it untyped

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            result: RunResult = super()._invoke_run(role)
        except SignalException as exc:
            started = self._tether_started
            if started is not None and not started.closing:
                started.closing = started.ended_badly = True
                incident = Incident("signal", f"the launcher received {exc.sigval.name}")
                self._dump(started, incident)
                self._close_watch(started)
            raise
        return result

    def _dump(self, started: _Started, incident: Incident) -> None:
        def raised(alarm: Alarm) -> None:
            started.ending = alarm
            self._tether_session.events.append(
                (incident.reason, self._tether_dump_dir / alarm.event_id)
            )

        dump_before_teardown(
            self._job(started),
            incident,
            dump_dir=self._tether_dump_dir,
            grace=self._tether_grace,
            # A second SIGTERM while we wait must still stop the launcher.
            interrupts=(SignalException,),
            on_alarm=raised,
        )

    def _watch(self, started: _Started) -> StackWatch | None:
        """Start following this start's alarms; None where it cannot (logged)."""
        try:
            job = self._job(started)
            watch = StackWatch(
                job.store,
                world_size=job.world_size,
                dump_dir=self._tether_dump_dir,
                local=lambda: self._job(started).local_pids,
                alive=worker_alive,
                attempt=self._attempt(started.worker_group),
                page=self._tether_config is not None and self._tether_config.debug_port is not None,
                cluster=started.cluster,
                # An elastic job on etcd survives a lost node: it drops the node's ranks.
                on_node_fault=None
                if self._leases_decide()
                else lambda alarm: self._end_for_node_fault(started, alarm),
                relay=self._tether_relay,
            )
            watch.start()
        except Exception:
            logger.warning("not following the job's alarms", exc_info=True)
            return None
        return watch

    def _leases_decide(self) -> bool:
        """Whether each node's etcd lease, not the assembler's watch, decides that a node is
        lost (an elastic job on etcd, which survives it: the ElasticLauncher drops its ranks)."""
        config = self._tether_config
        return config is not None and config.elastic and bool(config.store)

    def _attempt(self, group: WorkerGroup) -> int:
        return int(group.spec.max_restarts - self._remaining_restarts)

    def _cluster(self, started: _Started) -> Cluster | None:
        """This node's place in a job on several nodes; None on one node, or where it cannot
        be set up (logged: the job runs on, its events stay in halves)."""
        group = started.worker_group
        if int(group.group_world_size or 1) <= 1:
            return None
        job = self._job(started)
        try:
            cluster = Cluster(
                job.store,
                attempt=self._attempt(started.worker_group),
                node=int(group.group_rank or 0),
                nodes=int(group.group_world_size or 1),
                ranks=sorted(job.local_pids),
                dump_dir=self._tether_dump_dir,
                running=lambda: any(map(worker_alive, self._job(started).local_pids.values())),
                watch_nodes=not self._leases_decide(),
            )
        except Exception:
            logger.warning("this node cannot help assemble the job's events", exc_info=True)
            return None
        cluster.on_cut_off = lambda alarm: self._cut_off(started, alarm)
        cluster.on_job_ended = lambda _: self._end_workers(started)
        return cluster

    def _close_watch(self, started: _Started) -> None:
        if started.watch is not None:
            started.watch.close()
            for event_id, where in started.watch.sent.items():
                self._tether_session.assembled[self._tether_dump_dir / event_id] = where

    def _end_unanswered(self, started: _Started) -> None:
        """Kill, without torch's 30 s SIGTERM grace, the local workers that did not answer the
        alarm that ends the job (stuck, or stopped: a stopped process never acts on a SIGTERM).
        Their stacks have been read; the ranks that answered are leaving by themselves."""
        alarm, watch = started.ending, started.watch
        try:
            silent = watch.unanswered(alarm) if watch is not None and alarm is not None else {}
        except Exception as exc:  # the store is gone: only a stopped worker is known silent
            logger.debug("could not read who answered: %s", exc)
            silent = {}
        for rank, pid in self._job(started).local_pids.items():
            if not worker_alive(pid):
                continue
            state = proc_state(pid).state
            if rank not in silent and state not in ("stopped", "tracing-stop"):
                continue
            why = f"the {alarm.reason} alarm" if alarm is not None else "the teardown"
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                say(
                    f"tether run: rank {rank} did not answer {why} ({state or 'state unknown'});"
                    " killed it (SIGKILL)"
                )

    def _clean_up(self, started: _Started) -> None:
        """Remove what this start's workers left in the dump directory, however they ended:
        their ring files (each event has what it needed of them by now), their stacks files
        while empty, and rank 0's job and targets files (a job that is over is no target)."""
        root = dump_root(self._tether_dump_dir)
        host = socket.gethostname()
        job = self._job(started)
        paths = [ring_file(root, host, pid) for pid in job.local_pids.values()]
        stacks = [stack_file(root / STACKS_DIR, host, pid) for pid in job.local_pids.values()]
        paths += [p for p in stacks if p.is_file() and p.stat().st_size == 0]
        if 0 in job.local_pids:
            config = self._tether_config
            # The workers take torchrun's run id as the job's where none was given.
            given = (config.job_id if config is not None else "") or _run_id(started.worker_group)
            job_id = given or default_job_id(host, job.local_pids[0])
            paths += [job_file(root, job_id), targets_file(root, job_id)]
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # one file that stays must not keep the others
                logger.warning("could not remove %s: %s", path, exc)

    def _job_store(self, started: _Started) -> StoreAddress:
        """The job's store for this start: torchrun's TCPStore, or with ``--store`` the etcd
        prefix every launcher and worker of the start agrees on through it."""
        if started.store is None:
            started.store = self._agree_store(started.worker_group)
        return started.store

    def _agree_store(self, group: WorkerGroup) -> StoreAddress:
        host, port = str(group.master_addr), int(group.master_port or 0)
        config = self._tether_config
        if config is None or not config.store:
            return StoreAddress(host, port)
        return StoreAddress.agree(
            connect(host, port),
            host=host,
            port=port,
            etcd=config.store,
            job_id=config.job_id or _run_id(group),
            attempt=self._attempt(group),
        )

    def _job(self, started: _Started) -> JobView:
        group = started.worker_group
        pids = started.pcontext.pids()
        return JobView(
            store=self._job_store(started),
            world_size=int(group.workers[0].world_size) if group.workers else 0,
            local_pids={w.global_rank: int(pids[w.local_rank]) for w in group.workers},
        )


def _raised_by_the_dead(watch: StackWatch, dead: dict[int, str]) -> Alarm | None:
    """The crash alarm a rank of ``dead`` raised as it died of its own exception, if that alarm
    can stand for this incident: every other rank found dead answered it (its dump says how its
    operations failed). A dead rank that did not (SIGKILLed meanwhile) needs the launcher's own
    alarm, which names every dead rank."""
    alarm = watch.latest("crash")
    if alarm is None:
        return None
    origin = alarm.origin.removeprefix("rank ")
    if not origin.isdigit() or int(origin) not in dead or origin not in alarm.dead_ranks:
        return None
    silent = watch.unanswered(alarm)
    others = [r for r in dead if str(r) not in alarm.dead_ranks]
    return alarm if all(r not in silent for r in others) else None


def _run_id(group: WorkerGroup) -> str:
    """torchrun's run id (``--rdzv-id``; a fresh uuid under ``--standalone``), "" if unknown."""
    try:
        return str(group.spec.rdzv_handler.get_run_id())
    except Exception:  # a rendezvous handler that cannot say
        return ""


def _kill_groups(started: _Started) -> None:
    """Kill what is left of every worker's process group (the worker is its leader: torch
    starts it with ``start_new_session``), its leader exited or not."""
    for pid in started.pcontext.pids().values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def tether_agent(
    dump_dir: Path, *, grace: float = DUMP_GRACE_S, config: Config | None = None
) -> Iterator[Session]:
    """While inside, torchrun (run in this process) builds a :class:`TetherAgent`; the
    :class:`Session` yielded collects what its agents saw."""
    import torch.distributed.launcher.api as launcher_api

    # launch_agent looks the class up by this module-level name each time it builds an agent.
    namespace = vars(launcher_api)
    original = namespace[_AGENT_NAME]
    session = Session()

    def build(*args: Any, **kwargs: Any) -> TetherAgent:
        return TetherAgent(
            *args, dump_dir=dump_dir, grace=grace, session=session, config=config, **kwargs
        )

    namespace[_AGENT_NAME] = build
    try:
        yield session
    finally:
        namespace[_AGENT_NAME] = original
