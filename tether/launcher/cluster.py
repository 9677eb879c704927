"""This launcher's place in a job that spans several nodes: its event port, its beat, and, on
the node that assembles the job's events, the watch over the other nodes.

Started by :class:`tether.launcher.agent.TetherAgent` for each start of the workers when
torchrun's rendezvous has more than one node; a one-node job has none of it and pays nothing.

- Every node's launcher publishes its :class:`~tether.job.nodes.NodeInfo` and beats
  (:data:`~tether.job.nodes.BEAT_S`) to the assembler (:class:`~tether.job.nodes.BeatPort`),
  and to the store only until the node's look for alarms answers for it (:meth:`Cluster.follow`):
  on 1,024 nodes the store then sees 2 requests a second a node, not 6.
- The assembler (the lowest node not known to have failed: node 0) receives the others' parts of
  every event (:mod:`tether.launcher.gather`) and watches their beats
  (:class:`~tether.job.nodes.NodeWatch`). A node silent for :data:`~tether.job.nodes.SILENT_S`
  is probed on its event port: a refused connection (its launcher is gone), or no connection at
  all (its host, or the link to it, is down), is a node fault at once; a connection that nobody
  answers (the node is frozen) is one after :data:`~tether.job.nodes.FROZEN_S`. The fault is
  one job-wide crash alarm that names the node and all its ranks (``nodes``, ``dead_ranks``):
  every survivor dumps into it, and every launcher then ends its own workers, which wait on
  ranks that will never come.
- A node whose beat the store has not taken for :data:`CUT_OFF_S` (:data:`ETCD_CUT_OFF_S` where
  the store is etcd) is cut off (its link is down, or node 0 is lost with the store): nobody can
  alarm its ranks, so its launcher ends them, recovers their records from their ring files into
  an event of its own that names the nodes it cannot reach, and brings it
  (:meth:`Cluster.rejoin`) to the lowest node whose launcher answers, waiting up to
  :data:`REJOIN_S` for a link to come back; that node puts it into its event about this node (a
  partition's two halves joined), or, node 0 being gone, assembles the survivors'.
"""

from __future__ import annotations

import dataclasses
import http.client
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tether._log import get_logger, say
from tether.events.layout import clock, new_event_id
from tether.job.alarm import Alarm, AlarmBoard, first_line
from tether.job.client import StoreAddress
from tether.job.elastic import CUT_OFF_LEASES, NODE_LEASE_S
from tether.job.nodes import BEAT_S, BeatPort, NodeBoard, NodeInfo, NodeWatch
from tether.job.relay import AlarmLook
from tether.launcher.gather import (
    SETTLE_S,
    EventPort,
    local_address,
    probe,
    say_ended,
    send_part,
)

__all__ = ["CUT_OFF_S", "ETCD_CUT_OFF_S", "REJOIN_S", "Cluster"]

logger = get_logger(__name__)

CUT_OFF_S = 3.0
"""A node whose requests the job's store has not answered for this long is cut off from the job
(its link, or node 0, is down): six looks for alarms (or twelve beats through the store); the
store answers one in a millisecond."""
ETCD_CUT_OFF_S = float(CUT_OFF_LEASES * NODE_LEASE_S)
"""The same where the job's store is etcd, which answers nothing while it elects a leader (its
node lost: over 3.6 s on 2 loaded cores), and is the node lease's own limit: a node that takes
itself for cut off is the one whose lease the others saw expire."""
REJOIN_S = 30.0
"""How long the two sides of a link that went down wait for each other once their workers have
ended, so that the halves of the event are joined when it comes back (a node that refuses the
connection, its launcher gone, is not waited for)."""
_JOIN_S = 2.0
_RETRY_S = 0.5
_POLL_S = 0.05
_DECIDE_S = 30.0
"""The most a teardown waits for the cut-off event another thread is making (probes of every
node, then each local rank's ring file)."""


