"""A node's alarm relay: ``tether run``'s agent tells the ranks it started of each job-wide alarm
over a Unix socket, so that the job's store sees one look for alarms per node, not one per rank
(16,384 ranks looking ten times a second is 160,000 requests a second on one store thread).

The agent listens on an abstract Unix socket (no file to leave behind; the name is per network
namespace, so per node, and carries a random part: another process cannot guess it) and names
it to its workers in their environment (:data:`tether.config.AGENT_RELAY_ENV`). A rank
connects, checks that the listener runs as its own user, and reads lines of JSON, each one
alarm as the store holds it, in epoch order; a rank that connects late first gets the last
:data:`HISTORY` alarms sent, so none raised around its connection is missed.

An elastic worker holds a second connection, its membership's (:class:`MemberLink`): it says
which stable rank it is in a first line, then beats with one byte every 0.1 s, and hears each
membership decision its agent learns of (a line ``{"decision": ...}``; the newest one at once
as it joins). Its launcher reads the beats here (:meth:`RelayServer.beats`), so an elastic job's
heartbeats never reach the store: 160,000 writes a second at 16,384 ranks before.

The connection is also each side's word that the other lives: the agent's end closes when it
ends or dies, whatever killed it (:class:`~tether._exceptions.AgentGoneError`). A rank whose
agent died (its parent gone too) stops, saying so; one its agent let go of looks in the store
itself again; an elastic worker, whose beats nobody reads any more, stops on that error. A
member's connection that closes leaves its rank to the store again (its launcher reads its
beats there, should it beat there).

The agent's one look for alarms is :class:`AlarmLook`: a store request every :data:`LOOK_S` for
the whole node, whatever its number of ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from tether._exceptions import AgentGoneError, BadAlarmError, StoreUnreachableError
from tether._log import get_logger
from tether.job.alarm import NEWS_KEY, Alarm, AlarmBoard
from tether.job.elastic import Decision

__all__ = [
    "HISTORY",
    "LOOK_S",
    "AgentGoneError",
    "AlarmLook",
    "MemberLink",
    "RelayClient",
    "RelayServer",
    "relay_name",
]

logger = get_logger(__name__)

HISTORY = 16
"""The alarms a rank that connects late is sent first: more than a job raises while its ranks
start."""
SEND_TIMEOUT_S = 0.5
"""The most one rank's full socket holds up the others' alarm: a rank that reads nothing for
that long (stopped, its buffer of ~200 KB full) is dropped, and looks in the store itself."""
LOOK_S = 0.5
"""How often a node's agent looks for the next alarm: two store requests a second a node, and an
alarm reaches the node's ranks at most this long after it is raised. The look polls (one read
of the job's news counter) rather than blocking in the store's wait: a TCPStore wait that times
out logs a warning each time and leaves its connection's answer pending, and one that never
times out cannot be stopped (a thread blocked in C++ when the interpreter exits aborts the
process)."""
_ACCEPT_S = 0.5
_JOIN_S = 2.0
_MAX_LINE = 1 << 20
"""An alarm is a few hundred bytes; a longer line is not one."""
BEAT = b"."
"""A member's beat: one byte (10 a second a worker, read by one thread of its agent)."""


def relay_name() -> str:
    """A fresh name for an agent's relay socket (as the environment carries it: without the
    leading NUL that puts it in the abstract namespace)."""
    return f"tether-relay-{os.getpid()}-{secrets.token_hex(8)}"


