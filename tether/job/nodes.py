"""The nodes of a job that spans several hosts: what each publishes in the job's store, and how
each tells the others it is alive.

Each node's launcher (``tether run``'s agent) publishes where it can be reached and beats, so
that the others can bring its part of an event and tell when it is gone:

    tether/node/<attempt>/<k>        JSON :class:`NodeInfo` of node k (torchrun's node rank) in
                                     torchrun attempt <attempt>
    tether/node/<attempt>/<k>/beat   a counter node k's launcher adds to (store.add) while it
                                     beats through the store
    tether/node/<attempt>/<k>/ended  how node k's workers ended ("succeeded", "failed"), set by
                                     its launcher as it stops beating

A node beats every :data:`BEAT_S` to the node that watches (:class:`BeatPort`: UDP, no store
request), which judges the others by their beats (:class:`NodeWatch`). Its look for alarms
(:class:`tether.job.relay.AlarmLook`, 2 requests a second) is then its only store request in
steady state, and its answers the node's word that the store is there; until the look runs, a
node also beats through the store, for that word alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "BEAT_S",
    "FROZEN_S",
    "SILENT_S",
    "BeatPort",
    "NodeBoard",
    "NodeInfo",
    "NodeWatch",
    "ping_state",
]

_NODE = "tether/node"
BEAT_S = 0.25
"""How often a launcher beats: a node silent for a few of these is looked at more closely."""
SILENT_S = 1.0
"""A node whose beat has not moved for this long is probed (four beats missed; a loaded host's
launcher beats late by tens of milliseconds, not a second)."""
FROZEN_S = 3.0
"""A node whose host accepts connections but whose launcher neither beats nor answers for this
long is frozen. Longer than :data:`SILENT_S`: a starved launcher also answers late, and a
frozen verdict ends the job."""


def ping_state(address: str, port: int, token: str, timeout: float) -> str:
    """How the launcher listening at ``address:port`` answers a ``GET /ping`` now: ``alive``;
    ``gone`` (its host refuses the connection: nothing listens there, the host is up; or what
    answers is not a launcher of this job: the token is refused); ``frozen`` (its host takes the
    connection, the launcher does not answer within ``timeout``: stopped, or starved); or
    ``unreachable`` (nothing answers the connection within ``timeout``: the host is down, or the
    link to it). A stopped process's socket still takes connections (the kernel answers), so only
    the request's answer says that the launcher itself runs. At most ``2 * timeout``."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "unreachable"
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", "/ping", headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        reply.read()
    except ConnectionError:  # reset: the launcher died as it was asked
        return "gone"
    except (OSError, http.client.HTTPException):
        return "frozen"
    finally:
        conn.close()
    return "alive" if reply.status == 200 else "gone"


@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    node: int
    """torchrun's node rank (``--node-rank``)."""
    host: str
    address: str
    """Where the other nodes reach this node's launcher (the address it reaches node 0 from)."""
    port: int
    """Its launcher's event port (0: it receives nothing)."""
    token: str
    """What a request to that port must carry."""
    ranks: tuple[int, ...]
    """The global ranks this node runs."""
    pid: int
    dump_dir: str
    beat_port: int = 0
    """Where its launcher takes the other nodes' beats (UDP; 0: it takes none)."""
    beat_key: str = ""
    """What its beats are signed with: kept in the job's store alone (the token goes in every
    request's header; a beat that could be made by whoever saw one would hide a dead node)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo | None:
        """The record, or None where the key holds anything else."""
        try:
            data = json.loads(raw)
            info = cls(
                node=int(data["node"]),
                host=str(data["host"]),
                address=str(data["address"]),
                port=int(data["port"]),
                token=str(data["token"]),
                ranks=tuple(int(r) for r in data["ranks"]),
                pid=int(data["pid"]),
                dump_dir=str(data["dump_dir"]),
                beat_port=int(data.get("beat_port", 0)),
                beat_key=str(data.get("beat_key", "")),
            )
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        return info

    def describe(self) -> str:
        """``node1 (ranks 2-3)``."""
        return f"{self.host} ({span(self.ranks)})"


def span(ranks: Any) -> str:
    """``rank 3``, ``ranks 2-3``, ``ranks 0, 2``, ``ranks 0-516, 518-1023``: runs as ranges, so
    that 1,023 ranks are a few words."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return "ranks " + ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


class NodeBoard:
    """The node keys of one job's store (one torchrun attempt)."""

    def __init__(self, store: Any, attempt: int) -> None:
        self.store = store
        self.attempt = attempt

    def _key(self, node: int) -> str:
        return f"{_NODE}/{self.attempt}/{node}"

    def publish(self, info: NodeInfo) -> None:
        self.store.set(self._key(info.node), info.to_json())

    def nodes(self, count: int) -> dict[int, NodeInfo]:
        """The nodes of ``0..count-1`` that have published, by node rank."""
        out = {}
        for node in range(count):
            key = self._key(node)
            if self.store.check([key]):
                info = NodeInfo.from_json(self.store.get(key))
                if info is not None and info.node == node:
                    out[node] = info
        return out

    def beat(self, node: int, by: int = 1) -> int:
        """Add ``by`` to ``node``'s beat counter (0: read it, in one round trip); the count."""
        return int(self.store.add(f"{self._key(node)}/beat", by))

    def end(self, node: int, how: str) -> None:
        self.store.set(f"{self._key(node)}/ended", how)

    def ended(self, node: int) -> bool:
        return bool(self.store.check([f"{self._key(node)}/ended"]))


