"""The rank's link to the job: its watchdog and hang policy, the job's alarms through the store
(the responder, dumps into events, ``POST /dump``), what it publishes there, rank 0's job file,
and what it says as it exits. What the rank reports (health, traces, metrics) is read apart, by
:class:`~tether.watchdog.report.RankReport`."""

from __future__ import annotations

import dataclasses
import faulthandler
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tether._log import get_logger, set_rank
from tether.events.exception import EXCEPTION, describe, from_collective, from_exception
from tether.events.layout import dump_root, new_event_id
from tether.events.schema import FORMING
from tether.job.alarm import Alarm, AlarmBoard
from tether.job.client import StoreAddress
from tether.job.jobfile import default_job_id, job_file, write_json
from tether.job.stacks import STACKS_DIR, arm_stack_signal, process_start_time
from tether.recorder.formation import Late
from tether.recorder.recorder import Recorder
from tether.recorder.writer import write_event
from tether.watchdog.hang import HangPolicy
from tether.watchdog.responder import Responder
from tether.watchdog.watchdog import Watchdog

__all__ = ["JobLink"]

logger = get_logger(__name__)


class JobLink:
    """What one rank does towards the job; :mod:`tether.runtime` builds one per process and
    hands its watchdog, hang policy and alarm counts to the rank's report."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.config = recorder.config
        self.hang_policy = HangPolicy(
            recorder, responder=lambda: self.responder, extra=lambda: self.dump_extra()
        )
        self.watchdog = Watchdog(
            recorder, hang_timeout=self.config.hang_timeout, on_hang=self.hang_policy
        )
        self.board: AlarmBoard | None = None
        self._address: StoreAddress | None = None
        self.responder: Responder | None = None
        self._proc_info: dict[str, Any] = {}
        self._stack_file: Path | None = None
        self._written: set[Path] = set()
        """Files this process wrote in ``DUMP_DIR/.jobs``: a clean exit removes them (and only
        them: a file of the same name that another process wrote is not this one's to remove)."""
        self.events: Counter[tuple[str, str]] = Counter()
        """What this rank did for alarms: (answered | dumped | dump_failed, reason) -> count
        (the rank's metrics read it)."""
        self.exception: dict[str, Any] | None = None
        """What this rank dies of, once its main thread is dying of an exception: every dump
        from then on carries it."""
        self.forming: Late | None = None
        """A group's creation this rank has waited in longer than the hang timeout, while it
        waits: every dump carries it."""

    def start(self) -> None:
        self.watchdog.start()

    def connect(self, store: Any, *, address: StoreAddress | None = None, attempt: int = 0) -> None:
        """The default group has formed: join the job's alarms through its store. A default group
        formed again (after ``destroy_process_group``) replaces the previous responder.
        ``address``: where others reach that store (None: a TCPStore's own host and port).
        ``attempt``: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``)."""
        self._disconnect()
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if address is None and host is not None and port is not None:
            address = StoreAddress(str(host), int(port))
        self._address = address
        rec = self.recorder
        self.board = AlarmBoard(store)
        stack_file = self._stack_file = arm_stack_signal(self._dump_dir() / STACKS_DIR, rec.host)
        self._proc_info = {}
        ring_path = rec.ring_file.path if rec.ring_file is not None else None
        self.publish(
            stack_file=str(stack_file),
            ring_file=str(ring_path) if ring_path is not None else None,
            start_time=process_start_time(rec.pid),
            attempt=attempt,
        )
        self.responder = Responder(
            self.board,
            rank=rec.global_rank,
            world_size=rec.world_size,
            host=rec.host,
            dump=self._counted_dump,
            event_dir=lambda event_id: self._dump_dir() / event_id,
            abort_on=lambda alarm: alarm.reason == "hang" and self.config.on_hang == "abort",
            attempt=attempt,
            relay=self.config.agent_relay,
            # An elastic worker stops on its own thread's AgentGoneError, in its training loop.
            stop_if_orphaned=not self.config.elastic,
        )
        self.responder.start()
        if rec.global_rank == 0:
            self._announce_job()

    def _disconnect(self) -> None:
        """Stop the previous group's responder (two would both answer every alarm, into the
        same files)."""
        responder, self.responder = self.responder, None
        if responder is not None:
            responder.close()

    def _announce_job(self) -> None:
        """Leave ``DUMP_DIR/.jobs/<job>.json`` so `tether dump` can find this job's store."""
        address = self._address
        if address is None:
            return  # nothing another process could connect to
        rec = self.recorder
        info = {
            "job_id": self.job_id,
            "store_host": address.host,
            "store_port": address.port,
            **(
                {"store_etcd": address.etcd, "store_prefix": address.prefix} if address.etcd else {}
            ),
            "world_size": rec.world_size,
            "host": rec.host,
            "pid": rec.pid,
            "started_ns": time.time_ns(),
        }
        if address.etcd:  # its keys are in etcd: the TCPStore only started the job
            info.update(store_etcd=address.etcd, store_prefix=address.prefix)
        path = job_file(self._dump_dir(), self.job_id)
        try:
            write_json(path, info)
        except OSError as exc:  # the job runs on; only `tether dump` loses its way in
            logger.warning("could not write %s: %s", path, exc)
            return
        self.wrote(path)

    def wrote(self, path: Path) -> None:
        """``path`` is this process's: a clean exit removes it."""
        self._written.add(path)

    @property
    def job_id(self) -> str:
        """The job's id, or one made of rank 0's host and pid where none was given."""
        return self.config.job_id or default_job_id(self.recorder.host, self.recorder.pid)

    def publish(self, **info: Any) -> None:
        """Add to what the job's store says about this rank (``tether/proc/<rank>``)."""
        if self.board is None:
            return
        self._proc_info.update(info, host=self.recorder.host, pid=self.recorder.pid)
        self.board.publish_proc(self.recorder.global_rank, self._proc_info)

    def launcher_says_page(self) -> bool:
        """Whether ``tether run``'s agent on this host follows the job (and so says where its
        cluster page is)."""
        try:
            return self.responder is not None and self.responder.agent_watches()
        except Exception:  # the store cannot say: this rank says it
            return False

    def exit_if_aborting(self) -> None:
        if self.responder is not None:
            self.responder.exit_if_aborting()

    def note_exception(self, exc: BaseException) -> None:
        """The main thread is dying of ``exc``: every dump from now on carries it."""
        self.exception = from_exception(exc)

    def report_exit(self, exc: BaseException, *, exit_code: int, timeout: float) -> None:
        """The main thread dies of ``exc`` and the process will exit with ``exit_code``: make
        sure this rank's dump, saying what it died of, is in the event of the crash, waiting up
        to ``timeout`` seconds for it.

        An exception of its own (the user's code raised) is the crash: this rank raises the
        job's crash alarm itself, naming itself dead, so every rank dumps at once instead of
        after the launcher has noticed the exit. An exception out of torch.distributed (a
        collective, the store), or with an operation the backend failed, may be a peer's death
        seen from here: this rank then waits for the alarm of whoever knows who died (the
        peer's own, or the launcher's), unless it has answered a crash alarm already."""
        record = self.exception = from_exception(exc)
        responder, board = self.responder, self.board
        if responder is None or board is None or timeout <= 0:
            return  # the launcher's alarm, the ring file and torchrun's error file speak for it
        if from_collective(record) or self._a_collective_failed():
            if not any(a.reason == "crash" for a in responder.handled):
                responder.wait_answered(responder.answered, timeout)
            return
        rank = self.recorder.global_rank
        before = responder.answered
        try:
            board.raise_alarm(
                "crash",
                origin=f"rank {rank}",
                start=responder.epoch,
                join=True,
                detail=f"rank {rank} raised {describe(record)}",
                dead_ranks={str(rank): f"exit code {exit_code}"},
            )
        except Exception as exc_store:  # the store is gone: the launcher recovers the record
            logger.warning("could not raise the crash alarm: %s", exc_store)
            return
        responder.wait_answered(before, timeout)

    def _a_collective_failed(self) -> bool:
        """Whether an operation of this rank failed, or is still in flight (a peer's death may
        be about to fail it): then the exception may be that death's, not this rank's own."""
        try:
            if self.recorder.inflight():
                return True
            self.recorder.find_failures()
            return any(e.error is not None for e in self.recorder.entries())
        except Exception:  # a recorder that cannot say: the exception is taken as the rank's own
            logger.debug("could not look for failed operations", exc_info=True)
            return False

    def leave(self) -> bool:
        """The process exits cleanly while still a member of the job's groups (it returned
        while the others may go on: out of data, a bad branch): say so in the job's store, so
        that an incident that follows names it. True where the launcher on this host will
        recover its record (keep its ring file: the launcher removes it when the job ends)."""
        responder = self.responder
        if responder is None or self.board is None:
            return False
        try:
            self.publish(left={"time_ns": time.time_ns(), "exit_code": 0})
            return responder.agent_watches()
        except Exception as exc:  # the store is gone: the job is over anyway
            logger.debug("could not say this rank left: %s", exc)
            return False

    def close(self, *, clean: bool = False) -> None:
        """Stop the threads. ``clean``: the interpreter is exiting
        normally (no uncaught exception), so this process leaves nothing behind: the files it
        wrote in ``DUMP_DIR/.jobs`` (rank 0's) and its stacks file while empty. After a failure
        they stay (`tether dump` may still reach the other ranks; a stacks file may hold
        evidence), and so does a stacks file with anything in it."""
        self._disconnect()
        self.watchdog.close()
        if not clean:
            return
        leftovers = sorted(self._written)
        stack = self._stack_file
        # A crash later in the interpreter's shutdown (a C extension's destructor) would write
        # faulthandler's traceback into the removed file, where nobody finds it: it goes to
        # stderr instead, where Python's own faulthandler writes it. Failing that, the file stays.
        if stack is not None and _is_empty(stack) and _fatal_to_stderr():
            leftovers.append(stack)
        for path in leftovers:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # one file that stays must not keep the others
                logger.warning("could not remove %s: %s", path, exc)

    # -- alarms -----------------------------------------------------------------------------
    def request_dump(self, reason: str = "manual") -> Alarm:
        """Make every rank of the job dump into one new event; returns the alarm."""
        if self.board is None or self.responder is None:
            event_id = new_event_id(reason)
            write_event(self.recorder, reason, event_id=event_id)
            return Alarm(0, event_id, reason, origin="local", time_ns=time.time_ns())
        origin = f"rank {self.recorder.global_rank}"
        return self.board.raise_alarm(reason, origin=origin, start=self.responder.epoch)

    def _counted_dump(self, alarm: Alarm) -> Path:
        """The responder's dump, counted for the metrics."""
        self.events["answered", alarm.reason] += 1
        try:
            path = self._dump_for(alarm)
        except BaseException:
            self.events["dump_failed", alarm.reason] += 1
            raise
        self.events["dumped", alarm.reason] += 1
        return path

    def _dump_for(self, alarm: Alarm) -> Path:
        return write_event(
            self.recorder,
            alarm.reason,
            event_id=alarm.event_id,
            extra=self.dump_extra() | {"alarm": dataclasses.asdict(alarm), "detail": alarm.detail},
        )

    def dump_extra(self) -> dict[str, Any]:
        """What every dump of this rank adds to its ``tether`` section (what it died of, the
        creation it waits in)."""
        extra: dict[str, Any] = {}
        if self.exception is not None:
            extra[EXCEPTION] = self.exception
        if (forming := self.forming) is not None:
            extra[FORMING] = forming.to_json()
        return extra

    def note_late(self, store: Any, late: Late | None) -> None:
        """A group's creation outlived the hang timeout here (``late``), or is over (None).
        Late, it is a hang like any other: the job's hang alarm makes every rank dump (each
        says where it is: the ranks that never arrived are elsewhere), and ``on_hang=abort``
        ends the job. Before the default group exists this rank has no responder: it raises
        the alarm through the group's store all the same (a launcher follows it, and reads the
        stacks of its ranks that do not answer), dumps itself into the event, and aborts."""
        self.forming = late
        if late is None:
            return
        set_rank(late.rank)  # before the default group forms, the log does not know it yet
        self.hang_policy.creation(late, store)

    def _dump_dir(self) -> Path:
        return dump_root(self.config.dump_dir)


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:  # gone already, or unreadable: nothing to remove
        return False


def _fatal_to_stderr() -> bool:
    """Point faulthandler's fatal-signal tracebacks at stderr; False where it cannot be."""
    if not faulthandler.is_enabled():
        return True
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, ValueError, RuntimeError):  # no stderr, or no descriptor
        return False
    return True