class RelayServer:
    """The agent's end: accepts ranks on ``name``, sends each alarm to all of them, each
    decision to the elastic workers' membership connections, and counts their beats."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(256)
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self._ranks: list[socket.socket] = []
        """Every connection not (yet) a member's: each alarm goes to them."""
        self._members: dict[socket.socket, int] = {}
        """Membership connections -> their stable rank."""
        self._unread: dict[socket.socket, bytes] = {}
        """What a connection sent before its first line was whole."""
        self._beats: dict[int, int] = {}
        """Stable rank -> beats heard, all its incarnations together (it only grows: a new
        incarnation's first beat is a change)."""
        self._history: deque[bytes] = deque(maxlen=HISTORY)
        self._decision: tuple[int, bytes] = (-1, b"")
        """The newest decision sent (epoch, line): a member that connects gets it first."""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tether-agent-relay", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> int:
        with self._lock:
            return len(self._ranks) + len(self._members)

    def send(self, alarm: Alarm) -> None:
        """Tell every connected rank of ``alarm`` (and, later, every rank that connects)."""
        line = alarm.to_json().encode() + b"\n"
        with self._lock:
            self._history.append(line)
            for rank in list(self._ranks):
                self._send(rank, line)

    def send_decision(self, decision: Decision) -> None:
        """Tell every member connection of ``decision`` (and, later, each that connects),
        unless a newer one was sent already."""
        line = json.dumps({"decision": decision.to_data()}).encode() + b"\n"
        with self._lock:
            if decision.epoch <= self._decision[0]:
                return
            self._decision = (decision.epoch, line)
            for member in list(self._members):
                self._send(member, line)

    def send_lost(self, why: str) -> None:
        """Tell every member connection that the job's store is gone (the node's look failed):
        their workers stop as after a store that stopped answering them."""
        line = json.dumps({"store_lost": why}).encode() + b"\n"
        with self._lock:
            for member in list(self._members):
                self._send(member, line)

    def beats(self, stable: int) -> int | None:
        """The beats heard from ``stable``'s workers (all its incarnations' together); None
        while none of them is connected (not yet, or it left: its launcher asks the store)."""
        with self._lock:
            if stable not in self._members.values():
                return None
            return self._beats.get(stable, 0)

    def _send(self, conn: socket.socket, line: bytes) -> bool:
        """Send ``line`` to ``conn`` (under the lock); False, and the connection dropped, if it
        cannot take it."""
        try:
            conn.sendall(line)
        except OSError:  # gone, or not reading: a rank looks in the store itself
            self._drop(conn)
            return False
        return True

    def _drop(self, conn: socket.socket) -> None:
        """(Under the lock.) Forget ``conn``; shut, not closed: the serving thread, which
        watches it, closes it as it reads its end."""
        if conn in self._ranks:
            self._ranks.remove(conn)
        self._members.pop(conn, None)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                ready = self._selector.select(_ACCEPT_S)
            except (OSError, ValueError):  # closed
                return
            for key, _ in ready:
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:  # (BlockingIOError: another connection's turn) or closed
            return
        conn.settimeout(SEND_TIMEOUT_S)
        with self._lock:
            self._ranks.append(conn)
            self._selector.register(conn, selectors.EVENT_READ)
            for line in self._history:
                if not self._send(conn, line):
                    break

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        with self._lock:
            if not data:  # its end closed (the rank exited), or dropped by a send
                self._drop(conn)
                self._unread.pop(conn, None)
                self._selector.unregister(conn)
                conn.close()
                return
            stable = self._members.get(conn)
            if stable is None:
                data = self._join(conn, self._unread.pop(conn, b"") + data)
                stable = self._members.get(conn)
            if stable is not None:
                self._beats[stable] = self._beats.get(stable, 0) + data.count(BEAT)

    def _join(self, conn: socket.socket, data: bytes) -> bytes:
        """(Under the lock.) A connection's first line makes it ``stable``'s membership
        connection; what follows it."""
        if b"\n" not in data:
            if len(data) > _MAX_LINE:
                self._drop(conn)
            else:
                self._unread[conn] = data
            return b""
        line, rest = data.split(b"\n", 1)
        try:
            stable = int(json.loads(line)["member"])
        except (ValueError, KeyError, TypeError):
            logger.warning("a connection to the relay sent what is no member's line: dropped")
            self._drop(conn)
            return b""
        if conn in self._ranks:
            self._ranks.remove(conn)
        self._members[conn] = stable
        self._beats.setdefault(stable, 0)
        if self._decision[1]:
            self._send(conn, self._decision[1])
        return rest

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
        with self._lock:
            for conn in [*self._ranks, *self._members]:
                conn.close()
            self._ranks.clear()
            self._members.clear()
        self._selector.close()


class AlarmLook:
    """The node's one look for alarms: a thread that looks in ``board`` every ``every`` seconds
    from alarm ``epoch`` on and hands each alarm it finds, in order, to ``found`` (the relay to
    the node's ranks, the agent's watch). A look reads the job's news counter alone, and the
    alarms only when it moved. Each answer is also the node's word that the job's store answers
    it (:attr:`answered_at`): on a job of several nodes, the only store request the node makes
    in steady state."""

    def __init__(
        self,
        board: AlarmBoard,
        *,
        epoch: int,
        found: Callable[[Alarm], None],
        every: float = LOOK_S,
        replicated: bool = False,
    ) -> None:
        self.board = board
        self.epoch = epoch
        """The next alarm looked for."""
        self.every = every
        self.answered_at = time.monotonic()
        """When the store last answered a look (monotonic seconds; at first, when made)."""
        self.answered_ns = time.time_ns()
        """The same, as a Unix time in ns."""
        self.error: BaseException | None = None
        """What ended the look: the store gone (None while it looks, or once closed)."""
        self.news = -1
        """The job's news counter (:data:`~tether.job.alarm.NEWS_KEY`) as last read: it moves
        with each alarm and each membership decision (-1: not read yet)."""
        self._found = found
        self._replicated = replicated
        """A failed look is no verdict on a replicated store (an election): the next one may
        be answered."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-agent-alarms", daemon=True)

    @property
    def looking(self) -> bool:
        """Started, and neither closed nor ended by the store's failure."""
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = _JOIN_S) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failing = False
        seen = -1  # the news counter when last read in full (-1: read the alarms once)
        while not self._stop.wait(self.every):
            try:
                news = int(self.board.store.add(NEWS_KEY, 0))
                if news != seen:
                    self._read_alarms()
            except Exception as exc:
                if not self._replicated:  # the store has gone: the job is over
                    logger.debug("alarm look ends: %s", exc)
                    self.error = exc
                    return
                if not failing:  # silence past the cut-off decides
                    logger.warning("the job's store does not answer (%s): looking on", exc)
                failing = True
                continue
            if failing:
                logger.warning("the job's store answers again")
                failing = False
            seen = self.news = news
            self._answered()

    def _read_alarms(self) -> None:
        """Hand on every alarm raised from :attr:`epoch` on."""
        while True:
            try:
                alarm = self.board.get(self.epoch)
            except BadAlarmError:  # someone else's key: the next one may be an alarm
                self.epoch += 1
                continue
            if alarm is None:
                return
            self.epoch = alarm.epoch + 1
            try:
                self._found(alarm)
            except Exception:  # the next alarm must still be found
                logger.exception("could not hand on alarm %s", alarm.event_id)

    def _answered(self) -> None:
        self.answered_at, self.answered_ns = time.monotonic(), time.time_ns()


