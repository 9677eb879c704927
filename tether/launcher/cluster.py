"""This launcher's place in a job that spans several nodes: its event port, its beat, and, on
the node that assembles the job's events, the watch over the other nodes.

Started by :class:`tether.launcher.agent.TetherAgent` for each start of the workers when
torchrun's rendezvous has more than one node; a one-node job has none of it and pays nothing.

- Every node's launcher publishes its :class:`~tether.job.nodes.NodeInfo` and beats
  (:data:`~tether.job.nodes.BEAT_S`).
- The assembler (the lowest node not known to have failed: node 0) receives the others' parts of
  every event (:mod:`tether.launcher.gather`) and watches their beats. A node silent for
  :data:`SILENT_S` is probed on its event port: a refused connection (its launcher is gone), or no
  connection at all (its host, or the link to it, is down), is a node fault at once; a connection
  that nobody answers (the node is frozen) is one after :data:`FROZEN_S`. The fault is one
  job-wide crash alarm that names the node and all its ranks (``nodes``, ``dead_ranks``): every
  survivor dumps into it, and every launcher then ends its own workers, which wait on ranks that
  will never come.
"""

from __future__ import annotations

import datetime as _dt
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tether._log import get_logger, say
from tether.job.alarm import Alarm, AlarmBoard
from tether.job.client import connect
from tether.job.nodes import BEAT_S, NodeBoard, NodeInfo
from tether.launcher.gather import EventPort, local_address, probe, send_part

__all__ = ["FROZEN_S", "SILENT_S", "Cluster", "clock"]

logger = get_logger(__name__)

SILENT_S = 1.0
"""A node whose beat has not moved for this long is probed (four beats missed; a loaded host's
launcher beats late by tens of milliseconds, not a second)."""
FROZEN_S = 3.0
"""A node whose host accepts connections but whose launcher neither beats nor answers for this
long is frozen. Longer than :data:`SILENT_S`: a starved launcher also answers late, and a
frozen verdict ends the job."""
_JOIN_S = 2.0
_TABLE_WAIT_S = 30.0


def clock(time_ns: int) -> str:
    """``19:51:01.7`` (UTC), as the node-fault lines say when a node was last heard."""
    moment = _dt.datetime.fromtimestamp(time_ns / 1e9, tz=_dt.timezone.utc)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 100_000}"


class Cluster:
    """One launcher's view of the job's nodes (one torchrun attempt)."""

    def __init__(
        self,
        store_host: str,
        store_port: int,
        *,
        attempt: int,
        node: int,
        nodes: int,
        ranks: list[int],
        dump_dir: Path,
        running: Callable[[], bool],
        host: str | None = None,
    ) -> None:
        self.node = node
        self.count = nodes
        self.dump_dir = dump_dir
        self.host = host or socket.gethostname()
        self._store = connect(store_host, store_port)
        self._board = NodeBoard(self._store, attempt)
        self.port = EventPort(
            dump_dir, node=node, host=self.host, address=local_address(store_host)
        )
        self.info = self.port.info(ranks=ranks)
        self._board.publish(self.info)
        self.table: dict[int, NodeInfo] = {node: self.info}
        self.faults: dict[int, Alarm] = {}
        """Node -> the alarm that declared it failed (raised here or seen)."""
        self.heard: dict[int, int] = {}
        """Node -> when its beat last moved (Unix ns), as seen here."""
        self._running = running
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tether-agent-nodes", daemon=True)
        self._thread.start()

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

    def assembler(self) -> NodeInfo:
        """The node that assembles the job's events: the lowest one not known to have failed."""
        failed = self.failed_hosts()
        table = self.nodes()
        alive = [n for n in sorted(table) if table[n].host not in failed]
        return table[alive[0]] if alive else self.info

    def host_of(self) -> dict[int, str]:
        """Global rank -> the host it runs on, for the nodes known here."""
        return {r: info.host for info in self.nodes().values() for r in info.ranks}

    def note_alarm(self, alarm: Alarm) -> None:
        """An alarm seen: one that names failed nodes makes them failed here too."""
        if not alarm.nodes:
            return
        with self._lock:
            for node, info in self.table.items():
                if info.host in alarm.nodes:
                    self.faults.setdefault(node, alarm)

    # -- an event's parts ----------------------------------------------------------------------
    def send(self, alarm: Alarm) -> tuple[NodeInfo, list[str]]:
        """Send this node's part of ``alarm``'s event to the assembler (which must not be this
        node); returns where it went and what it wrote. :class:`OSError` if it cannot."""
        to = self.assembler()
        event_dir = self.dump_dir / alarm.event_id
        event_dir.mkdir(parents=True, exist_ok=True)  # a node with nothing to add says so too
        return to, send_part(event_dir, to, node=self.node)

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
        store = self._store.clone()  # this thread's own connection
        board = NodeBoard(store, self._board.attempt)
        last: dict[int, int] = {}
        moved: dict[int, float] = {}
        silent_since: dict[int, float] = {}
        while not self._stop.wait(BEAT_S):
            try:
                board.beat(self.node)
            except Exception as exc:  # the store's host is gone, or cut off from this one
                logger.info("node %d lost the job's store: %s", self.node, exc)
                return
            if self.assembler().node != self.node or not self._running():
                continue  # a fault matters while this node's workers run
            others = [n for n in self.nodes() if n != self.node and n not in self.faults]
            try:
                beats = board.beats(others)
            except Exception as exc:
                logger.info("could not read the nodes' beats: %s", exc)
                return
            now = time.monotonic()
            for node, count in beats.items():
                if last.get(node) != count:
                    last[node], moved[node] = count, now
                    self.heard[node] = time.time_ns()
                    silent_since.pop(node, None)
                    continue
                quiet = now - moved.setdefault(node, now)
                if quiet < SILENT_S or board.ended(node):
                    continue  # beating, or its launcher ended with its workers
                state = probe(self.table[node])
                if state == "alive":
                    moved[node] = now  # answering: its beats are late, not gone
                    continue
                since = silent_since.setdefault(node, now)
                if state == "frozen" and now - since + SILENT_S < FROZEN_S:
                    continue
                self._declare(board, node, "lost" if state == "gone" else state)

    def sweep(self) -> Alarm | None:
        """Probe every other node now (a rank here died of a failed collective: a peer's node
        may be gone) and declare those whose launcher is gone or unreachable; the fault's alarm,
        or None if every node answers."""
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
        return alarm

    def close(self, *, ended: str) -> None:
        """Stop; ``ended`` says how this node's workers ended ("" if they all succeeded), so
        that the node that watches does not take this launcher's exit for a fault."""
        try:
            self._board.end(self.node, ended or "succeeded")
        except Exception as exc:  # the store is gone: the job is over
            logger.debug("could not say this node ended: %s", exc)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)
        self.port.close()
