"""Last words: before the launcher tears a job down, every surviving rank dumps.

:class:`tether.launcher.agent.TetherAgent` calls :func:`dump_before_teardown` at the moment torch
elastic would stop the workers, because a worker failed ("crash") or the launcher received a
death signal ("signal"). It raises a job-wide alarm through the job's store (each rank's responder
dumps into the alarm's event, which records the dead ranks), waits a bounded time for the
survivors' done keys, and prints one line on stderr. It never raises: the teardown goes on
whatever happens here.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._log import get_logger, say
from tether.events.columns import write_columns
from tether.events.exception import EXCEPTION
from tether.events.layout import rank_file, write_atomic
from tether.events.ringfile import read_ring
from tether.events.schema import LEFT
from tether.events.stacks import StacksHeader, stacks_file, write_stacks
from tether.job.alarm import DUMPED, EXITED, Alarm, AlarmBoard
from tether.job.client import (
    CONNECT_TIMEOUT_S,
    StoreAddress,
    await_answers,
    live_ranks,
    mark_exited,
)
from tether.job.nodes import span
from tether.job.stacks import fatal_block

__all__ = [
    "DUMP_GRACE_S",
    "Incident",
    "JobView",
    "describe_exit",
    "dump_before_teardown",
    "left_ranks",
    "recover_record",
    "worker_alive",
]

logger = get_logger(__name__)

DUMP_GRACE_S = 10.0
"""How long the launcher holds the teardown for the survivors' dumps (one takes about 1 s)."""
"""The done value the launcher sets for a local survivor that exits before it dumped."""
_WATCH_S = 0.1
FATAL_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")
"""The signals whose death faulthandler writes down (each rank arms it on its stack file); a
SIGKILL leaves nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class JobView:
    """What this launcher knows of the job, from torch elastic's worker group."""

    store: StoreAddress
    """The job's store: the TCPStore the workers use (torchrun's MASTER_ADDR / MASTER_PORT), or
    the job's keys in etcd (``--store``)."""
    world_size: int
    local_pids: dict[int, int]
    """Global rank -> pid of each worker this launcher started (other nodes' are unknown)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Incident:
    reason: str
    """"crash" (a worker failed) or "signal" (the launcher is being stopped)."""
    detail: str
    dead_ranks: dict[int, str] = dataclasses.field(default_factory=dict)
    """Global rank -> how it ended: "exit code 3", "signal SIGKILL"."""
    exceptions: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Global rank -> the exception it died of, from torchrun's error file
    (:mod:`tether.events.exception`), for the dead ranks that left one."""
    alarm: Alarm | None = None
    """The crash alarm a dead rank raised itself before it exited (it died of its own
    exception): the incident's event, instead of a new one."""
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    """Host -> what became of it ("lost"), for whole nodes the incident took."""

    def summary(self) -> str:
        if self.alarm is not None and self.alarm.nodes:
            return self.alarm.detail  # a node fault: the node, its ranks, when it went
        dead = {r: how for r, how in self.dead_ranks.items() if how != LEFT}
        left = sorted(r for r in self.dead_ranks if r not in dead)
        parts = []
        if len(dead) == 1:
            [(rank, how)] = dead.items()
            parts.append(f"rank {rank} died ({how})")
        elif dead:
            died = ", ".join(f"{r} ({how})" for r, how in sorted(dead.items()))
            parts.append(f"ranks {died} died")
        if left:
            parts.append(f"{span(left)} {LEFT} while the others went on")
        return "; ".join(parts) or self.detail


