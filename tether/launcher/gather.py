"""One event, whole, in one place: the launchers of a job on several nodes bring their node's
part of every event to the node that assembles it, over the network (no shared filesystem).

Every launcher of a job that spans nodes serves one small HTTP endpoint (:class:`EventPort`),
bound to the address it reaches node 0 from and guarded by a token it publishes in the job's
store (:class:`tether.job.nodes.NodeInfo`):

    GET  /ping                  who answers, and since when it runs (liveness probes)
    GET  /event/<event_id>      the file names the receiver has of that event (JSON list)
    PUT  /event/<event_id>      a tar of files of that event: each one not there yet is written
                                (atomically); the header ``X-Tether-Node`` says whose part it is,
                                ``X-Tether-Cut-Off: 1`` that its sender was cut off from the job
                                (it goes into the event about that node: :meth:`EventPort.join`)
    POST /ended                 node 0's launcher ended the job (``{"how": ...}``): the job's store
                                goes with it, which is then no cut-off (:func:`say_ended`)

A node's launcher sends its part once its own ranks have answered (:func:`send_part`): first it
asks what the receiver has, then sends the rest. On a shared filesystem (``--dump-dir`` on NFS)
the receiver already has every file, and nothing is sent or written twice. The receiver writes
only plain files of plain names into the event's directory, never over one it has.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import http.server
import io
import json
import os
import re
import secrets
import socket
import tarfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tether._log import get_logger
from tether.events.layout import check_event_id, temp_name
from tether.job.nodes import NodeInfo, ping_state

__all__ = [
    "SETTLE_S",
    "EventPort",
    "Part",
    "local_address",
    "probe",
    "say_ended",
    "send_part",
]

logger = get_logger(__name__)

SEND_TIMEOUT_S = 10.0
"""How long one request may take (connect, then every read and write): a node whose receiver
does not answer within it is reported unreachable, never waited on for good."""
PROBE_TIMEOUT_S = 0.5
"""A liveness probe's bound: a launcher answers /ping in a millisecond; a loaded host in tens."""
SETTLE_S = 2.0
"""How long a node that does not answer is asked again where its state is no hurry (a node cut
off from the job names who it cannot reach): TCP resends a lost SYN after 1 s, and a loaded
host's bridge forwards late, so one unanswered 0.5 s probe says nothing of the node."""
MAX_PART_BYTES = 64 << 30
"""The most one node's part of one event may weigh (64 GiB; 16 ranks' dumps are megabytes)."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)
_JOIN_S = 2.0


def local_address(peer: str) -> str:
    """The address of this host's interface that reaches ``peer`` (no packet is sent: a UDP
    socket's connect only picks the route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Part:
    """What one node's launcher sent of one event."""

    def __init__(self, node: int, names: list[str], written: list[str]) -> None:
        self.node = node
        self.names = names
        """Every file the sender has of the event."""
        self.written = written
        """Those the receiver wrote (the rest it had: a shared filesystem)."""


