"""The agent's alarm watch: one named daemon thread per ``tether run`` process (one per host)
that follows the job's alarms through its store and, for every local worker that does not
answer one in time and is alive, reads its stacks from outside and answers for it.

Reading from outside (py-spy, :mod:`tether.launcher.stackread`) never stops or signals the
worker: a rank stuck in a C call that does not retry on EINTR stays stuck, instead of returning
early and reaching the hung collective late (which is what the responders' faulthandler signal
did). Where py-spy is missing or cannot read the rank, the watch falls back to the stack signal
itself (and says so in the file's header). While it runs it publishes
:func:`tether.job.stacks.agent_key` for its host, and the responders there leave their peers
alone. Marking the rank's done key lets the ranks that
wait for every part of the event (an abort) go on at once, instead of waiting out their grace.

Once the answers are in it prints one line per alarm (the launcher's own crash and signal alarms
print theirs in :mod:`tether.launcher.teardown`).

It also runs the node's one look for alarms (:class:`~tether.job.relay.AlarmLook`), which hands
each alarm at once to the workers through the node's relay (:mod:`tether.job.relay`: they then
never look in the store themselves), and to the watch, which may be busy with an earlier alarm
for up to :data:`SUMMARY_WAIT_S`. On a job of several nodes the look's answers are also the
node's word that the job's store answers it (:meth:`~tether.launcher.cluster.Cluster.follow`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether._exceptions import BadAlarmError
from tether._log import get_logger, say
from tether.events.layout import clock, nodes_file, rank_file, write_atomic
from tether.events.schema import LEFT
from tether.events.stacks import StacksHeader, stacks_file, write_stacks
from tether.job.alarm import ABORTING, DUMPED, Alarm, AlarmBoard, answered_itself
from tether.job.client import StoreAddress
from tether.job.nodes import span
from tether.job.relay import AlarmLook, RelayServer
from tether.job.stacks import agent_key, collect_signal_stacks, process_start_time
from tether.launcher.cluster import REJOIN_S, Cluster
from tether.launcher.gather import SEND_TIMEOUT_S, probe
from tether.launcher.stackread import (
    PySpyError,
    answering,
    find_py_spy,
    proc_state,
    py_spy_threads,
    to_faulthandler,
)
from tether.launcher.teardown import left_ranks, recover_record

__all__ = ["ANSWER_WAIT_S", "READ_BY_LAUNCHER", "Reading", "StackWatch"]

logger = get_logger(__name__)

ANSWER_WAIT_S = 3.0
"""How long a local worker has to answer an alarm before its stacks are read from outside: the
responders' own rescue delay. A responsive rank answers within one store round trip plus its
dump (~1 s; more on a loaded host); a stuck one costs the job this long, far below the 30 s the
others would wait for it. A rank that is merely slow is not mistaken for a stuck one: py-spy
shows its responder inside ``answer``, and it is left to write its own dump."""
SUMMARY_WAIT_S = 30.0
"""How long the watch waits for every rank's answer before it prints the alarm's line (the
responders' own abort grace)."""
READ_BY_LAUNCHER = "stacks read by the launcher"
"""How a done key that this watch set starts (followed by how, and the rank's state)."""
ENDED = "its process had ended without answering"
"""The done key this watch sets for a local rank whose process is gone, neither dead by the
alarm's word nor left (its script ended after destroying its groups): its part will never come,
and the aborting ranks would otherwise wait their whole grace (30 s) for it."""
POLL_S = 0.2
"""How often the watch looks whether it must stop, or say where the cluster page is."""
JOIN_S = 2.0
"""How long :meth:`StackWatch.close` waits for the thread (a py-spy read in progress ends within
its own timeout; the thread is a daemon either way), plus a part being sent, in a job on several
nodes (:data:`~tether.launcher.gather.SEND_TIMEOUT_S`)."""
GATHER_WAIT_S = 15.0
"""How long the node that assembles an event waits for the other nodes' parts, once its own
ranks have answered: they send theirs as soon as their ranks have (about a second); a node that
is lost or cut off never does, and is named unreachable instead."""
_STEP_S = 0.5
_POLL_S = 0.1


def _wait_done_quietly(
    board: AlarmBoard, epoch: int, ranks: list[int], timeout: float, stop: threading.Event
) -> dict[int, str]:
    """:meth:`AlarmBoard.wait_done` without the store's wait, whose every timeout torch logs as
    a warning (``waitForInput ... timed out``): polled, one check of all the keys per step (a
    job of thousands of ranks, and an agent per host), the values read once at the end."""
    keys = [_done_key(board, epoch, r) for r in ranks]
    deadline = time.monotonic() + timeout
    while keys and not board.store.check(keys) and time.monotonic() < deadline:
        if stop.wait(min(_POLL_S, max(deadline - time.monotonic(), 0.0))):
            break
    return _parts(board, epoch, ranks)


def _done_key(board: AlarmBoard, epoch: int, rank: int) -> str:
    return f"{board.key(epoch)}/done/{rank}"  # the key alarm.py documents


def _parts(board: AlarmBoard, epoch: int, ranks: list[int]) -> dict[int, str]:
    """What each of ``ranks`` that answered alarm ``epoch`` said."""
    out = {}
    for rank in ranks:
        key = _done_key(board, epoch, rank)
        if board.store.check([key]):
            out[rank] = board.store.get(key).decode()
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Reading:
    """What the watch did for one rank that did not answer an alarm."""

    rank: int
    state: str | None
    syscall: str | None
    method: str | None
    """``py-spy`` or ``faulthandler``; None when no stacks could be read."""
    note: str = ""


class StackWatch:
    """Follow one job's alarms for the workers this launcher started.

    ``local``: global rank -> pid of this launcher's workers (read at each alarm);
    ``alive``: whether one of them still runs."""

    def __init__(
        self,
        store: StoreAddress,
        *,
        world_size: int,
        dump_dir: Path,
        local: Callable[[], dict[int, int]],
        alive: Callable[[int], bool],
        host: str | None = None,
        py_spy: str | None = None,
        attempt: int = 0,
        page: bool = False,
        cluster: Cluster | None = None,
        on_node_fault: Callable[[Alarm], None] | None = None,
        relay: str = "",
    ) -> None:
        self._address = store
        self._attempt = attempt
        self._page_unsaid = page
        """Rank 0 will serve a cluster page, whose address this watch has not said yet."""
        self.world_size = world_size
        self.dump_dir = dump_dir
        self.host = host or socket.gethostname()
        self._local = local
        self._alive = alive
        self.py_spy = py_spy if py_spy is not None else find_py_spy()
        self.alarms: list[Alarm] = []
        """Every alarm seen, in order (``tether run`` names the last hang's event)."""
        self.readings: dict[int, dict[int, Reading]] = {}
        """Alarm epoch -> rank -> what was read for it."""
        self._printed: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._board: AlarmBoard | None = None
        self._epoch = 1
        """The first alarm epoch of this start of the workers."""
        self._next_epoch = 1
        """The next one the thread would read."""
        self.cluster = cluster
        """This node's place in a job that spans several (None: the job runs on this one)."""
        self._on_node_fault = on_node_fault
        self._delivered: set[int] = set()
        """Epochs whose part this node has sent (or, on the assembler, whose line it said)."""
        self._missing: dict[int, dict[int, str]] = {}
        """Epoch -> node -> why its part could not be brought (the assembler's)."""
        self.sent: dict[str, str] = {}
        """Event id -> where its whole is (``node0 (10.97.0.1): DIR``), for the events this node
        sent its part of."""
        self._relay_name = relay
        """The name this node's workers reach the relay by (empty: none)."""
        self.relay: RelayServer | None = None
        self._seen: queue.Queue[Alarm] = queue.Queue()
        """The alarms the look has found, for the watch."""
        self._thread = threading.Thread(target=self._run, name="tether-agent-stacks", daemon=True)
        self._look: AlarmLook | None = None

    def start(self) -> None:
        """Connect to the job's store, say this host's stacks are read here, start the thread.
        Never raises: without it, the responders' own rescue is the fallback."""
        try:
            board = self._board = AlarmBoard(self._address.connect())
            # Set even without py-spy: this watch then signals a silent rank itself (the
            # responders' fallback), once, and also where the rank has no healthy peer here.
            tool = "py-spy" if self.py_spy is not None else "faulthandler"
            info: dict[str, Any] = {"pid": os.getpid(), "tool": tool}
            if self.cluster is not None:  # the ranks say where their own dumps stay
                info["ranks"] = list(self.cluster.info.ranks)
            board.store.set(agent_key(self.host), json.dumps(info))
            # Before start() returns: an alarm raised from then on is this watch's.
            self._epoch = self._next_epoch = self._first_unused(board)
        except Exception as exc:
            logger.warning("not reading stacks from outside: the job's store: %s", exc)
            return
        if self._relay_name:
            try:
                self.relay = RelayServer(self._relay_name)
            except OSError as exc:  # the workers look in the store themselves
                logger.warning("no alarm relay for this node's workers: %s", exc)
        self._look = AlarmLook(
            board.clone(), epoch=self._epoch, found=self._found, replicated=bool(self._address.etcd)
        )
        self._look.start()
        if self.cluster is not None:
            self.cluster.follow(self._look)
        self._thread.start()

    @property
    def look(self) -> AlarmLook | None:
        """The node's look for alarms (None until started, or where it could not start)."""
        return self._look

    def _found(self, alarm: Alarm) -> None:
        """An alarm the node's look found: to the workers at once, and to the watch."""
        if self.relay is not None:
            self.relay.send(alarm)
        self._seen.put(alarm)

    def close(self) -> None:
        """Stop following alarms (the thread ends when its wait returns) and print the line of
        any alarm not printed yet, with the answers in so far."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_S + (SEND_TIMEOUT_S if self.cluster else 0.0))
        if self._look is not None:
            self._look.close(JOIN_S)
        if self.relay is not None:
            self.relay.close()
        if self.cluster is not None:
            self._catch_up()
        for alarm in list(self.alarms):
            if self.cluster is not None:
                # Again, cheaply: a file written since (a dead rank's record the teardown
                # recovered) is sent; the rest the assembler has.
                self._deliver(alarm, again=True)
            self._summarise(alarm, wait=0.0)
        for alarm in list(self.alarms):
            self._await_return(alarm)

    def _catch_up(self) -> None:
        """Take the alarms raised since the thread last looked (the launcher's own, raised as
        it tears down): on several nodes, this node's part of them must still be sent."""
        board = self._board
        if board is None:
            return
        try:
            with self._lock:
                seen = {a.epoch for a in self.alarms}
                while (alarm := board.get(self._next_epoch)) is not None:
                    self._next_epoch = alarm.epoch + 1
                    if alarm.epoch not in seen:  # (the thread, still at work, may have it)
                        self.alarms.append(alarm)
                        if self.cluster is not None:
                            self.cluster.note_alarm(alarm)
        except Exception as exc:  # a key holding no alarm, a store gone: what we have
            logger.debug("catching up on alarms stopped at %d: %s", self._next_epoch, exc)

    def _await_return(self, alarm: Alarm) -> None:
        """On the assembler, after a node fault that may be a link gone down (unreachable) or a
        node stopped (frozen): wait, bounded, for that node to come back with its part."""
        cluster = self.cluster
        if cluster is None or cluster.assembler().node != cluster.node:
            return
        back = {
            n: info
            for n, info in cluster.nodes().items()
            if alarm.nodes.get(info.host) in ("unreachable", "frozen")
        }
        if not back:
            return
        names = ", ".join(info.host for info in back.values())
        say(f"tether run: waiting up to {REJOIN_S:g}s for {names} to come back with its part")
        parts = cluster.port.wait_parts(alarm.event_id, back, REJOIN_S)
        self._write_nodes(alarm, self._missing.get(alarm.epoch, {}))
        event_dir = self.dump_dir / alarm.event_id
        for n, info in back.items():
            if n in parts:
                got = sorted(r for r in info.ranks if rank_file(event_dir, r).exists())
                what = span(got) if got else "no dump"
                say(f"tether run: {info.host} came back: its part ({what}) joined {event_dir}")
            else:
                say(f"tether run: {info.host} did not come back; its part is not in {event_dir}")

    # -- the threads ------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._board is not None
        board = self._board.clone()  # this thread's own; close() uses the other
        while not self._stop.is_set():
            if self._page_unsaid and 0 in self._local():  # the launcher of rank 0's host
                self._say_page(board)
            try:
                alarm = self._seen.get(timeout=POLL_S)
            except queue.Empty:
                continue
            with self._lock:
                self._next_epoch = alarm.epoch + 1
                self.alarms.append(alarm)
            if self.cluster is not None:
                self.cluster.note_alarm(alarm)
            try:
                self._answer_for_silent(board, alarm)
                if self.cluster is not None:
                    self._answers_here(board, alarm)
                    self._deliver(alarm)
                if alarm.nodes and self._on_node_fault is not None:
                    self._on_node_fault(alarm)
                self._summarise(alarm, wait=SUMMARY_WAIT_S, board=board)
            except Exception:  # the next alarm must still be followed
                logger.exception("could not follow alarm %s", alarm.event_id)

    def _say_page(self, board: AlarmBoard) -> None:
        """Say where the cluster page is, once rank 0 of this attempt has published it: the
        workers' own output may go to files (``--redirects``, ``--log-dir``)."""
        try:
            info = board.proc(0, attempt=self._attempt)
        except Exception:  # the next poll asks again
            return
        if info is not None and isinstance(page := info.get("cluster_page"), str):
            self._page_unsaid = False
            say(f"tether run: cluster page {page}")

    def _first_unused(self, board: AlarmBoard) -> int:
        # A restarted job keeps its store: the earlier attempts' alarms are not this one's.
        epoch = 1
        while True:
            try:
                if board.get(epoch) is None:
                    return epoch
            except BadAlarmError:
                pass
            epoch += 1

    def _expected_here(self, alarm: Alarm) -> dict[int, int]:
        """The local ranks expected to answer ``alarm``: those it does not name dead, or all of
        them where it names this very node failed (it came back: its ranks are alive)."""
        local = self._local()
        if self.host in alarm.nodes:
            return local
        return {r: p for r, p in local.items() if str(r) not in alarm.dead_ranks}

    def _answer_for_silent(self, board: AlarmBoard, alarm: Alarm) -> None:
        local = self._expected_here(alarm)
        if not local:
            return
        self._answer_for_left(board, alarm, local)
        done = _wait_done_quietly(board, alarm.epoch, sorted(local), ANSWER_WAIT_S, self._stop)
        unanswered = [r for r in sorted(local) if r not in done]
        silent = [r for r in unanswered if self._alive(local[r])]
        for rank in (r for r in unanswered if r not in silent):
            # compare_set: a rank that answered just before it ended keeps its own answer.
            board.store.compare_set(_done_key(board, alarm.epoch, rank), "", ENDED)
            logger.info("rank %d's process had ended without answering alarm %d", rank, alarm.epoch)
        if not silent:
            return
        procs = board.procs(self.world_size)
        late = _parts(board, alarm.epoch, silent)  # answered while we waited
        for rank in (r for r in silent if r not in late):
            try:
                got = self._read(alarm, rank, local[rank], procs.get(rank, {}))
            except Exception as exc:  # the next silent rank may still be read
                logger.exception("could not read the stacks of rank %d", rank)
                got = Reading(rank, None, None, None, f"reading failed: {exc}")
            if got is None:
                continue
            reading = got
            self.readings.setdefault(alarm.epoch, {})[rank] = reading
            what = (
                f"{READ_BY_LAUNCHER} ({reading.method}; {reading.state or 'state unknown'})"
                if reading.method
                else f"did not answer; no stacks ({reading.note})"
            )
            # compare_set: a rank that answered meanwhile keeps its own answer.
            board.store.compare_set(_done_key(board, alarm.epoch, rank), "", what)

    def _answer_for_left(self, board: AlarmBoard, alarm: Alarm, local: dict[int, int]) -> None:
        """The local ranks that left the job before the alarm (they returned while still
        members): their records, kept in their ring files, go into the event in their place."""
        procs = board.procs(self.world_size)
        deadline = time.monotonic() + ANSWER_WAIT_S
        for rank in left_ranks(procs, local):
            # Still exiting (said so, then its exit hooks run: slow on a loaded host): its ring
            # is final once it is gone.
            while self._alive(local[rank]) and time.monotonic() < deadline:
                if self._stop.wait(_POLL_S):
                    return
            if self._alive(local[rank]):
                continue
            path = procs[rank].get("ring_file")
            if isinstance(path, str) and Path(path).is_file():
                recover_record(self.dump_dir / alarm.event_id, alarm, rank, Path(path), LEFT)
            board.store.compare_set(_done_key(board, alarm.epoch, rank), "", LEFT)

    def _read(self, alarm: Alarm, rank: int, pid: int, info: dict[str, Any]) -> Reading | None:
        """Read a silent rank's stacks into the event; None when py-spy shows its responder
        answering (it is slow, not stuck: nothing is written, and its part stays its own)."""
        kernel = proc_state(pid)
        header: StacksHeader = {
            "rank": rank,
            "host": self.host,
            "pid": pid,
            "when": "unresponsive",
            "event": alarm.event_id,
            "state": kernel.state,
            "syscall": kernel.syscall,
        }
        intro = (
            f"# rank {rank} (host {self.host}, pid {pid}) did not answer {alarm.reason} alarm "
            f"{alarm.event_id} within {ANSWER_WAIT_S:g}s; state {kernel.state or 'unknown'}"
            f"{f', in {kernel.syscall}' if kernel.syscall else ''}\n"
        )
        notes = []
        body = None
        if self.py_spy is not None:
            try:
                threads = py_spy_threads(pid, self.py_spy)
                if answering(threads):
                    logger.info("rank %d is still answering alarm %s", rank, alarm.event_id)
                    return None  # slow, not stuck: its own dump is on its way
                body = to_faulthandler(pid, threads)
                header["method"] = "py-spy"
            except PySpyError as exc:
                notes.append(str(exc))
        else:
            notes.append("py-spy is not installed")
        if body is None:
            body = self._signal_stacks(pid, info)
            if body is not None:
                header["method"] = "faulthandler"
                notes.append("read through the stack signal, which interrupts a system call")
        if notes:
            header["note"] = "; ".join(notes)
        method = header.get("method")
        write_stacks(
            stacks_file(self.dump_dir / alarm.event_id, rank),
            header,
            intro + (body or "# no stacks could be read\n"),
        )
        logger.info("rank %d did not answer; its stacks: %s", rank, method or "none")
        return Reading(rank, kernel.state, kernel.syscall, method, "; ".join(notes))

    def _signal_stacks(self, pid: int, info: dict[str, Any]) -> str | None:
        """The fallback where py-spy cannot read the rank: the responders' own signal."""
        path, start_time = info.get("stack_file"), info.get("start_time")
        if info.get("pid") != pid or not isinstance(path, str):
            return None
        if not isinstance(start_time, int) or process_start_time(pid) != start_time:
            return None
        return collect_signal_stacks(pid, Path(path), start_time=start_time)

    # -- the alarm's line --------------------------------------------------------------------
    def _summarise(self, alarm: Alarm, *, wait: float, board: AlarmBoard | None = None) -> None:
        cluster = self.cluster
        if cluster is not None and cluster.assembler().node != cluster.node:
            return  # this node's line said where its part went
        if alarm.origin == "launcher" and cluster is None:
            return  # teardown prints the line of the alarms the launcher raises
        with self._lock:
            if alarm.epoch in self._printed:
                return
        board = board or self._board
        if board is None:
            return
        ranks = list(range(self.world_size))
        keys = [_done_key(board, alarm.epoch, r) for r in ranks]
        deadline = time.monotonic() + wait
        while not board.store.check(keys) and time.monotonic() < deadline:
            if self._stop.wait(_STEP_S):
                break
        try:
            done = _parts(board, alarm.epoch, ranks)
        except Exception as exc:  # the store is gone (a lost node 0): what is on disk says it
            logger.debug("could not read the answers to %s: %s", alarm.event_id, exc)
            done = {}
        missing: dict[int, str] = {}
        if cluster is not None:
            expected = cluster.expected(alarm)
            parts = cluster.port.wait_parts(alarm.event_id, expected, GATHER_WAIT_S)
            missing = {
                n: f"{info.describe()}: its part could not be brought ({self._why_not(n)})"
                for n, info in expected.items()
                if n not in parts
            }
        with self._lock:
            if alarm.epoch in self._printed:
                return
            self._printed.add(alarm.epoch)
        if cluster is not None:
            self._missing[alarm.epoch] = missing
            self._write_nodes(alarm, missing)
            text = self.describe_whole(alarm, done, missing)
        else:
            text = self.describe(alarm, done)
        say(f"tether run: {alarm.reason} alarm from {alarm.origin}: {text}")

    def _why_not(self, node: int) -> str:
        assert self.cluster is not None
        heard = self.cluster.heard.get(node)
        state = probe(self.cluster.table[node])
        since = f"; last heard {clock(heard)}" if heard else ""
        return f"{state}{since}"

    # -- a job on several nodes --------------------------------------------------------------
    def _answers_here(self, board: AlarmBoard, alarm: Alarm) -> None:
        """Wait (bounded) for this node's ranks to answer ``alarm``: its part is then whole."""
        keys = [_done_key(board, alarm.epoch, r) for r in sorted(self._expected_here(alarm))]
        deadline = time.monotonic() + SUMMARY_WAIT_S
        while keys and time.monotonic() < deadline:
            try:
                if board.store.check(keys):
                    return
            except Exception:  # the store is gone: what is on disk is the part
                return
            if self._stop.wait(_STEP_S):
                return

    def _deliver(self, alarm: Alarm, *, again: bool = False) -> None:
        """Send this node's part of ``alarm``'s event to the node that assembles it (nothing on
        the assembler itself); ``again``: a top-up after a first send, said only if it fails."""
        cluster = self.cluster
        if cluster is None or cluster.cut_off is not None:
            return  # (a node cut off from the job brings its own event: Cluster.rejoin)
        to = cluster.assembler()
        if to.node == cluster.node:
            return
        with self._lock:
            first = alarm.epoch not in self._delivered
            self._delivered.add(alarm.epoch)
        if not first and not again:
            return
        here = self.dump_dir / alarm.event_id
        ranks = sorted(r for r in cluster.info.ranks if rank_file(here, r).exists())
        try:
            _, written = cluster.send(alarm)
        except Exception as exc:
            if not first:  # a top-up: the first send said where the part went
                logger.debug("could not top up the part of %s: %s", alarm.event_id, exc)
                return
            say(
                f"tether run: {alarm.reason} alarm from {alarm.origin}: "
                f"{_dumped(ranks)} into {here}; could not send this node's part to "
                f"{to.host} ({to.address}), which assembles the event: {exc}"
            )
            return
        there = Path(to.dump_dir) / alarm.event_id
        self.sent[alarm.event_id] = f"{to.host} ({to.address}): {there}"
        if first:
            say(
                f"tether run: {alarm.reason} alarm from {alarm.origin}: {_dumped(ranks)} into "
                f"{here}; sent to {to.host} ({to.address}), where the event is assembled: "
                f"{Path(to.dump_dir) / alarm.event_id}"
                + ("" if written or not ranks else " (already there: a shared dump directory)")
            )

    def _write_nodes(self, alarm: Alarm, missing: dict[int, str]) -> None:
        """Say in the event where each node's part came from (``tether analyze`` names a node
        whose part is missing as unreachable, not its ranks as dead); ``missing``: why a part
        could not be brought, by node."""
        cluster = self.cluster
        assert cluster is not None
        received = cluster.port.parts(alarm.event_id)
        nodes: list[dict[str, Any]] = []
        for n, info in sorted(cluster.nodes().items()):
            part = "here" if n == cluster.node else "brought" if n in received else "missing"
            entry: dict[str, Any] = {
                "node": n, "host": info.host, "ranks": list(info.ranks), "part": part,
            }  # fmt: skip
            if part == "missing":
                entry["why"] = missing.get(n) or f"{info.host} {alarm.nodes.get(info.host, '')}"
                entry["last_heard_ns"] = cluster.heard.get(n, 0)
            nodes.append(entry)
        try:
            write_atomic(nodes_file(self.dump_dir / alarm.event_id), json.dumps({"nodes": nodes}))
        except OSError as exc:
            logger.warning("could not write where the event's parts came from: %s", exc)

    def describe_whole(self, alarm: Alarm, done: dict[int, str], missing: dict[int, str]) -> str:
        """What the assembled event holds: "4 of 4 ranks' dumps in DIR; ranks 2-3 from node1",
        then each rank without a dump, then each node whose part could not be brought."""
        assert self.cluster is not None
        event_dir = self.dump_dir / alarm.event_id
        present = sorted(r for r in range(self.world_size) if rank_file(event_dir, r).exists())
        hosts = self.cluster.host_of()
        parts = [f"{len(present)} of {self.world_size} ranks' dumps in {event_dir}"]
        by_host: dict[str, list[int]] = {}
        for rank in present:
            host = hosts.get(rank, "?")
            if host != self.cluster.host:
                by_host.setdefault(host, []).append(rank)
        parts += [f"{span(ranks)} from {host}" for host, ranks in sorted(by_host.items())]
        lost = set(alarm.nodes)
        for rank in (r for r in range(self.world_size) if r not in present):
            host = hosts.get(rank, "?")
            if host in lost:
                continue  # the node fault names them
            what = done.get(rank)
            reading = self.readings.get(alarm.epoch, {}).get(rank)
            if reading is not None and reading.method:
                parts.append(f"rank {rank} ({host}) did not answer: stacks read ({reading.method})")
            elif what is not None and what != DUMPED:
                parts.append(f"rank {rank} ({host}): {what}")
        for host in sorted(lost):
            ranks = [r for r, h in hosts.items() if h == host]
            parts.append(f"{host} ({span(ranks)}) {alarm.nodes[host]}")
        parts += list(missing.values())
        return "; ".join(parts)

    def describe(self, alarm: Alarm, done: dict[int, str]) -> str:
        """ "3 of 4 ranks dumped into DIR; rank 2 did not answer (stopped): stacks read by
        py-spy"."""
        event_dir = self.dump_dir / alarm.event_id
        dumped = [r for r, what in done.items() if what == DUMPED]
        parts = [f"{len(dumped)} of {self.world_size} ranks dumped into {event_dir}"]
        readings = self.readings.get(alarm.epoch, {})
        for rank in sorted(set(range(self.world_size)) - set(dumped)):
            what = done.get(rank)
            reading = readings.get(rank)
            if reading is not None:
                state = reading.state or "state unknown"
                if reading.syscall:
                    state += f" in {reading.syscall}"
                how = f"stacks read by {reading.method}" if reading.method else "no stacks"
                parts.append(f"rank {rank} did not answer ({state}): {how}")
            elif what is None:
                parts.append(f"rank {rank} did not answer")
            else:  # a failed dump, a peer's rescue, an exit before answering
                parts.append(f"rank {rank}: {what}")
        return "; ".join(parts)

    def latest(self, reason: str) -> Alarm | None:
        """The last alarm of ``reason`` in the store since this watch started, read now (the
        thread may not have seen one raised a moment ago)."""
        board, found, epoch = self._board, None, self._epoch
        if board is None:
            return None
        try:
            while (alarm := board.get(epoch)) is not None:
                if alarm.reason == reason:
                    found = alarm
                epoch += 1
        except Exception as exc:  # a key holding no alarm, a store gone: what we have
            logger.debug("reading the alarms stopped at %d: %s", epoch, exc)
        return found

    def latest_node_fault(self) -> Alarm | None:
        """The last alarm since this watch started that declared a node failed, read now."""
        alarm = self.latest("crash")
        return alarm if alarm is not None and alarm.nodes else None

    def aborting(self, alarm: Alarm) -> list[int]:
        """The ranks that decided to abort on ``alarm``, read now; none where the store is
        gone."""
        board = self._board
        if board is None:
            return []
        try:
            return sorted(board.done(alarm.epoch, self.world_size, phase=ABORTING))
        except Exception as exc:
            logger.debug("could not read who aborts on %s: %s", alarm.event_id, exc)
            return []

    def last_event(self, reason: str) -> Path | None:
        """The event directory of the last alarm of ``reason`` seen."""
        for alarm in reversed(self.alarms):
            if alarm.reason == reason:
                return self.dump_dir / alarm.event_id
        return None

    def unanswered(self, alarm: Alarm) -> dict[int, str]:
        """Local ranks whose part of ``alarm`` is not their own answer: rank -> what it says."""
        board = self._board
        if board is None:
            return {}
        local = sorted(self._local())
        done = _parts(board, alarm.epoch, local)
        out = {}
        for rank in local:
            what = done.get(rank, "")
            if not answered_itself(what):
                out[rank] = what
        return out


def _dumped(ranks: list[int]) -> str:
    return f"{span(ranks)} dumped" if ranks else "no rank of this node dumped"