def describe_exit(exitcode: int) -> str:
    """A worker's exit status as the dumps record it: "exit code 3", "signal SIGKILL"."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def dump_before_teardown(
    job: JobView,
    incident: Incident,
    *,
    dump_dir: Path,
    grace: float = DUMP_GRACE_S,
    alive: Callable[[int], bool] | None = None,
    interrupts: tuple[type[BaseException], ...] = (),
    on_alarm: Callable[[Alarm], None] | None = None,
) -> str:
    """Have every surviving rank dump into one event, with the stacks of local ranks that died
    of a fatal signal; print and return what happened. ``on_alarm`` is told the alarm (hence the
    event) once it is raised.

    Nothing raised here stops the teardown, except ``interrupts`` (the launcher's own death
    signal, which must reach torch's agent)."""
    try:
        outcome = _dump_survivors(job, incident, dump_dir, grace, alive or worker_alive, on_alarm)
    except interrupts:
        raise
    except Exception as exc:  # the workers must be stopped whatever failed here
        logger.debug("alarm before teardown failed", exc_info=True)
        outcome = f"the other ranks could not be asked to dump: {exc}"
    line = f"tether run: {incident.summary()}; {outcome}"
    say(line)
    return line


def _dump_survivors(
    job: JobView,
    incident: Incident,
    dump_dir: Path,
    grace: float,
    alive: Callable[[int], bool],
    on_alarm: Callable[[Alarm], None] | None,
) -> str:
    store = job.store.connect()
    joined = live_ranks(store, job.world_size)
    # Ranks that returned while the others went on are part of what happened: named with the
    # dead (in the alarm), their records recovered like the dead's.
    left = {r: LEFT for r in left_ranks(joined, job.local_pids) if r not in incident.dead_ranks}
    if left:
        incident = dataclasses.replace(incident, dead_ranks={**incident.dead_ranks, **left})
    survivors = [
        rank
        for rank, info in sorted(joined.items())
        if rank not in incident.dead_ranks and _running(rank, info, job.local_pids, alive)
    ]
    last_words = _last_words(incident, joined, job.local_pids)
    rings = _ring_files(incident, joined, job.local_pids)
    if not survivors and not last_words and not rings:
        return "no surviving rank is recording, so nothing was dumped"
    alarm = incident.alarm or AlarmBoard(store).raise_alarm(
        incident.reason,
        origin="launcher",
        detail=f"{incident.summary()}; launcher on {socket.gethostname()}, pid {os.getpid()}",
        dead_ranks={str(rank): how for rank, how in incident.dead_ranks.items()},
        nodes=incident.nodes,
    )
    event_dir = dump_dir / alarm.event_id
    if on_alarm is not None:
        on_alarm(alarm)
    kept = _keep_last_words(event_dir, alarm, last_words)
    kept += _recover(event_dir, alarm, rings, incident)
    if not survivors:
        return "; ".join(["no surviving rank is recording, so nothing was dumped", *kept])
    local = {r: pid for r, pid in job.local_pids.items() if r in survivors}
    with _ExitWatch(store, alarm, local, alive):
        result = await_answers(
            store, alarm, survivors, grace, running=lambda r: r not in local or alive(local[r])
        )
    by_what: dict[str, list[int]] = {}
    for rank, what in result.answered.items():
        kind = what if what in (DUMPED, EXITED) else "stacks"
        by_what.setdefault(kind, []).append(rank)
    parts = []
    dumped = by_what.get(DUMPED, [])
    # On several nodes each dumps onto its own disk; its launcher sends its part to this event.
    here = [r for r in dumped if r in job.local_pids]
    if here:
        parts.append(f"{span(here)} dumped into {event_dir}")
    if elsewhere := [r for r in dumped if r not in job.local_pids]:
        nodes = "its own node" if len(elsewhere) == 1 else "their own nodes"
        parts.append(
            f"{span(elsewhere)} dumped on {nodes}" + ("" if here else f" (event {event_dir})")
        )
    if "stacks" in by_what:
        where = "" if DUMPED in by_what else f" into {event_dir}"
        parts.append(f"{span(by_what['stacks'])} looked stuck: only stacks collected{where}")
    if not parts:
        parts.append("nothing was dumped")
    if EXITED in by_what:
        parts.append(f"{span(by_what[EXITED])} exited before dumping")
    if result.missing:
        parts.append(f"{span(result.missing)} did not answer within {grace:g}s")
    return "; ".join([*parts, *kept])


def left_ranks(joined: dict[int, dict[str, Any]], local_pids: dict[int, int]) -> list[int]:
    """The local workers that said, as they exited cleanly, that they left the job while still
    a member of its groups (``left`` in what they published)."""
    return [
        rank
        for rank, info in sorted(joined.items())
        if info.get("left") and info.get("pid") == local_pids.get(rank)
    ]


def _last_words(
    incident: Incident, joined: dict[int, dict[str, Any]], local_pids: dict[int, int]
) -> dict[int, tuple[dict[str, Any], str, str]]:
    """Rank -> (what it published, its signal, what faulthandler wrote as it died), for the
    local ranks that died of a fatal signal."""
    out = {}
    for rank, how in sorted(incident.dead_ranks.items()):
        name = how.removeprefix("signal ")
        info = joined.get(rank, {})
        path = info.get("stack_file")
        if name not in FATAL_SIGNALS or not isinstance(path, str):
            continue
        if local_pids.get(rank) is None or info.get("pid") != local_pids[rank]:
            continue  # another node's worker, or an earlier attempt's entry
        block = fatal_block(Path(path))
        if block is not None:
            out[rank] = (info, name, block)
    return out


def _keep_last_words(
    event_dir: Path, alarm: Alarm, last_words: dict[int, tuple[dict[str, Any], str, str]]
) -> list[str]:
    """Write each dead rank's last words into the event; what to say about it."""
    kept = []
    for rank, (info, name, block) in last_words.items():
        header: StacksHeader = {
            "rank": rank,
            "host": str(info.get("host")),
            "pid": int(info["pid"]),
            "method": "fatal-signal",
            "when": "death",
            "event": alarm.event_id,
            "state": "dead",
            "syscall": None,
            "signal": name,
        }
        try:
            write_stacks(stacks_file(event_dir, rank), header, block)
            kept.append(f"rank {rank}'s stacks at its {name} are in {event_dir}")
        except OSError as exc:
            logger.warning("could not write rank %d's stacks at its death: %s", rank, exc)
    return kept


def _ring_files(
    incident: Incident, joined: dict[int, dict[str, Any]], local_pids: dict[int, int]
) -> dict[int, Path]:
    """Rank -> its ring file, for the local ranks that died: their record outlives them there."""
    out = {}
    for rank in sorted(incident.dead_ranks):
        info = joined.get(rank, {})
        path = info.get("ring_file")
        if not isinstance(path, str) or local_pids.get(rank) != info.get("pid"):
            continue  # an older tether, another node's worker, or an earlier attempt's entry
        if Path(path).is_file():
            out[rank] = Path(path)
    return out


def _recover(
    event_dir: Path, alarm: Alarm, rings: dict[int, Path], incident: Incident
) -> list[str]:
    """Turn each dead rank's ring file into its dump in the event (unless it dumped itself
    before it died), then remove the file; what to say about it."""
    kept = []
    for rank, path in rings.items():
        died = incident.dead_ranks[rank]
        if recover_record(event_dir, alarm, rank, path, died, incident.exceptions.get(rank)):
            kept.append(f"rank {rank}'s record was recovered from its ring file")
    return kept


def recover_record(
    event_dir: Path,
    alarm: Alarm,
    rank: int,
    path: Path,
    how: str,
    exception: dict[str, Any] | None = None,
) -> bool:
    """Write the record in ``path`` (a ring file outliving its process, which ended ``how``)
    as ``rank``'s dump in the event, unless the rank dumped itself; then remove the file. True
    if a record was written."""
    target = rank_file(event_dir, rank)
    written = False
    try:
        if not target.exists():
            after = f"it {how}" if how == LEFT else f"its death ({how})"
            data = read_ring(path, how=f"its ring file, read after {after}")
            data["tether"].update(
                event=alarm.event_id,
                reason=alarm.reason,
                global_rank=rank,
                # Who died, as every dump of the event says it: the one dump read may be this.
                alarm=dataclasses.asdict(alarm),
            )
            if how == LEFT:
                data["tether"]["left"] = True
            if exception is not None:
                data["tether"][EXCEPTION] = exception
            write_atomic(target, pickle.dumps(data, protocol=4))
            written = True
            try:
                write_columns(data, event_dir, rank)
            except OSError as exc:  # the record is written: the analyzer reads it instead
                logger.warning("no column file for rank %d's record: %s", rank, exc)
        path.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:  # a torn or foreign file: the rest goes on
        logger.warning("could not recover rank %d's record from %s: %s", rank, path, exc)
    return written


class _ExitWatch:
    """While the launcher waits for answers, settle the part of each local survivor that exits
    first (typically every rank raising the same error): the wait then ends once nobody is left
    to answer, instead of at the grace's end."""

    def __init__(
        self, store: Any, alarm: Alarm, pids: dict[int, int], alive: Callable[[int], bool]
    ) -> None:
        self._board = AlarmBoard(store).clone()  # the main thread blocks on the other connection
        self._alarm = alarm
        self._pending = dict(pids)
        self._alive = alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-exit-watch", daemon=True)

    def __enter__(self) -> _ExitWatch:
        if self._pending:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=CONNECT_TIMEOUT_S)

    def _run(self) -> None:
        while self._pending and not self._stop.wait(_WATCH_S):
            for rank, pid in list(self._pending.items()):
                try:
                    if not self._alive(pid):
                        del self._pending[rank]
                        mark_exited(self._board.store, self._alarm, rank, EXITED)
                except Exception:  # one failed check must not end the watch of the others
                    logger.debug("exit watch of rank %d failed", rank, exc_info=True)


def _running(
    rank: int, info: dict[str, Any], local_pids: dict[int, int], alive: Callable[[int], bool]
) -> bool:
    pid = local_pids.get(rank)
    if pid is None:
        return True  # another node's worker: only its own launcher knows whether it runs
    # A restarted job keeps its store: a key published by the previous attempt does not count.
    return info.get("pid") == pid and alive(pid)


def worker_alive(pid: int) -> bool:
    """Whether our child ``pid`` is still running (not exited, reaped or not)."""
    if hasattr(os, "waitid"):
        try:
            # WNOWAIT only peeks: torch's own poll still collects the exit status.
            return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # already reaped
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