class EventPort:
    """This launcher's event endpoint: receives the other nodes' parts into ``dump_dir``."""

    def __init__(self, dump_dir: Path, *, node: int, host: str, address: str) -> None:
        self.dump_dir = dump_dir
        self.node = node
        self.host = host
        self.token = secrets.token_urlsafe(24)
        self.started_ns = time.time_ns()
        self._parts: dict[str, dict[int, Part]] = {}
        self._joins: dict[int, str] = {}
        """Node -> the event its part goes into when it comes cut off from the job."""
        self._join_default: str | None = None
        self._unjoined: list[str] = []
        """Events of cut-off parts that came before this node knew where they go (:meth:`adopt`)."""
        self.ended: str | None = None
        """How node 0's launcher said the job ended, once it did."""
        self._cond = threading.Condition()
        port = self

        class Handler(_Handler):
            owner = port

        self._server = _Server((address, 0), Handler)
        self.address = address
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="tether-agent-events",
            daemon=True,
        )
        self._thread.start()

    def info(self, *, ranks: Iterable[int]) -> NodeInfo:
        return NodeInfo(
            node=self.node,
            host=self.host,
            address=self.address,
            port=self.port,
            token=self.token,
            ranks=tuple(sorted(ranks)),
            pid=os.getpid(),
            dump_dir=str(self.dump_dir),
        )

    def join(self, event_id: str, *, node: int | None = None) -> None:
        """The part a node sends once it was cut off from the job (it could not know this
        event's id) goes into ``event_id``: that of ``node``, or of any node (None)."""
        with self._cond:
            if node is None:
                self._join_default = event_id
            else:
                self._joins.setdefault(node, event_id)

    def joined(self, node: int) -> str | None:
        """The event a cut-off node's part goes into, if any."""
        with self._cond:
            return self._joins.get(node, self._join_default)

    def adopt(self, event_id: str) -> str:
        """This node is cut off too and makes an event of its own: the one it takes. Another
        survivor that lost the job's store first may already have sent its part here, into an
        event of its own making: that one is taken, so that both halves are in one event;
        otherwise ``event_id``, which every cut-off part goes into from now on."""
        with self._cond:
            if self._join_default is None:
                self._join_default = self._unjoined[0] if self._unjoined else event_id
            return self._join_default

    def _cut_off_event(self, node: int, event_id: str) -> str:
        """The event a cut-off part from ``node`` named ``event_id`` goes into."""
        with self._cond:
            joined = self._joins.get(node, self._join_default)
            if joined is not None:
                return joined
            if event_id not in self._unjoined:
                self._unjoined.append(event_id)
            return event_id

    def parts(self, event_id: str) -> dict[int, Part]:
        with self._cond:
            return dict(self._parts.get(event_id, {}))

    def wait_parts(self, event_id: str, nodes: Iterable[int], timeout: float) -> dict[int, Part]:
        """Wait up to ``timeout`` seconds for the parts of ``nodes``; returns those in."""
        wanted = set(nodes)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not wanted <= set(self._parts.get(event_id, {})):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return dict(self._parts.get(event_id, {}))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=_JOIN_S)

    # -- the handler's side --------------------------------------------------------------------
    def _have(self, event_id: str) -> list[str]:
        event_dir = self.dump_dir / event_id
        if not event_dir.is_dir():
            return []
        return sorted(p.name for p in event_dir.iterdir() if _NAME.fullmatch(p.name))

    def _receive(self, event_id: str, node: int, body: Any, length: int) -> Part:
        event_dir = self.dump_dir / event_id
        event_dir.mkdir(parents=True, exist_ok=True)
        names: list[str] = []
        written: list[str] = []
        with tarfile.open(fileobj=_Bounded(body, length), mode="r|") as tar:
            for member in tar:
                # A regular member only: a sparse one would write holes it never sent.
                if member.type not in _REGULAR or not _NAME.fullmatch(member.name):
                    raise ValueError(f"refused {member.name!r}: not a plain file of a plain name")
                names.append(member.name)
                target = event_dir / member.name
                source = tar.extractfile(member)
                if target.exists() or source is None:
                    continue  # never over a file the event has (its own rank's, or shared)
                tmp = temp_name(target)
                try:
                    with open(tmp, "wb") as out:
                        while chunk := source.read(1 << 20):
                            out.write(chunk)
                    os.link(tmp, target)  # fails where a writer got there first: theirs stays
                    written.append(member.name)
                except FileExistsError:
                    pass
                finally:
                    tmp.unlink(missing_ok=True)
        part = Part(node, names, written)
        with self._cond:
            self._parts.setdefault(event_id, {})[node] = part
            self._cond.notify_all()
        return part


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def process_request(self, request: Any, client_address: Any) -> None:
        # socketserver's own, with the thread named (each request ends within SEND_TIMEOUT_S).
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="tether-agent-events-request",
            daemon=True,
        )
        thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A prober that gave up (a frozen node answering once thawed): not worth a traceback.
        logger.debug("event port: a request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: EventPort
    protocol_version = "HTTP/1.1"
    timeout = SEND_TIMEOUT_S  # a peer that stops sending mid-request frees the thread

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("event port: " + format, *args)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {self.owner.token}".encode()):
            return True
        self._reply(403, {"error": "a token is required"})
        return False

    def _reply(self, status: int, body: Any) -> None:
        if status >= 400:
            self.close_connection = True  # the refused request's body is not read
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event_id(self) -> str | None:
        prefix = "/event/"
        if not self.path.startswith(prefix):
            self._reply(404, {"error": f"no such path {self.path[:100]!r}"})
            return None
        try:
            event_id = check_event_id(self.path[len(prefix) :])
        except ValueError as exc:
            self._reply(400, {"error": str(exc)})
            return None
        if self.headers.get("X-Tether-Cut-Off") == "1":
            try:
                node = int(self.headers.get("X-Tether-Node", ""))
            except ValueError:
                self._reply(400, {"error": "a cut-off part says its node (X-Tether-Node)"})
                return None
            event_id = self.owner._cut_off_event(node, event_id)
        return event_id

    def do_GET(self) -> None:
        if not self._authorized():
            return
        owner = self.owner
        if self.path == "/ping":
            self._reply(200, {"node": owner.node, "host": owner.host, "since": owner.started_ns})
            return
        event_id = self._event_id()
        if event_id is not None:
            self._reply(200, owner._have(event_id))

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path != "/ended":
            self._reply(404, {"error": f"no such path {self.path[:100]!r}"})
            return
        try:
            length = min(max(int(self.headers.get("Content-Length", "0")), 0), 4096)
            how = str(json.loads(self.rfile.read(length))["how"])[:200]
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": f"a JSON object with 'how' is required ({exc})"})
            return
        with self.owner._cond:
            self.owner.ended = how
            self.owner._cond.notify_all()
        self._reply(200, {})

    def do_PUT(self) -> None:
        if not self._authorized():
            return
        event_id = self._event_id()
        if event_id is None:
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            node = int(self.headers.get("X-Tether-Node", ""))
        except ValueError:
            self._reply(400, {"error": "Content-Length and X-Tether-Node are required"})
            return
        if not 0 <= length <= MAX_PART_BYTES:
            self._reply(413, {"error": f"a part is at most {MAX_PART_BYTES} bytes"})
            return
        try:
            part = self.owner._receive(event_id, node, self.rfile, length)
        except (tarfile.TarError, ValueError, OSError) as exc:
            logger.warning("refused node %d's part of %s: %s", node, event_id, exc)
            self.close_connection = True
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, {"written": part.written, "event": event_id})


