"""The responder: one named daemon thread per rank that waits for job-wide alarms and answers
them: dump this rank into the alarm's event, collect the stacks of same-host peers that cannot
answer (stuck holding the GIL), then abort if the alarm says so.

Collecting a peer's stacks here means signalling it (faulthandler writes them from the signal
handler), and the signal interrupts the system call the peer is stuck in: a C call that does not
retry on EINTR returns, and the rank reaches the hung collective late. So this is only the
fallback: where ``tether run``'s agent reads this host's stacks from outside (it sets
:func:`~tether.job.stacks.agent_key`), no responder signals a peer.

Under ``tether run`` it hears of each alarm from the node's agent (:mod:`tether.job.relay`),
which alone looks in the store for the node: the store then sees no request from a rank while
no alarm is raised. Otherwise (launched by torchrun alone, or let go of by its agent) it looks
for the next alarm key on a store connection of its own, every :func:`poll_period`, so it
answers within that period of the alarm. Either way it never needs the main thread.

An agent that died (killed, out of memory) leaves its ranks orphans: torch starts each worker in
a session of its own, so nothing ends them, and nothing would restart, read or report them. A
rank whose relay closes and whose parent, the agent, is gone stops at once, saying so
(:data:`ORPHANED_EXIT_CODE`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._exceptions import AgentGoneError, BadAlarmError
from tether._log import get_logger, say
from tether.events.stacks import StacksHeader, stacks_file, write_stacks
from tether.job.alarm import (
    ABORTING,
    DUMP_FAILED,
    DUMPED,
    HANG_EXIT_CODE,
    LEAVING,
    Alarm,
    AlarmBoard,
    answered_itself,
)
from tether.job.nodes import span
from tether.job.relay import RelayClient
from tether.job.stacks import agent_key, collect_signal_stacks, node_ranks

__all__ = ["Responder"]

logger = get_logger(__name__)

RESCUE_AFTER_S = 3.0
"""How long a rank waits for same-host peers to answer before collecting their stacks."""
ABORT_GRACE_S = 30.0
"""How long an aborting rank waits for every rank's part of the event before exiting."""
LEAVE_GRACE_S = 2.0
"""How long aborting ranks wait for each other so that they exit together."""
MAX_STORE_FAILURES = 5
"""Consecutive failures to reach the store (backing off) before the responder gives up."""
BAD_KEY_LOG_EVERY_S = 60.0
"""At most one warning per this many seconds about alarm keys that hold no valid alarm."""
POLL_S = 0.1
"""How often a rank looks for the next alarm: one store round trip (~10 µs) a look. A blocking
wait would answer a round trip sooner, but a thread blocked in the store when the interpreter
finalizes is killed there: if the store's host exits meanwhile (rank 0 hosting it and ending
first), the wait returns with an error into a finalizing interpreter and the process aborts
("terminate called without an active exception": 3 of 5 clean exits of a 3-rank job here).
Looks are short, and :meth:`Responder.close` joins the thread. torch's NCCL monitor polls its
dump signal in the store too, once a second."""
MAX_LOOKS_PER_S = 5000.0
"""The store answers at most this many looks a second from the whole job: past 500 ranks each
looks less often (at most once a second past 5000)."""


RELAY_WAIT_S = 0.5
"""The longest a wait on the agent's relay lasts before the thread looks whether it must stop
(:meth:`Responder.close` joins it within 2 s)."""
ORPHAN_CHECK_S = 1.0
"""How long a rank whose relay closed watches for its parent, the agent, to be gone: the kernel
gives an orphan its new parent only after the dead agent's sockets are closed."""
ORPHANED_EXIT_CODE = 69
"""The exit status of a rank that stopped because its node's agent died (``EX_UNAVAILABLE``:
what supervised it is gone)."""
RELAY_CONNECT_S = 30.0
"""How long a rank tries to reach its agent's relay (the agent starts it as its workers start;
meanwhile the rank looks in the store itself) before it keeps to the store."""