class Cluster:
    """One launcher's view of the job's nodes (one torchrun attempt)."""

    def __init__(
        self,
        store: StoreAddress,
        *,
        attempt: int,
        node: int,
        nodes: int,
        ranks: list[int],
        dump_dir: Path,
        running: Callable[[], bool],
        host: str | None = None,
        watch_nodes: bool = True,
    ) -> None:
        self.node = node
        self.watch_nodes = watch_nodes
        """Whether the assembler watches the other nodes' beats and declares their faults (not
        where an elastic job on etcd has each node's lease decide it, and the job survive it)."""
        self.count = nodes
        self.dump_dir = dump_dir
        self.host = host or socket.gethostname()
        self._store = store.connect()
        self._replicated = bool(store.etcd)
        """A failed call is no verdict on a replicated store (an election): silence is."""
        self.cut_off_s = ETCD_CUT_OFF_S if store.etcd else CUT_OFF_S
        self._board = NodeBoard(self._store, attempt)
        self.port = EventPort(
            dump_dir, node=node, host=self.host, address=local_address(store.host)
        )
        beat_key = secrets.token_hex(16)
        try:
            self.beats = BeatPort(self.port.address, beat_key)
        except BaseException:
            self.port.close()
            raise
        self.info = dataclasses.replace(
            self.port.info(ranks=ranks), beat_port=self.beats.port, beat_key=beat_key
        )
        try:
            self._board.publish(self.info)
        except BaseException:
            self.beats.close()
            self.port.close()
            raise
        self.table: dict[int, NodeInfo] = {node: self.info}
        self.faults: dict[int, Alarm] = {}
        """Node -> the alarm that declared it failed (raised here or seen)."""
        self._watch = NodeWatch()
        self.heard = self._watch.heard
        """Node -> when its beat last moved (Unix ns), as seen here."""
        self._running = running
        self.cut_off: Alarm | None = None
        """This node's own event once it lost the job's store while its workers ran (node 0
        lost, or the link between): it names the nodes it cannot reach."""
        self.on_cut_off: Callable[[Alarm], None] | None = None
        self.on_job_ended: Callable[[str], None] | None = None
        """Told how node 0's launcher ended the job, where this node's workers still run."""
        self._store_heard_ns = time.time_ns()
        self._beat_ok = time.monotonic()
        self._beat_error: BaseException | None = None
        self._look: AlarmLook | None = None
        """The node's look for alarms, once it runs (:meth:`follow`): its answers say the store
        answers this node, which then beats to the store no more."""
        self._deciding = False
        self._decided = threading.Event()
        """Set once a lost store has been dealt with (a cut-off event made, or the job's end
        heard from node 0)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tether-agent-nodes", daemon=True)
        self._beats = threading.Thread(target=self._beat, name="tether-agent-beat", daemon=True)
        self._unbeaten: set[int] = set()
        """Nodes that answer probes but none of whose beats has come (said once each)."""
        self.beats.take(self._beat_key_of)
        self._beats.start()
        self._thread.start()

    def _beat_key_of(self, node: int) -> str | None:
        with self._lock:  # what is known here (no store call on the beats' thread)
            info = self.table.get(node)
        return info.beat_key if info is not None else None

    def follow(self, look: AlarmLook) -> None:
        """Take ``look``'s answers as the store's word that it answers this node: on a job of
        several nodes, its look every 0.5 s is then the node's only store request in steady
        state (its beat goes to the assembler, :class:`~tether.job.nodes.BeatPort`)."""
        if 3 * look.every > self.cut_off_s:
            raise ValueError(f"a look every {look.every:g}s cannot say the store answers")
        self._look = look

    def _store_answered(self) -> tuple[BaseException | None, float, int]:
        """What ended this node's store requests (None: nothing), and when the store last
        answered one (monotonic s, Unix ns): its own beats', or its look's (also once the look
        is closed, when the beats through the store take over: its last answer stands)."""
        look = self._look
        if look is None:
            return self._beat_error, self._beat_ok, self._store_heard_ns
        # A look's failure that the beats through the store have answered since is over.
        look_error = look.error if look.answered_at >= self._beat_ok else None
        return (
            self._beat_error or look_error,
            max(self._beat_ok, look.answered_at),
            max(self._store_heard_ns, look.answered_ns),
        )

    # -- who is where --------------------------------------------------------------------------
    def nodes(self) -> dict[int, NodeInfo]:
        """Every node that published, read from the store (cached: a lost store keeps the last
        table)."""
        if len(self.table) < self.count:
            try:
                found = NodeBoard(self._store, self._board.attempt).nodes(self.count)
            except Exception as exc:  # the store is gone: what we know
                logger.debug("could not read the node table: %s", exc)
            else:
                with self._lock:
                    self.table.update(found)
        with self._lock:
            return dict(self.table)

    def failed_hosts(self) -> set[str]:
        with self._lock:
            return {h for alarm in self.faults.values() for h in alarm.nodes}

    def assembler(self, *, ask: bool = True) -> NodeInfo:
        """The node that assembles the job's events: the lowest one not known to have failed
        (``ask``: the store asked for the nodes not known yet; else what is known here)."""
        failed = self.failed_hosts()
        if ask:
            table = self.nodes()
        else:
            with self._lock:
                table = dict(self.table)
        alive = [n for n in sorted(table) if table[n].host not in failed]
        return table[alive[0]] if alive else self.info

    def host_of(self) -> dict[int, str]:
        """Global rank -> the host it runs on, for the nodes known here."""
        return {r: info.host for info in self.nodes().values() for r in info.ranks}

    def note_alarm(self, alarm: Alarm) -> None:
        """An alarm seen: one that names failed nodes makes them failed here too (and the part
        such a node sends if it comes back goes into that alarm's event)."""
        if not alarm.nodes:
            return
        with self._lock:
            for node, info in self.table.items():
                if info.host in alarm.nodes:
                    self.faults.setdefault(node, alarm)
                    self.port.join(alarm.event_id, node=node)

    # -- an event's parts ----------------------------------------------------------------------
    def send(self, alarm: Alarm) -> tuple[NodeInfo, list[str]]:
        """Send this node's part of ``alarm``'s event to the assembler (which must not be this
        node); returns where it went and what it wrote. :class:`OSError` if it cannot."""
        to = self.assembler()
        event_dir = self.dump_dir / alarm.event_id
        event_dir.mkdir(parents=True, exist_ok=True)  # a node with nothing to add says so too
        return to, send_part(event_dir, to, node=self.node)[1]

    def expected(self, alarm: Alarm) -> dict[int, NodeInfo]:
        """The nodes whose part of ``alarm``'s event the assembler waits for: every other node
        not known to have failed."""
        failed = self.failed_hosts() | set(alarm.nodes)
        return {
            n: info
            for n, info in self.nodes().items()
            if n != self.node and info.host not in failed
        }

    # -- beats and the watch -------------------------------------------------------------------
    def _run(self) -> None:
        board = NodeBoard(self._store.clone(), self._board.attempt)  # this thread's own
        while not self._stop.wait(BEAT_S):
            if len(self.table) < self.count:
                self.nodes()  # while the store is there: a node cut off needs the others' ports
            error, answered, _ = self._store_answered()
            quiet = time.monotonic() - answered
            if error is None and quiet > self.cut_off_s:
                # This launcher itself may have been stopped (a frozen node, thawed): its beat
                # thread, or its look, asks the store within one period if it is there.
                look = self._look
                self._stop.wait(2 * max(BEAT_S, look.every if look is not None else 0.0))
                error, answered, _ = self._store_answered()
                quiet = time.monotonic() - answered
            if error is not None or quiet > self.cut_off_s:
                # A store call does not fail when the link under it goes down: it waits for it
                # to come back. The look (or beat) is stuck there; this one decides.
                why = first_line(error) if error else f"no answer for {quiet:.1f}s"
                if self._running() and not self._stop.is_set():
                    self._lose_store(why)
                else:
                    logger.debug("node %d: the job's store is gone: %s", self.node, why)
                return
            if not self.watch_nodes or self.assembler().node != self.node or not self._running():
                continue  # a fault matters while this node's workers run
            others = [n for n in self.nodes() if n != self.node and n not in self.faults]
            beats = self.beats.counts(others)
            for node, state, verdict in self._watch.judge(
                beats,
                time.monotonic(),
                ended=board.ended,  # its launcher ended with its workers: no fault
                probe=lambda node: probe(self.table[node]),
            ):
                if verdict is not None:
                    self._declare(board, node, verdict)
                elif state == "alive" and not beats[node] and node not in self._unbeaten:
                    self._unbeaten.add(node)
                    info = self.table[node]
                    logger.warning(
                        "%s answers, but none of its beats has come to UDP port %d here: is UDP "
                        "blocked between the nodes? It is probed every second instead",
                        info.describe(),
                        self.beats.port,
                    )

    def sweep(self) -> Alarm | None:
        """Probe every other node now (a rank here died of a failed collective: a peer's node
        may be gone) and declare those whose launcher is gone or unreachable; the fault's alarm,
        or None if every node answers."""
        if not self.watch_nodes:
            return None
        board = NodeBoard(self._store, self._board.attempt)
        found = None
        for node, info in sorted(self.nodes().items()):
            if node == self.node or node in self.faults:
                continue
            try:
                if board.ended(node):
                    continue
            except Exception:
                return None  # the store is gone: no alarm can be raised
            state = probe(info)
            if state in ("gone", "unreachable"):
                found = self._declare(board, node, "lost" if state == "gone" else state) or found
        return found

    def _declare(self, board: NodeBoard, node: int, state: str) -> Alarm | None:
        info = self.table[node]
        heard_ns = self.heard.get(node, self.port.started_ns)
        what = {
            "lost": "its launcher and all its ranks stopped answering",
            "unreachable": "nothing there answers (the host is down, or the link to it)",
            "frozen": "its host answers, but its launcher and ranks make no progress",
        }[state]
        detail = f"{info.describe()} {state} at {clock(heard_ns)}: {what}"
        try:
            alarm = AlarmBoard(board.store).raise_alarm(
                "crash",
                origin="launcher",
                detail=detail,
                dead_ranks={str(r): f"{info.host} {state}" for r in info.ranks},
                nodes={info.host: state},
                heard={info.host: str(heard_ns)},
            )
        except Exception as exc:
            logger.warning("could not raise the node fault of %s: %s", info.host, exc)
            return None
        say(f"tether run: {detail}; every other rank dumps into {self.dump_dir / alarm.event_id}")
        with self._lock:
            self.faults[node] = alarm
        self.port.join(alarm.event_id, node=node)
        return alarm

    # -- cut off from the job ------------------------------------------------------------------
    def _beat(self) -> None:
        """Beat to the assembler until stopped; and, until the node's look for alarms answers
        for it (:meth:`follow`), to the store, until it fails (a thread of its own: a store
        call whose link went down blocks until the link comes back)."""
        board = NodeBoard(self._store.clone(), self._board.attempt)
        while not self._stop.wait(BEAT_S):
            to = self.assembler(ask=False)
            if to.node != self.node:
                self.beats.send(self.node, to)
            look = self._look
            if look is not None and look.looking:
                continue
            try:
                board.beat(self.node)
            except Exception as exc:
                if self._replicated:
                    continue  # no quorum answers for now: silence past cut_off_s decides
                self._beat_error = exc  # the store's host is gone
                return
            self._beat_ok = time.monotonic()
            self._store_heard_ns = time.time_ns()

    def store_gone(self) -> bool:
        """Whether the job's store has stopped answering this node (failed, or silent for
        :attr:`cut_off_s`), as its look or its beats last saw it: no store call here."""
        error, answered, _ = self._store_answered()
        return error is not None or time.monotonic() - answered > self.cut_off_s

    def lost_store(self) -> Alarm | None:
        """This node's cut-off event, made now if the job's store has gone (a worker here died
        of a peer's broken connection before the watch's verdict: it waits, bounded, for the
        next look's or beat's outcome); None while the store answers. No store call is made here: a
        call whose link is down blocks until the link comes back."""
        _, started, _ = self._store_answered()
        deadline = time.monotonic() + self.cut_off_s
        while (
            (answer := self._store_answered())[:2] == (None, started)
            and time.monotonic() < deadline
            and not self._decided.is_set()
        ):
            self._stop.wait(_POLL_S)
        error, answered, _ = answer
        if answered != started and error is None:
            return self.cut_off  # answered: the store is there
        if not self._decided.is_set():
            self._lose_store(first_line(error) if error else f"no answer for {self.cut_off_s:g}s")
        self._decided.wait(timeout=_DECIDE_S)
        return self.cut_off

    def _lose_store(self, why: str) -> None:
        """The job's store stopped answering while this node's workers run: node 0 is lost, or
        the link between. This node makes its own event (the others cannot alarm it), names
        the nodes it cannot reach, and hands it to the launcher (:attr:`on_cut_off`); decided
        once, :attr:`cut_off` set once the event is whole."""
        with self._lock:
            if self._deciding:
                return  # (the watch thread and the launcher's teardown may both get here)
            self._deciding = True
        try:
            self._decide_cut_off(why)
        except Exception:  # the launcher's teardown still ends the job
            logger.exception("could not record this node's ranks after losing the job's store")
        finally:
            self._decided.set()

    def _decide_cut_off(self, why: str) -> None:
        if self.port.ended is not None:
            # Node 0's launcher ended the job and took the store with it: nothing is cut off.
            say(f"tether run: node0's launcher ended the job ({self.port.ended})")
            if self.on_job_ended is not None:
                self.on_job_ended(self.port.ended)
            return
        heard_ns = self._store_answered()[2]
        table = self.nodes()
        unreachable = {
            info.host: state
            for n, info in sorted(table.items())
            if n != self.node and (state := probe(info, settle=SETTLE_S)) != "alive"
        }
        reach = ", ".join(f"{h} ({s})" for h, s in unreachable.items()) or "every node answers"
        detail = (
            f"{self.info.describe()} cut off from the job's store at "
            f"{clock(heard_ns)} ({why}); cannot reach: {reach}"
        )
        nodes = {h: "lost" if s == "gone" else s for h, s in unreachable.items()}
        alarm = Alarm(
            epoch=0,
            event_id=self.port.adopt(new_event_id("cut_off")),
            reason="cut_off",
            origin=f"launcher on {self.host}",
            detail=detail,
            time_ns=time.time_ns(),
            dead_ranks={
                str(r): f"{info.host} {nodes[info.host]}"
                for info in table.values()
                if info.host in nodes
                for r in info.ranks
            },
            nodes=nodes,
            heard={h: str(heard_ns) for h in unreachable},
        )
        say(f"tether run: {detail}; this node's ranks go into {self.dump_dir / alarm.event_id}")
        if self.on_cut_off is not None:
            self.on_cut_off(alarm)
        self.cut_off = alarm

    def rejoin(self, alarm: Alarm, timeout: float = REJOIN_S) -> str | None:
        """Bring this node's cut-off event to the lowest node that answers, waiting up to
        ``timeout`` for a link to come back (not for a node whose launcher is gone); where this
        node is the lowest, wait for the other nodes' parts instead. Says where the event is
        whole; returns that place when it is another node."""
        event_dir = self.dump_dir / alarm.event_id
        deadline = time.monotonic() + timeout
        while True:
            states = {
                n: "alive" if n == self.node else probe(info, settle=SETTLE_S)
                for n, info in sorted(self.nodes().items())
            }
            lowest = min(n for n, s in states.items() if s == "alive")
            awaited = [n for n, s in states.items() if s == "unreachable" and n < self.node]
            if lowest != self.node:
                to = self.table[lowest]
                try:
                    into, _ = send_part(event_dir, to, node=self.node, cut_off=True)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    logger.info("could not send the cut-off part to %s: %s", to.host, exc)
                else:
                    where = f"{to.host} ({to.address}): {Path(to.dump_dir) / into}"
                    say(f"tether run: {self.host}'s part of the event joined the whole on {where}")
                    return where
            elif not awaited:
                others = [n for n, s in states.items() if s == "alive" and n != self.node]
                self.port.wait_parts(alarm.event_id, others, max(deadline - time.monotonic(), 0))
                say(f"tether run: the event is assembled here, on {self.host}: {event_dir}")
                return None
            if time.monotonic() >= deadline:
                say(
                    f"tether run: no lower node came back within {timeout:g}s; this node's part "
                    f"stays here, on {self.host}: {event_dir}"
                )
                return None
            self._stop.wait(_RETRY_S)

    def close(self, *, ended: str) -> None:
        """Stop; ``ended`` says how this node's workers ended ("" if they all succeeded), so
        that the node that watches does not take this launcher's exit for a fault, and (node 0,
        whose exit takes the job's store) the others do not take it for a cut-off."""
        gone = self.port.ended is not None or self.store_gone() or self._decided.is_set()
        try:
            if not gone:  # (a call on a store that is gone makes torch log a C++ backtrace)
                self._board.end(self.node, ended or "succeeded")
        except Exception as exc:  # the store went meanwhile: the job is over
            logger.debug("could not say this node ended: %s", exc)
        if self.node == 0:
            others = [info for n, info in self.nodes().items() if n != self.node]
            say_ended(others, ended or "succeeded")
        self._stop.set()
        for thread in (self._thread, self._beats):
            if thread is not threading.current_thread():
                thread.join(timeout=_JOIN_S)  # a beat stuck on a dead link stays behind (daemon)
        self.beats.close()
        self.port.close()
