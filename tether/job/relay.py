"""A node's alarm relay: ``tether run``'s agent tells the ranks it started of each job-wide alarm
over a Unix socket, so that the job's store sees one look for alarms per node, not one per rank
(16,384 ranks looking ten times a second is 160,000 requests a second on one store thread).

The agent listens on an abstract Unix socket (no file to leave behind; the name is per network
namespace, so per node, and carries a random part: another process cannot guess it) and names
it to its workers in their environment (:data:`tether.config.AGENT_RELAY_ENV`). A rank
connects, checks that the listener runs as its own user, and reads lines of JSON, each one
alarm as the store holds it, in epoch order; a rank that connects late first gets the last
:data:`HISTORY` alarms sent, so none raised around its connection is missed. Nothing goes from
a rank to the agent.

The connection is also each side's word that the other lives: the agent's end closes when it
dies, whatever killed it, and the rank then looks in the store itself again
(:class:`~tether._exceptions.AgentGoneError`).

The agent's one look for alarms is :class:`AlarmLook`: a store request every :data:`LOOK_S` for
the whole node, whatever its number of ranks.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from tether._exceptions import AgentGoneError, BadAlarmError
from tether._log import get_logger
from tether.job.alarm import Alarm, AlarmBoard

__all__ = [
    "HISTORY",
    "LOOK_S",
    "AgentGoneError",
    "AlarmLook",
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
alarm reaches the node's ranks at most this long after it is raised. The look polls (one key
check) rather than blocking in the store's wait: a TCPStore wait that times out logs a warning
each time and leaves its connection's answer pending, and one that never times out cannot be
stopped (a thread blocked in C++ when the interpreter exits aborts the process)."""
_ACCEPT_S = 0.5
_JOIN_S = 2.0
_MAX_LINE = 1 << 20
"""An alarm is a few hundred bytes; a longer line is not one."""


def relay_name() -> str:
    """A fresh name for an agent's relay socket (as the environment carries it: without the
    leading NUL that puts it in the abstract namespace)."""
    return f"tether-relay-{os.getpid()}-{secrets.token_hex(8)}"


class RelayServer:
    """The agent's end: accepts ranks on ``name`` and sends each alarm to all of them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(256)
        self._sock.settimeout(_ACCEPT_S)
        self._lock = threading.Lock()
        self._ranks: list[socket.socket] = []
        self._history: deque[bytes] = deque(maxlen=HISTORY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tether-agent-relay", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> int:
        with self._lock:
            return len(self._ranks)

    def send(self, alarm: Alarm) -> None:
        """Tell every connected rank of ``alarm`` (and, later, every rank that connects)."""
        line = alarm.to_json().encode() + b"\n"
        with self._lock:
            self._history.append(line)
            for rank in list(self._ranks):
                self._send(rank, line)

    def _send(self, rank: socket.socket, line: bytes) -> bool:
        """Send ``line`` to ``rank`` (under the lock); False, and the rank dropped, if it
        cannot take it."""
        try:
            rank.sendall(line)
        except OSError:  # gone, or not reading: it looks in the store itself
            self._ranks.remove(rank)
            rank.close()
            return False
        return True

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                rank, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            rank.settimeout(SEND_TIMEOUT_S)
            with self._lock:
                self._ranks.append(rank)
                for line in self._history:
                    if not self._send(rank, line):
                        break

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
        with self._lock:
            for rank in self._ranks:
                rank.close()
            self._ranks.clear()


class AlarmLook:
    """The node's one look for alarms: a thread that looks in ``board`` every ``every`` seconds
    from alarm ``epoch`` on and hands each alarm it finds, in order, to ``found`` (the relay to
    the node's ranks, the agent's watch). Each answer is also the node's word that the job's
    store answers it (:attr:`answered_at`): on a job of several nodes, the only store request
    the node makes in steady state."""

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
        while not self._stop.wait(self.every):
            try:
                alarm = self.board.get(self.epoch)
            except BadAlarmError:  # someone else's key: the next one may be an alarm
                self._answered()
                self.epoch += 1
                continue
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
            self._answered()
            if alarm is None:
                continue
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
        return cls(sock)

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