def poll_period(world_size: int) -> float:
    """Seconds between two looks for an alarm, for a job of ``world_size`` ranks."""
    return min(max(POLL_S, world_size / MAX_LOOKS_PER_S), 1.0)


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
        attempt: int = 0,
        relay: str = "",
        stop_if_orphaned: bool = False,
    ) -> None:
        self.board = board
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.attempt = attempt
        """torchrun's restart count: ``tether/proc`` entries of other attempts are stale."""
        self._dump = dump
        self._event_dir = event_dir
        self._abort_on = abort_on
        self._bad_keys = 0
        self._bad_log_at = 0.0
        # The thread's own connection: its blocking waits must not hold up the shared one.
        self._own = board.clone()
        self.epoch = self._first_unused_epoch()
        self.handled: list[Alarm] = []
        self.answered = 0
        """Alarms answered so far (successfully or not)."""
        self._answered_cv = threading.Condition()
        self._answering = False
        """An alarm is being answered (under ``_answered_cv``): whether it aborts is not known."""
        self.aborting: Alarm | None = None
        self._abort_parts: dict[int, str] = {}
        """What each rank's part of the aborting alarm said when this rank left."""
        self._left = threading.Event()
        """Set once an abort has waited for the other ranks' parts (or given up on them)."""
        self._stop = threading.Event()
        self._relay_name = relay
        """The node agent's relay to reach (empty: none, reached, or given up on)."""
        self._relay: RelayClient | None = None
        self._parent = os.getppid() if stop_if_orphaned else None
        """The process that started this rank (under ``tether run``, the node's agent), where
        this rank stops once that agent died (an elastic worker's own thread raises instead)."""
        self._store_failures = 0
        """Consecutive looks in the store that could not reach it."""
        self.period = poll_period(world_size)
        """Seconds between two looks in the store."""
        self._thread = threading.Thread(target=self._run, name="tether-alarms", daemon=True)

    def _first_unused_epoch(self) -> int:
        # A restarted job (torchrun --max-restarts) keeps its store: skip the old incidents.
        epoch = 1
        while self._taken(epoch):
            epoch += 1
        return epoch

    def _taken(self, epoch: int) -> bool:
        try:
            return self.board.get(epoch) is not None
        except BadAlarmError as exc:
            self.pass_over(epoch, exc)
            return True

    def pass_over(self, epoch: int, exc: BadAlarmError) -> None:
        """Log an alarm key that holds no alarm, rate-limited: whoever writes them may write
        many, and the job must go on answering the real ones."""
        self._bad_keys += 1
        now = time.monotonic()
        if now < self._bad_log_at:
            return
        self._bad_log_at = now + BAD_KEY_LOG_EVERY_S
        logger.warning(
            "passing over %s: not a valid alarm (%s); %d such key(s) so far",
            self.board.key(epoch),
            exc,
            self._bad_keys,
        )

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop answering alarms; wait up to ``timeout`` seconds for an answer in progress (or a
        look at the store) to end."""
        self._stop.set()
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("tether-alarms still answering an alarm after %.1fs", timeout)

    def _run(self) -> None:
        agent_deadline = time.monotonic() + RELAY_CONNECT_S
        try:
            while not self._stop.is_set():
                if self._relay_name and self._relay is None:
                    self.reach_agent(agent_deadline)
                if self._relay is not None:
                    alarm = self.from_agent(RELAY_WAIT_S)
                    if alarm is not None and not self.handle(alarm):
                        return
                    continue
                wait = self.look_in_store()
                if wait is None:
                    return
                self._stop.wait(wait)
        finally:
            if self._relay is not None:
                self._relay.close()

    # reach_agent, from_agent, look_in_store and handle are the steps of this responder's own
    # thread; they are public for one thread that drives many responders whose threads were not
    # started (bench/scale.py's simulated ranks), never to be called beside a started thread.

    def fileno(self) -> int:
        """The agent's relay connection's descriptor (-1 without one): what a caller that waits
        on many ranks' relays at once (a simulation of many ranks) selects on."""
        return self._relay.fileno() if self._relay is not None else -1

    @property
    def alarm_source(self) -> str:
        """``agent`` while the node's agent relays the alarms, else ``store``."""
        return "agent" if self._relay is not None else "store"

    def reach_agent(self, deadline: float) -> None:
        """Connect to the agent's relay; past ``deadline``, stop trying. Nothing raised before
        is missed: the agent sends a rank that connects the alarms it relayed before, and it
        began looking before this rank was started."""
        try:
            self._relay = RelayClient.connect(self._relay_name)
        except OSError as exc:
            if time.monotonic() > deadline:
                logger.warning("no alarm relay from this node's agent (%s): using the store", exc)
                self._relay_name = ""
            return
        logger.debug("alarms come from this node's agent from now on")
        self._relay_name = ""

    def from_agent(self, timeout: float) -> Alarm | None:
        """The next alarm the agent relays within ``timeout`` seconds that this rank has not
        answered, else None. An agent gone is said once, and the store is looked in instead."""
        assert self._relay is not None
        try:
            alarm = self._relay.next(timeout)
        except AgentGoneError as exc:
            if not self._stop.is_set() and self._orphaned():
                say(
                    f"[rank {self.rank}] tether: this node's tether run is gone ({exc}) and "
                    "nothing supervises this rank any more: stopping it"
                )
                os._exit(ORPHANED_EXIT_CODE)
            if not self._stop.is_set():
                logger.warning("%s: looking for alarms in the job's store itself", exc)
            self._relay.close()
            self._relay = None
            return None
        if alarm is None or alarm.epoch < self.epoch:  # nothing yet, or one answered before
            return None
        return alarm

    def _orphaned(self) -> bool:
        """Whether the agent that started this rank died, not only its relay: an orphan gets
        another parent (init, or a subreaper), within :data:`ORPHAN_CHECK_S`. A rank the agent
        let go of (ending, or dropped for reading nothing) keeps its parent."""
        if self._parent is None:
            return False
        deadline = time.monotonic() + ORPHAN_CHECK_S
        while os.getppid() == self._parent:
            if time.monotonic() >= deadline or self._stop.wait(0.05):
                return False
        return True

    def look_in_store(self) -> float | None:
        """One look for the next alarm in the store, and its answer; how long to wait before
        the next look, or None once the thread must end (closed, or the store unreachable
        :data:`MAX_STORE_FAILURES` times running)."""
        try:
            alarm = self._own.get(self.epoch)
        except BadAlarmError as exc:  # the store answered: not a failure to reach it
            self._store_failures = 0
            self.pass_over(self.epoch, exc)
            self.epoch += 1
            return 0.0
        except Exception as exc:  # the store is unreachable: the job is probably ending
            self._store_failures += 1
            if self._store_failures >= MAX_STORE_FAILURES:
                logger.warning("job store unreachable (%s); no longer answering alarms", exc)
                return None
            return min(2.0**self._store_failures, 30.0)
        self._store_failures = 0
        if alarm is None:
            return self.period
        return 0.0 if self.handle(alarm) else None

    def handle(self, alarm: Alarm) -> bool:
        """Answer ``alarm``; False if this responder was closed meanwhile."""
        if self._stop.is_set():
            return False  # replaced (a new default group): its responder answers
        # Before answering: this rank's watchdog may see the same hang meanwhile.
        self.epoch = alarm.epoch + 1
        self.handled.append(alarm)
        with self._answered_cv:
            self._answering = True
            self._answered_cv.notify_all()
        try:
            self.answer(alarm)
        except Exception:  # answer the next alarm even if this one failed
            logger.exception("could not answer alarm %s", alarm.event_id)
        finally:
            with self._answered_cv:
                self._answering = False
                self.answered += 1
                self._answered_cv.notify_all()
        return True

    def wait_answered(self, after: int, timeout: float) -> bool:
        """Wait until more than ``after`` alarms have been answered; False on timeout."""
        with self._answered_cv:
            return self._answered_cv.wait_for(lambda: self.answered > after, timeout)

    def answer(self, alarm: Alarm) -> None:
        """Dump, collect stuck peers' stacks, abort if the alarm says so. A failed step never
        skips the next, least of all the abort: a hung rank that stays hangs the job."""
        self._mark_done(alarm, self._dump_part(alarm))
        try:
            self._rescue_stuck_peers(alarm)
        except Exception:
            logger.exception("could not collect stuck peers' stacks for alarm %s", alarm.event_id)
        if self._abort_on(alarm):
            self._abort(alarm)

    def _dump_part(self, alarm: Alarm) -> str:
        """Write this rank's dump; what its done key says."""
        try:
            path = self._dump(alarm)
        except Exception as exc:
            logger.error("could not dump for %s alarm %s: %s", alarm.reason, alarm.event_id, exc)
            return f"{DUMP_FAILED}: {exc}"
        logger.info("dumped %s for %s alarm from %s", path, alarm.reason, alarm.origin)
        return DUMPED

    def _mark_done(self, alarm: Alarm, what: str) -> None:
        try:
            self._own.mark_done(alarm.epoch, self.rank, what)
        except Exception as exc:  # peers wait for the key until their grace ends; go on
            logger.warning("could not mark alarm %s answered: %s", alarm.event_id, exc)

    def _agent_reads_stacks(self) -> bool:
        """Whether the launcher's agent on this host reads the stacks of its silent ranks."""
        return bool(self._own.store.check([agent_key(self.host)]))

    def agent_watches(self) -> bool:
        """Whether a launcher's agent on this host follows the job's alarms (from any thread)."""
        return bool(self.board.store.check([agent_key(self.host)]))

    def _rescue_stuck_peers(self, alarm: Alarm) -> None:
        if self._agent_reads_stacks():
            return  # read from outside, undisturbed: a signal would change what they do
        procs = self._own.procs(self.world_size, attempt=self.attempt)
        local = sorted({self.rank} | {r for r, p in procs.items() if p.get("host") == self.host})
        peers = [r for r in local if r != self.rank and str(r) not in alarm.dead_ranks]
        if not peers:
            return
        done = self._own.wait_done(alarm.epoch, peers, RESCUE_AFTER_S)
        stuck = [r for r in peers if r not in done]
        # The lowest-ranked rank of this host that answered collects for the others.
        answered = [r for r in local if r == self.rank or r in done]
        if not stuck or min(answered) != self.rank:
            return
        late = self._own.done(alarm.epoch, self.world_size)  # answered while we decided
        for rank in (r for r in stuck if r not in late):
            try:
                self._rescue(alarm, rank, procs[rank])
            except Exception:  # the next stuck peer may still be rescued
                logger.exception("could not collect the stacks of rank %d", rank)

    def _rescue(self, alarm: Alarm, rank: int, info: dict[str, Any]) -> None:
        start_time = info.get("start_time")
        text = collect_signal_stacks(
            int(info["pid"]),
            Path(info["stack_file"]),
            start_time=start_time if isinstance(start_time, int) else None,
        )
        if text is None:
            return
        header, preamble = _stack_header(rank, info, alarm)
        write_stacks(stacks_file(self._event_dir(alarm.event_id), rank), header, preamble + text)
        self._own.mark_done(alarm.epoch, rank, f"stacks collected by rank {self.rank}")
        logger.warning("rank %d did not answer; collected its stacks through a signal", rank)

    def _abort(self, alarm: Alarm) -> None:
        with self._answered_cv:
            self.aborting = alarm
            self._answered_cv.notify_all()
        try:
            # Said at once: a rank dying from here on is this abort's teardown, not a new
            # incident (the launcher reads it, and raises no crash alarm of its own).
            self._own.mark_done(alarm.epoch, self.rank, ABORTING, phase=ABORTING)
            self._leave_together(alarm)
        except Exception as exc:  # the store is gone: leave alone
            logger.warning("could not wait for the other ranks before aborting: %s", exc)
        self._left.set()
        self.exit_if_aborting()

    def _leave_together(self, alarm: Alarm) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        done = self._own.wait_done(alarm.epoch, others, ABORT_GRACE_S)
        # Leave together: the first rank to exit breaks its peers' connections, and a peer whose
        # main thread sees that first would fail with an unrelated error instead of aborting.
        self._own.mark_done(alarm.epoch, self.rank, LEAVING, phase=LEAVING)
        answering = [r for r, what in done.items() if answered_itself(what)]
        self._abort_parts = done
        self._own.wait_done(alarm.epoch, answering, LEAVE_GRACE_S, phase=LEAVING)

    def _settle(self) -> None:
        """Wait (bounded) until an alarm that has reached this rank is answered or aborts it.

        An answer decides whether this rank aborts (a late rank's dump is the event's evidence),
        and the interpreter must not finalize under the thread: a daemon thread that comes back
        from C++ (the store's wait returning the alarm, a dump) into a finalizing interpreter is
        ended by ``pthread_exit``, whose unwinding through torch's bindings calls
        ``std::terminate``: SIGABRT, "terminate called without an active exception"."""
        with self._answered_cv:
            if not self._answering and self.aborting is None and self._pending():
                before = self.answered
                self._answered_cv.wait_for(
                    lambda: self._answering or self.aborting is not None or self.answered > before,
                    ABORT_GRACE_S,
                )
            self._answered_cv.wait_for(
                lambda: self.aborting is not None or not self._answering, ABORT_GRACE_S
            )

    def _pending(self) -> bool:
        """An alarm this rank has not taken up yet is in the store (read without blocking)."""
        if not self._thread.is_alive() or self._stop.is_set():
            return False
        try:
            return bool(self.board.store.check([self.board.key(self.epoch)]))
        except Exception:  # the store is gone: no alarm will be answered
            return False

    def exit_if_aborting(self) -> None:
        """Exit with :data:`HANG_EXIT_CODE` once an abort has been decided. Also called at
        interpreter exit: a main thread that fails because a peer left first must not turn the
        abort into an unrelated error."""
        if threading.current_thread() is not self._thread:
            self._settle()
        alarm = self.aborting
        if alarm is None:
            return
        if threading.current_thread() is not self._thread:
            # The main thread reached its exit while this thread still waits for the others'
            # parts (a late rank caught up and the script finished): leaving now would break
            # the late rank's collectives mid-dump, and its dump is the event's evidence.
            self._left.wait(ABORT_GRACE_S + LEAVE_GRACE_S + 1.0)
        try:
            here = node_ranks(self._own.store, self.host)
        except Exception:  # the store is gone: say what is known
            here = None
        where = _who_dumped(
            self._abort_parts, self.world_size, self.rank, self._event_dir(alarm.event_id), here
        )
        say(f"[rank {self.rank}] tether: {alarm.reason} ({alarm.detail}); {where}; aborting")
        os._exit(HANG_EXIT_CODE)