class RelayClient:
    """A rank's end: the alarms its agent relays."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    @classmethod
    def connect(cls, name: str) -> RelayClient:
        """Connect to the agent's relay ``name``; OSError if nobody listens there (yet), or
        :class:`PermissionError` if the listener is not of this user."""
        return cls(_connect(name))

    def fileno(self) -> int:
        return self._sock.fileno()

    def next(self, timeout: float) -> Alarm | None:
        """The next alarm relayed within ``timeout`` seconds, else None. Raises
        :class:`AgentGoneError` once the agent's end is closed, or it sends what is no alarm."""
        while b"\n" not in self._buffer:
            self._sock.settimeout(timeout)
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                return None
            except OSError as exc:
                raise AgentGoneError(f"the relay's connection failed: {exc}") from exc
            if not chunk:
                raise AgentGoneError("the agent closed the relay (it ended, or dropped us)")
            self._buffer += chunk
            if len(self._buffer) > _MAX_LINE:
                raise AgentGoneError("the relay sent a line too long to be an alarm")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return Alarm.from_json(line)
        except Exception as exc:
            raise AgentGoneError(f"the relay sent what is not an alarm: {exc}") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class MemberLink:
    """An elastic worker's membership connection to its agent: beats go out, decisions come
    in. Not thread-safe: the worker's heartbeat thread alone uses it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    @classmethod
    def join(cls, name: str, stable: int) -> MemberLink:
        """Connect to the agent's relay ``name`` as stable rank ``stable``; OSError (a
        :class:`PermissionError` for another user's listener) if nobody of ours listens."""
        sock = _connect(name)
        try:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendall(json.dumps({"member": stable}).encode() + b"\n")
        except OSError:
            sock.close()
            raise
        return cls(sock)

    def beat(self) -> list[Decision]:
        """Beat once; the decisions the agent sent since the last beat, in order. Raises
        :class:`AgentGoneError` once the agent's end is closed or sends what is no decision, and
        :class:`StoreUnreachableError` once it said the job's store is gone."""
        try:
            self._sock.sendall(BEAT)
            while True:
                self._sock.setblocking(False)
                try:
                    chunk = self._sock.recv(65536)
                except BlockingIOError:
                    break
                finally:
                    self._sock.settimeout(SEND_TIMEOUT_S)
                if not chunk:
                    raise AgentGoneError("the agent closed the relay (it ended, or dropped us)")
                self._buffer += chunk
        except OSError as exc:  # (a full socket for SEND_TIMEOUT_S: the agent reads no more)
            raise AgentGoneError(f"the relay's connection failed: {exc}") from exc
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > _MAX_LINE:
            raise AgentGoneError("the relay sent a line too long to be a decision")
        decisions = []
        for line in lines:
            try:
                data = json.loads(line)
                if "event_id" in data:  # an alarm, sent as it connected, before it said who it is
                    continue
                if "store_lost" in data:
                    raise StoreUnreachableError(str(data["store_lost"]))
                decisions.append(Decision.from_data(data["decision"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise AgentGoneError(
                    f"the relay sent what is not a decision: {line[:200]!r}"
                ) from exc
        return decisions

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _connect(name: str) -> socket.socket:
    """A connection to the agent's relay ``name``, whose listener runs as this user."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise PermissionError(f"the relay's listener runs as uid {uid}, not ours")
    except OSError:
        sock.close()
        raise
    return sock