class _Bounded(io.RawIOBase):
    """At most ``length`` bytes of a socket's stream: a tar that claims more stops there."""

    def __init__(self, raw: Any, length: int) -> None:
        self._raw = raw
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        data = self._raw.read(len(view))
        view[: len(data)] = data
        self._left -= len(data)
        return len(data)


def _request(
    to: NodeInfo, method: str, path: str, *, body: bytes | None = None, timeout: float,
    headers: dict[str, str] | None = None,
) -> Any:  # fmt: skip
    conn = http.client.HTTPConnection(to.address, to.port, timeout=timeout)
    try:
        conn.request(
            method, path, body=body,
            headers={"Authorization": f"Bearer {to.token}", **(headers or {})},
        )  # fmt: skip
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    if reply.status != 200:
        raise OSError(f"{to.host} answered {reply.status}: {data[:200].decode(errors='replace')}")
    return json.loads(data)


def send_part(
    event_dir: Path,
    to: NodeInfo,
    *,
    node: int,
    cut_off: bool = False,
    timeout: float = SEND_TIMEOUT_S,
) -> tuple[str, list[str]]:
    """Send this node's files of ``event_dir`` to the node that assembles it; returns the event
    they went into there and the names it wrote. ``cut_off``: this node was cut off from the
    job, and its event is its own (the receiver puts it into the event about this node).
    :class:`OSError` when it cannot be reached."""
    headers = {"X-Tether-Node": str(node)}
    if cut_off:
        headers["X-Tether-Cut-Off"] = "1"
    have = set(_request(to, "GET", f"/event/{event_dir.name}", timeout=timeout, headers=headers))
    mine = sorted(p for p in event_dir.iterdir() if _NAME.fullmatch(p.name) and p.is_file())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in mine:
            if path.name in have:  # (all of them on a shared filesystem)
                info = tarfile.TarInfo(path.name)  # named, not sent: the receiver lists it
                tar.addfile(info, io.BytesIO(b""))
                continue
            with contextlib.suppress(FileNotFoundError):
                tar.add(path, arcname=path.name, recursive=False)
    reply = _request(
        to, "PUT", f"/event/{event_dir.name}", body=buf.getvalue(), timeout=timeout,
        headers={**headers, "Content-Type": "application/x-tar"},
    )  # fmt: skip
    return str(reply.get("event", event_dir.name)), [str(n) for n in reply.get("written", [])]


def say_ended(nodes: list[NodeInfo], how: str, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Tell the other nodes' launchers that the job ended (node 0's launcher, as it exits with
    the job's store), all at once; one that does not hear it takes the store's loss for a
    cut-off, which is bounded."""
    body = json.dumps({"how": how}).encode()

    def tell(to: NodeInfo) -> None:
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            _request(to, "POST", "/ended", body=body, timeout=timeout)

    threads = [
        threading.Thread(target=tell, args=(to,), name="tether-agent-ended", daemon=True)
        for to in nodes
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout * 2)


def probe(to: NodeInfo, *, timeout: float = PROBE_TIMEOUT_S, settle: float = 0.0) -> str:
    """How node ``to``'s launcher answers now (``alive``, ``gone``, ``frozen``, ``unreachable``:
    :func:`tether.job.nodes.ping_state`). ``settle``: where no verdict is urgent, a node that does
    not answer is asked again, with a longer bound, for that long (:data:`SETTLE_S`)."""
    state = ping_state(to.address, to.port, to.token, timeout)
    deadline = time.monotonic() + settle
    while state in ("frozen", "unreachable") and time.monotonic() < deadline:
        state = ping_state(to.address, to.port, to.token, max(deadline - time.monotonic(), timeout))
    return state
