"""The responder: one named daemon thread per rank that waits for job-wide alarms and answers
them: dump this rank into the alarm's event, collect the stacks of same-host peers that cannot
answer (stuck holding the GIL), then abort if the alarm says so.

It blocks on the store's wait for the next alarm key on a connection of its own, so it answers
within one store round trip of the alarm, and it never needs the main thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._log import get_logger
from tether.watchdog.alarm import Alarm, AlarmBoard
from tether.watchdog.stacks import collect_signal_stacks

__all__ = ["HANG_EXIT_CODE", "Responder"]

logger = get_logger(__name__)

HANG_EXIT_CODE = 75
"""Exit status of a rank aborted after a hang (EX_TEMPFAIL: a restart may succeed)."""
RESCUE_AFTER_S = 3.0
"""How long a rank waits for same-host peers to answer before collecting their stacks."""
ABORT_GRACE_S = 30.0
"""How long an aborting rank waits for every rank's part of the event before exiting."""
LEAVE_GRACE_S = 2.0
"""How long aborting ranks wait for each other so that they exit together."""
MAX_STORE_FAILURES = 5
"""Consecutive failures to reach the store (backing off) before the responder gives up."""
WAIT_S = 3600.0
"""One blocking wait for the next alarm. The store logs each timeout, so it is long; the thread
is a daemon blocked in C++ without the GIL, and is not joined at exit."""


class Responder:
    def __init__(
        self,
        board: AlarmBoard,
        *,
        rank: int,
        world_size: int,
        host: str,
        dump: Callable[[Alarm], Path],
        event_dir: Callable[[str], Path],
        abort_on: Callable[[Alarm], bool],
    ) -> None:
        self.board = board
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self._dump = dump
        self._event_dir = event_dir
        self._abort_on = abort_on
        self.epoch = self._first_unused_epoch()
        self.handled: list[Alarm] = []
        self.answered = 0
        """Alarms answered so far (successfully or not)."""
        self._answered_cv = threading.Condition()
        self.aborting: Alarm | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-alarms", daemon=True)

    def _first_unused_epoch(self) -> int:
        # A restarted job (torchrun --max-restarts) keeps its store: skip the old incidents.
        epoch = 1
        while self.board.get(epoch) is not None:
            epoch += 1
        return epoch

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def raise_alarm(self, reason: str, detail: str, event_id: str) -> Alarm:
        """Raise an alarm for the incident this rank is in, or join an alarm of the same reason
        that another rank raised and this one has not answered yet (the same incident, seen
        from elsewhere). Alarms of other reasons are passed over."""
        epoch = self.epoch
        while True:
            alarm = Alarm(
                epoch=epoch,
                event_id=event_id,
                reason=reason,
                origin=f"rank {self.rank}",
                detail=detail,
                time_ns=time.time_ns(),
            )
            got = self.board.raise_alarm(alarm)
            if got == alarm or got.reason == reason:
                return got
            epoch += 1

    def _run(self) -> None:
        waiter = self.board.clone()  # blocking waits must not hold the shared connection
        failures = 0
        while not self._stop.is_set():
            try:
                alarm = waiter.wait(self.epoch, timeout=WAIT_S)
                failures = 0
            except Exception as exc:  # the store is unreachable: the job is probably ending
                failures += 1
                if failures >= MAX_STORE_FAILURES:
                    logger.warning("job store unreachable (%s); no longer answering alarms", exc)
                    return
                self._stop.wait(min(2.0**failures, 30.0))
                continue
            if alarm is None:
                continue
            # Before answering: this rank's watchdog may see the same hang meanwhile.
            self.epoch = alarm.epoch + 1
            self.handled.append(alarm)
            try:
                self.answer(alarm)
            except Exception:  # answer the next alarm even if this one failed
                logger.exception("could not answer alarm %s", alarm.event_id)
            with self._answered_cv:
                self.answered += 1
                self._answered_cv.notify_all()

    def wait_answered(self, after: int, timeout: float) -> bool:
        """Wait until more than ``after`` alarms have been answered; False on timeout."""
        with self._answered_cv:
            return self._answered_cv.wait_for(lambda: self.answered > after, timeout)

    def answer(self, alarm: Alarm) -> None:
        path = self._dump(alarm)
        self.board.mark_done(alarm.epoch, self.rank, "dump")
        logger.info("dumped %s for %s alarm from %s", path, alarm.reason, alarm.origin)
        self._rescue_stuck_peers(alarm)
        if self._abort_on(alarm):
            self._abort(alarm)

    def _rescue_stuck_peers(self, alarm: Alarm) -> None:
        procs = self.board.procs(self.world_size)
        local = sorted(r for r, p in procs.items() if p.get("host") == self.host)
        peers = [r for r in local if r != self.rank and str(r) not in alarm.dead_ranks]
        if not peers:
            return
        done = self.board.wait_done(alarm.epoch, peers, RESCUE_AFTER_S)
        stuck = [r for r in peers if r not in done]
        # The lowest-ranked rank of this host that answered collects for the others.
        answered = [r for r in local if r == self.rank or r in done]
        if not stuck or min(answered) != self.rank:
            return
        late = self.board.done(alarm.epoch, self.world_size)  # answered while we decided
        for rank in (r for r in stuck if r not in late):
            info: dict[str, Any] = procs[rank]
            text = collect_signal_stacks(int(info["pid"]), Path(info["stack_file"]))
            if text is None:
                continue
            _write_text(
                self._event_dir(alarm.event_id) / f"stacks_{rank}.txt",
                _stack_header(rank, info, alarm) + text,
            )
            self.board.mark_done(alarm.epoch, rank, f"stacks collected by rank {self.rank}")
            logger.warning("rank %d did not answer; collected its stacks through a signal", rank)

    def _abort(self, alarm: Alarm) -> None:
        self.aborting = alarm
        others = [r for r in range(self.world_size) if r != self.rank]
        done = self.board.wait_done(alarm.epoch, others, ABORT_GRACE_S)
        # Leave together: the first rank to exit breaks its peers' connections, and a peer whose
        # main thread sees that first would fail with an unrelated error instead of aborting.
        self.board.mark_done(alarm.epoch, self.rank, "leaving", phase="leaving")
        answering = [r for r, what in done.items() if what == "dump"]
        self.board.wait_done(alarm.epoch, answering, LEAVE_GRACE_S, phase="leaving")
        self.exit_if_aborting()

    def exit_if_aborting(self) -> None:
        """Exit with :data:`HANG_EXIT_CODE` once an abort has been decided. Also called at
        interpreter exit: a main thread that fails because a peer left first must not turn the
        abort into an unrelated error."""
        alarm = self.aborting
        if alarm is None:
            return
        print(
            f"[rank {self.rank}] tether: {alarm.reason} ({alarm.detail}); every rank's dump is in "
            f"{self._event_dir(alarm.event_id)}; aborting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HANG_EXIT_CODE)


def _stack_header(rank: int, info: dict[str, Any], alarm: Alarm) -> str:
    return (
        f"# rank {rank} (host {info.get('host')}, pid {info.get('pid')}) did not answer "
        f"{alarm.reason} alarm {alarm.event_id}; its threads, written by faulthandler:\n"
    )


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