def _who_dumped(
    parts: dict[int, str],
    world_size: int,
    me: int,
    event_dir: Path,
    here: list[int] | None = None,
) -> str:
    """What an aborting rank says of the event: every rank's dump is in it, or how many ranks
    dumped and what each of the others' part says (stacks read by the launcher, ...). ``here``:
    this node's ranks, on a job of several nodes (the others' dumps are on their own disks
    until ``tether run`` brings them to node 0)."""
    if not parts:  # the store went away before the answers could be read
        return f"this rank's dump is in {event_dir} (the others' answers are unknown)"
    parts = {**parts, me: parts.get(me, DUMPED)}
    dumped = [r for r, what in parts.items() if what == DUMPED]
    if here is not None:
        mine = sorted(r for r in dumped if r in here)
        these = span(mine) if mine else "none"
        where = (
            f"{len(dumped)} of {world_size} ranks dumped, this node's ({these}) into "
            f"{event_dir}; tether run brings the others' to node 0"
        )
        if len(dumped) == world_size:
            return where
        dumped_text = where
    elif len(dumped) == world_size:
        return f"every rank's dump is in {event_dir}"
    else:
        dumped_text = f"{len(dumped)} of {world_size} ranks dumped into {event_dir}"
    others = [
        f"rank {r} did not dump: {parts[r]}" if r in parts else f"rank {r} did not answer"
        for r in range(world_size)
        if r not in dumped
    ]
    return "; ".join([dumped_text, *others])


def _stack_header(rank: int, info: dict[str, Any], alarm: Alarm) -> tuple[StacksHeader, str]:
    """The header of a stacks file written for a silent peer, and the comment that opens it."""
    pid = info.get("pid")
    header: StacksHeader = {
        "rank": rank,
        "host": str(info.get("host")),
        "method": "faulthandler",
        "when": "unresponsive",
        "event": alarm.event_id,
        "state": None,
        "syscall": None,
        "note": "a same-host peer signalled it: the signal interrupts the system call it was in",
    }
    if isinstance(pid, int):
        header["pid"] = pid
    return header, (
        f"# rank {rank} (host {info.get('host')}, pid {pid}) did not answer "
        f"{alarm.reason} alarm {alarm.event_id}; its threads, written by faulthandler:\n"
    )