class NodeWatch:
    """The watching node's verdicts on the others, from their beat counters read over time and
    a probe of each that falls silent: a node silent for :data:`SILENT_S` is probed; one whose
    launcher is gone, or whose host does not answer, is a fault at once; one whose host takes
    the connection but whose launcher does not answer, after :data:`FROZEN_S`."""

    def __init__(self) -> None:
        self.heard: dict[int, int] = {}
        """Node -> when its beat last moved (Unix ns), as seen here."""
        self._last: dict[int, int] = {}
        self._moved: dict[int, float] = {}
        self._silent_since: dict[int, float] = {}

    def silent(self, beats: dict[int, int], now: float) -> list[int]:
        """Take in ``beats`` (node -> counter) read at ``now`` (monotonic seconds); the nodes
        silent for :data:`SILENT_S`, to probe."""
        out = []
        for node, count in beats.items():
            if self._last.get(node) != count:
                self._last[node], self._moved[node] = count, now
                self.heard[node] = time.time_ns()
                self._silent_since.pop(node, None)
            elif now - self._moved.setdefault(node, now) >= SILENT_S:
                out.append(node)
        return out

    def judge(
        self,
        beats: dict[int, int],
        now: float,
        *,
        ended: Callable[[int], bool],
        probe: Callable[[int], str],
    ) -> list[tuple[int, str, str | None]]:
        """One round of the watch: take in ``beats`` read at ``now``, probe each node silent
        since :data:`SILENT_S` whose launcher has not ``ended`` with its workers; for each,
        ``(node, what the probe said, the verdict or None)``."""
        out = []
        for node in self.silent(beats, now):
            if not ended(node):
                state = probe(node)
                out.append((node, state, self.probed(node, state, now)))
        return out

    def probed(self, node: int, state: str, now: float) -> str | None:
        """The verdict on silent ``node``, whose launcher's probe said ``state``
        (:func:`ping_state`) at ``now``: ``lost``, ``unreachable``, ``frozen``, or None while
        it is no fault (yet)."""
        if state == "alive":
            self._moved[node] = now  # answering: its beats are late, not gone
            self._silent_since.pop(node, None)  # a frozen verdict needs silence since then
            return None
        since = self._silent_since.setdefault(node, now)
        if state == "frozen" and now - since + SILENT_S < FROZEN_S:
            return None
        return "lost" if state == "gone" else state


_MAC_BYTES = 16
_RECV_S = 0.5


class BeatPort:
    """A launcher's node beats off the job's store: it sends its own to the watching node as UDP
    datagrams, and (on the watching node) takes the others'. 1,024 nodes beating 4 times a second
    are 4,096 datagrams a second to one launcher (~10 µs each to take), where the same beats
    through the store are 4,096 requests a second on its one thread, and a read of them all.

    A datagram is ``<node> <count> <mac>``, the mac an HMAC-SHA256 of ``<node> <count>`` keyed
    by the node's published :attr:`NodeInfo.beat_key` (truncated to 16 bytes): a beat is taken
    only from a node that knows its key, and an old one (a lower count) changes nothing. A lost
    datagram is one beat missed; a node silent for :data:`SILENT_S` is probed before any
    verdict, so one whose datagrams never arrive (UDP blocked between the nodes) is probed every
    second, and answers."""

    def __init__(self, address: str, key: str) -> None:
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_DGRAM)[0][0]
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._sock.bind((address, 0))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(_RECV_S)
        self.port = int(self._sock.getsockname()[1])
        self._key = key.encode()
        self._sent = 0
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _mac(key: bytes, body: bytes) -> bytes:
        return hmac.new(key, body, hashlib.sha256).digest()[:_MAC_BYTES]

    def send(self, node: int, to: NodeInfo) -> None:
        """Beat once for ``node`` to ``to``'s launcher (nothing if it takes no beats)."""
        if not to.beat_port:
            return
        self._sent += 1
        body = f"{node} {self._sent}".encode()
        with contextlib.suppress(OSError):  # no route now: a beat missed, as on a dead link
            self._sock.sendto(body + b" " + self._mac(self._key, body), (to.address, to.beat_port))

    def take(self, key_of: Callable[[int], str | None]) -> None:
        """Take the other nodes' beats from now on, on a thread of its own; ``key_of(node)`` is
        the beat key node published (None: not known yet, its beat is dropped)."""
        self._thread = threading.Thread(
            target=self._take, args=(key_of,), name="tether-agent-beats-in", daemon=True
        )
        self._thread.start()

    def counts(self, nodes: list[int]) -> dict[int, int]:
        """The last beat count taken from each of ``nodes`` (0: none yet)."""
        with self._lock:
            return {node: self._counts.get(node, 0) for node in nodes}

    def _take(self, key_of: Callable[[int], str | None]) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(256)
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            try:
                node_s, count_s, mac = data.split(b" ", 2)
                node, count = int(node_s), int(count_s)
            except ValueError:
                continue
            key = key_of(node)
            if not key or not hmac.compare_digest(
                mac, self._mac(key.encode(), node_s + b" " + count_s)
            ):
                continue
            with self._lock:
                if count > self._counts.get(node, 0):
                    self._counts[node] = count

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_RECV_S + 1.0)  # its next receive times out and sees it closed
        self._sock.close()
