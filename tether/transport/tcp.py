"""Any-host backend: registered memory served over several TCP sockets.

Bytes go straight between tensor memory and the kernel: the sender hands a memoryview of the
tensor to ``sendmsg``/``sendall`` and the receiver ``recv_into`` a memoryview of the destination.
Only small frames (a header and payload that arrive in one ``recv``) are copied out of a scratch
buffer, which is cheaper than a second system call. Large transfers are cut into frames of
``config.tcp.frame_bytes`` spread over ``config.tcp.flows`` sockets, one thread per extra socket.
Transfers up to 64 KiB go in lock step on an idle socket (one ``sendmsg``, one ``poll`` bounded by
the deadline, one ``recv``). Both sides poll for ``config.tcp.busy_poll_us`` before they sleep (the
caller for the reply, the server for the next request): on the project's VMs a wake-up costs more
than the rest of a 16 B round trip, and the polling backs off where it does not pay. Sockets
block; receive timeouts are armed only while a frame is under way (an idle owner waits for the
next request without one), see ``_set_io_timeout``.

Wire format (little endian). A connection opens with ``HELLO = magic, version, token[16]``; the
server closes it unless the token (from its URL) matches. Then requests, answered in order:

    request  = op u8 (1 write, 2 read), 3 zero bytes, seq u32, id u64, key[16], offset u64,
               length u64                                     48 bytes, then a write's payload
    response = status u8, 3 zero bytes, seq u32, length u64   16 bytes, then a read's payload

A request that cannot be parsed closes its connection (only that one); a well-formed request with
a wrong key, an unknown buffer or a range outside the registration gets an error status (a write's
payload is read and dropped) and the connection stays usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import queue
import secrets
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from tether import _log
from tether._exceptions import (
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
    TransportTimeoutError,
)
from tether.transport.backend import Backend, Op
from tether.transport.config import TransportConfig
from tether.transport.memory import ByteView, Pair, RegisteredMemory, RemoteRange

if TYPE_CHECKING:
    import torch

__all__ = ["TcpRemoteBuffer", "TcpTransport"]

logger = _log.get_logger(__name__)

_HELLO = struct.Struct("<8sI16s")
_MAGIC = b"tetherT1"
_REQ = struct.Struct("<B3xIQ16sQQ")
_RESP = struct.Struct("<B3xIQ")
_WRITE, _READ = 1, 2
_OK, _BAD_BUFFER, _BAD_RANGE = 0, 1, 2
_MAX_FRAME = 64 << 20
_SCRATCH = 64 << 10
_SMALL = _SCRATCH - _RESP.size
"""Transfers up to this size take the lock-step path (the reply and payload fit the scratch)."""
_STOP_HELPER_S = 5.0
"""How long a transfer that timed out waits for a helper whose socket it broke to stop."""


def _timeval(secs: float) -> bytes:
    return struct.pack("ll", int(secs), int((secs % 1) * 1e6))


_NO_TIMEOUT = _timeval(0)


def _set_io_timeout(sock: socket.socket, secs: float) -> None:
    """Bounds every blocking send/recv of a blocking socket (SO_RCVTIMEO/SO_SNDTIMEO); an expiry
    surfaces as BlockingIOError/TimeoutError (EAGAIN).

    Cheaper than Python's socket timeouts (non-blocking fd and a poll() per call), but not free:
    a receive that sleeps with SO_RCVTIMEO set arms a kernel timer, measured at 5-15 us per
    round trip on the project's VMs. So receive timeouts are armed only where a wait can stall
    mid-frame (bulk frames, handshakes); the small-message path waits with one ``poll``. A send
    timeout costs nothing unless the send blocks, so it stays set."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(secs))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(secs))


@contextlib.contextmanager
def _bounded_recv(sock: socket.socket, secs: float) -> Iterator[None]:
    """Bounds the receives within the block (a frame under way); unbounded again after."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(secs))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_TIMEOUT)


class _Closed(Exception):
    """The other side closed the connection."""


class _Reader:
    """Reads frames from a socket; small payloads come with their header in one recv."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = memoryview(bytearray(_SCRATCH))
        self.start = self.end = 0

    def fill(self, n: int) -> None:
        """Buffers at least ``n`` unread bytes."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start:  # keep the unread bytes at the front
            self.buf[: self.end - self.start] = self.buf[self.start : self.end]
            self.end -= self.start
            self.start = 0
        while self.end < n:
            got = self.sock.recv_into(self.buf[self.end :])
            if not got:
                raise _Closed
            self.end += got

    def exact(self, n: int) -> memoryview:
        if self.end - self.start < n:
            self.fill(n)
        out = self.buf[self.start : self.start + n]
        self.start += n
        return out

    def into(self, dst: memoryview) -> None:
        n = len(dst)
        have = min(self.end - self.start, n)
        if have:
            dst[:have] = self.buf[self.start : self.start + have]
            self.start += have
        while have < n:
            # MSG_WAITALL: one system call (and one GIL round trip) per frame, not one per
            # segment; SO_RCVTIMEO still bounds it (it then returns what it has).
            got = self.sock.recv_into(dst[have:], 0, socket.MSG_WAITALL)
            if not got:
                raise _Closed
            have += got

    def discard(self, n: int) -> None:
        have = min(self.end - self.start, n)
        self.start += have
        n -= have
        while n:  # nothing is buffered any more: the scratch buffer is free to reuse
            self.start = self.end = 0
            got = self.sock.recv_into(self.buf, min(n, _SCRATCH))
            if not got:
                raise _Closed
            n -= got


class _Reg:
    """A registration as the server sees it. ``flights`` holds one entry per request being served
    on it; ``unregister`` clears ``active`` and then looks at ``flights``, while a request appends
    to ``flights`` and then looks at ``active``: list operations and attribute stores are atomic
    under the GIL, so one side always sees the other, with no lock on the request path."""

    __slots__ = ("active", "flights", "key", "mv", "size")

    def __init__(self, mv: memoryview, key: bytes) -> None:
        self.active = True
        self.flights: list[object] = []
        self.mv = mv
        self.key = key
        self.size = len(mv)


class _Flow:
    """One client socket to the peer and its reader; used by one thread at a time."""

    def __init__(self, sock: socket.socket, spin: float) -> None:
        self.sock = sock
        self.reader = _Reader(sock)
        self.spin = _Spin(spin)
        self.lock = threading.Lock()
        self.seq = 0
        self.broken = False
        self.timeo = 0.0  # SO_RCVTIMEO now set (0: none; the small path polls instead)
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.jobs: queue.SimpleQueue[Any] | None = None
        self.thread: threading.Thread | None = None


def _parse_url(url: bytes) -> tuple[str, int, int, bytes, str]:
    try:
        parsed = urllib.parse.urlsplit(url.decode())
        query = urllib.parse.parse_qs(parsed.query, strict_parsing=True)
        if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
            raise ValueError("not tcp://host:port")
        token = bytes.fromhex(query["token"][0])
        flows, instance = int(query["flows"][0]), query["id"][0]
        if len(token) != 16 or not 1 <= flows <= 64:
            raise ValueError("bad token or flows")
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise DescriptorError(f"malformed tcp transport URL {url[:100]!r}: {exc}") from exc
    return parsed.hostname, parsed.port, flows, token, instance


@dataclasses.dataclass(frozen=True, slots=True)
class TcpRemoteBuffer(RemoteRange):
    """A descriptor of the tcp backend (the common fields only: the peer is the connection)."""

    _backend: ClassVar[str] = "tcp"


class TcpTransport(Backend):
    """Transfers over TCP between any two hosts (loopback by default)."""

    name: ClassVar[str] = "tcp"
    remote_buffer_type: ClassVar[type[RemoteRange]] = TcpRemoteBuffer

    def __init__(
        self, device: torch.device | str | None = None, *, config: TransportConfig | None = None
    ) -> None:
        super().__init__(device, config=config)
        self._token = secrets.token_bytes(16)
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._stopping = False  # read on every request: cheaper than Event.is_set()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._regs: dict[int, _Reg] = {}
        self._reg_lock = threading.Lock()
        self._flows: list[_Flow] = []
        self._addr: tuple[str, int] = ("", 0)
        self._peer_token = b""
        self._long_wait = self.config.timeout - 1.0  # deadlines this far use the usual bound

    # -- the server: this side's memory ---------------------------------------------------------
    def _bind(self, deadline: float) -> bytes:
        host, port = self.config.tcp.host, self.config.tcp.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from exc
        listener.listen(64)
        self._listener = listener
        self._spawn(self._accept_loop, "accept")
        port = listener.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        query = urllib.parse.urlencode(
            {"flows": self.config.tcp.flows, "token": self._token.hex(), "id": self.instance_id}
        )
        return f"tcp://{shown}:{port}?{query}".encode()

    def _spawn(self, target: Callable[..., None], what: str, *args: Any) -> None:
        thread = threading.Thread(
            target=target, args=args, name=f"tether-transport-tcp-{what}", daemon=True
        )
        # Forget finished connection threads, or a long-lived server that peers reconnect to
        # keeps one Thread object per connection it ever had.
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()  # close() wakes it with shutdown()
            except OSError:
                if not self._stop.is_set():
                    logger.exception("tcp transport: accept failed")
                return
            self._spawn(self._serve, "serve", conn)

    def _serve(self, conn: socket.socket) -> None:  # one thread per connection
        self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A blocking socket (close() wakes it with shutdown()). Idle between requests it waits
            # without a timeout; a peer that stalls within a frame (or its hello) for the timeout
            # is dropped; sends are bounded (a peer that stops reading).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.config.timeout))
            reader = _Reader(conn)
            with _bounded_recv(conn, self.config.timeout):
                magic, version, token = _HELLO.unpack(reader.exact(_HELLO.size))
            if magic != _MAGIC or version != 1 or not hmac.compare_digest(token, self._token):
                logger.warning("tcp transport: refused a connection with a bad hello")
                return
            conn.sendall(b"\x00")
            self._serve_loop(conn, reader)
        except (_Closed, ConnectionError):
            pass  # the peer went away: this connection only
        except (OSError, struct.error, ValueError) as exc:
            if not self._stop.is_set():
                logger.warning("tcp transport: dropped a connection: %s", exc)
        finally:
            self._conns.discard(conn)
            conn.close()

    def _serve_loop(self, conn: socket.socket, reader: _Reader) -> None:
        """Answers requests until the peer leaves. The hot path for small messages: the header and
        payload arrive in one ``recv`` into the scratch buffer and the reply leaves in one
        ``send``; everything this loop uses is bound to locals (a 16 B round trip is dominated by
        interpreter overhead on both sides)."""
        buf, regs, recv_into = reader.buf, self._regs, conn.recv_into
        unpack, pack = _REQ.unpack_from, _RESP.pack
        sendall, compare = conn.sendall, hmac.compare_digest
        timeout, hsize = self.config.timeout, _REQ.size
        spin = _Spin(self.config.tcp.busy_poll_us / 1e6)
        me = object()  # this connection's entry in a registration's flights
        while not self._stopping:
            start = reader.start
            if reader.end - start < hsize:
                if start == reader.end:  # nothing buffered: one receive, no timeout (idle)
                    got = _recv_idle(recv_into, buf, spin)
                    reader.start, reader.end = 0, got
                if reader.end - reader.start < hsize:
                    self._wait_request(conn, reader)
                start = reader.start
            op, seq, buf_id, key, offset, length = unpack(buf, start)
            start += hsize
            reader.start = start
            if length > _MAX_FRAME or (op != _WRITE and op != _READ):
                raise ValueError(f"malformed request (op {op}, length {length})")
            reg = regs.get(buf_id)
            if reg is None or not compare(key, reg.key):
                status = _BAD_BUFFER
            elif offset + length > reg.size:
                status = _BAD_RANGE
            else:
                flights = reg.flights
                flights.append(me)
                if reg.active:
                    status = _OK
                else:  # unregistered meanwhile
                    flights.remove(me)
                    status = _BAD_BUFFER
            if status != _OK or reg is None:
                if op == _WRITE and length:
                    with _bounded_recv(conn, timeout):
                        reader.discard(length)
                sendall(pack(status, seq, 0))
                continue
            try:
                window = reg.mv[offset : offset + length]
                if op == _WRITE:
                    if reader.end - start >= length:  # arrived with its header
                        window[:] = buf[start : start + length]
                        reader.start = start + length
                    else:
                        with _bounded_recv(conn, timeout):
                            reader.into(window)
                else:
                    _send(conn, pack(_OK, seq, length), window)
            finally:
                flights.remove(me)
            if op == _WRITE:
                sendall(pack(_OK, seq, 0))

    def _wait_request(self, conn: socket.socket, reader: _Reader) -> None:
        """Buffers a whole request header: idle, the wait is unbounded (close() ends it); once
        part of a header is here, the rest must come within the timeout."""
        with _bounded_recv(conn, self.config.timeout):
            reader.fill(_REQ.size)

    def _register(self, memory: RegisteredMemory) -> None:
        with self._reg_lock:
            self._regs[memory.id] = _Reg(memory.bytes_view, memory.key)

    def _unregister(self, memory: RegisteredMemory) -> None:
        with self._reg_lock:
            reg = self._regs[memory.id]
            reg.active = False  # then look at flights (see _Reg)
            if reg.flights:
                reg.active = True
                raise TransferInFlightError(f"a peer's transfer on {memory!r} is in flight")
            del self._regs[memory.id]

    # -- the client: the peer's memory ------------------------------------------------------------
    def _connect(self, url: bytes, deadline: float) -> str:
        host, port, _, token, instance = _parse_url(url)
        self._addr, self._peer_token = (host, port), token
        self._flows = [self._open(deadline) for _ in range(self.config.tcp.flows)]
        return instance

    def _open(self, deadline: float) -> _Flow:
        try:
            sock = socket.create_connection(self._addr, timeout=_remaining(deadline, "connect"))
        except TimeoutError as exc:
            raise TransportTimeoutError(f"connecting to {self._addr} timed out") from exc
        except OSError as exc:
            raise PeerDiedError(f"cannot connect to the peer at {self._addr}: {exc}") from exc
        try:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _set_io_timeout(sock, self.config.timeout)
            sock.sendall(_HELLO.pack(_MAGIC, 1, self._peer_token))
            if sock.recv(1) != b"\x00":
                raise PeerDiedError(f"the peer at {self._addr} refused the connection")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_TIMEOUT)
        except OSError as exc:
            sock.close()
            raise PeerDiedError(f"handshake with the peer at {self._addr} failed: {exc}") from exc
        return _Flow(sock, self.config.tcp.busy_poll_us / 1e6)

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        frame = self.config.tcp.frame_bytes
        if len(pairs) == 1 and pairs[0][0].length <= frame:
            view, buf = pairs[0]
            if view.length <= _SMALL:
                self._transfer_one(op, view, buf, deadline)
                return
            flow = self._idle_flow(op, deadline)
            try:
                self._run_flow_locked(flow, op, [(view, buf)], deadline)
            finally:
                flow.lock.release()
            return
        frames: list[Pair] = []
        for view, buf in pairs:
            for start in range(0, view.length, frame):
                n = min(frame, view.length - start)
                frames.append((type(view)(view.memory, view.offset + start, n), buf.view(start, n)))
        shares = [frames[i :: len(self._flows)] for i in range(len(self._flows))]
        errors: list[BaseException] = []
        done = threading.Semaphore(0)
        abandoned = threading.Event()
        helpers = [flow for flow, share in zip(self._flows[1:], shares[1:], strict=False) if share]
        for flow, share in zip(self._flows[1:], shares[1:], strict=False):
            if share:
                self._hand_off(flow, op, share, deadline, errors, done, abandoned)
        try:
            if shares[0]:
                self._run_flow(self._flows[0], op, shares[0], deadline)
        except BaseException as exc:
            errors.append(exc)
        waiting = len(helpers)
        while waiting:
            # Helpers honour the same deadline; the margin covers their last system call.
            if done.acquire(timeout=max(deadline - time.monotonic(), 0) + 5.0):
                waiting -= 1
                continue
            # A helper still runs: it must not touch this transfer's memory once we return
            # (the caller may unregister and free it). Stop the queued ones, break the sockets
            # of the running ones, and wait for them to notice.
            errors.append(TransportTimeoutError(f"tcp {op} timed out"))
            abandoned.set()
            for flow in helpers:
                flow.broken = True
                with contextlib.suppress(OSError):
                    flow.sock.shutdown(socket.SHUT_RDWR)
            while waiting and done.acquire(timeout=_STOP_HELPER_S):
                waiting -= 1
            if waiting:
                logger.error(
                    "tcp %s: %d helper(s) did not stop; memory may still be written", op, waiting
                )
            break
        if errors:
            raise errors[0]

    def _hand_off(
        self,
        flow: _Flow,
        op: Op,
        share: list[Pair],
        deadline: float,
        errors: list[BaseException],
        done: threading.Semaphore,
        abandoned: threading.Event,
    ) -> None:
        if flow.jobs is None:
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            flow.jobs = jobs

            def loop() -> None:
                while (job := jobs.get()) is not None:
                    try:
                        job()
                    except BaseException:
                        logger.exception("tcp transport: flow job failed")

            flow.thread = threading.Thread(
                target=loop, name="tether-transport-tcp-flow", daemon=True
            )
            flow.thread.start()

        def job() -> None:
            try:
                if abandoned.is_set():  # the caller gave up before this share started
                    return
                self._run_flow(flow, op, share, deadline)
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.release()

        flow.jobs.put(job)

    def _run_flow(self, flow: _Flow, op: Op, frames: list[Pair], deadline: float) -> None:
        if not flow.lock.acquire(timeout=_remaining(deadline, op)):
            raise TransportTimeoutError(f"tcp {op}: a connection stayed busy past the timeout")
        try:
            self._run_flow_locked(flow, op, frames, deadline)
        finally:
            flow.lock.release()

    def _run_flow_locked(self, flow: _Flow, op: Op, frames: list[Pair], deadline: float) -> None:
        if flow.broken:
            fresh = self._open(deadline)
            flow.sock.close()
            flow.sock, flow.reader, flow.poller = fresh.sock, fresh.reader, fresh.poller
            flow.timeo, flow.broken = 0.0, False
        try:
            left = _remaining(deadline, op)
            # Every system call of the exchange is bounded by the time left (to the second:
            # setting it costs two system calls, nothing next to a bulk frame).
            want = left if left < self._long_wait else self.config.timeout
            if abs(flow.timeo - want) > 1.0 or (want < flow.timeo and left < self._long_wait):
                _set_io_timeout(flow.sock, want)
                flow.timeo = want
            self._exchange(flow, op, frames)
        except BaseException as exc:
            raise self._failed(flow, op, exc) from exc

    def _failed(self, flow: _Flow, op: Op, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``; marks the flow for a reconnect when its stream is out
        of step."""
        if isinstance(exc, TransportError):
            return exc  # a refusal (RemoteAccessError is an OSError too): the flow is fine
        flow.broken = True  # mid-frame: the stream is out of step; reconnect next time
        if isinstance(exc, (TimeoutError, BlockingIOError)):
            return TransportTimeoutError(f"tcp {op} did not finish in time")
        if isinstance(exc, (_Closed, OSError)):
            return PeerDiedError(
                f"the tcp transport peer at {self._addr[0]}:{self._addr[1]} is gone "
                f"(closed or killed) during a {op}: {exc or 'connection closed'}"
            )
        return exc

    def _idle_flow(self, op: Op, deadline: float) -> _Flow:
        """An idle flow if there is one (else waits for the first), locked."""
        for flow in self._flows:
            if flow.lock.acquire(False):
                return flow
        flow = self._flows[0]
        if not flow.lock.acquire(timeout=_remaining(deadline, op)):
            raise TransportTimeoutError(f"tcp {op} timed out waiting for a socket")
        return flow

    def _transfer_one(self, op: Op, view: ByteView, buf: RemoteRange, deadline: float) -> None:
        """One pair on one idle flow. Small ones go in lock step, inline: one ``sendmsg``
        (header and payload), one ``poll`` bounded by the deadline and one ``recv`` (reply and
        payload) in the common case."""
        n = view.length
        if n > _SMALL:
            self._transfer(op, [(view, buf)], deadline)  # framed, maybe over several flows
            return
        flow = self._idle_flow(op, deadline)
        try:
            if flow.broken:
                self._run_flow_locked(flow, op, [(view, buf)], deadline)
                return
            sock = flow.sock
            seq = flow.seq = (flow.seq + 1) & 0xFFFFFFFF
            mem = view.memory
            local = mem._mv or mem.bytes_view
            off = view.offset
            scratch = flow.reader.buf  # empty between transfers: every reply was consumed
            try:
                if flow.timeo:  # left armed by a bulk exchange: back to unbounded receives
                    _set_io_timeout(sock, self.config.timeout)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _NO_TIMEOUT)
                    flow.timeo = 0.0
                # The request goes without blocking (it fits the socket buffer unless the peer
                # stopped reading; then the rest waits for the deadline); the reply is awaited
                # with poll, which costs less than a receive timeout (see _set_io_timeout).
                if op == "write":
                    hdr = _REQ.pack(_WRITE, seq, buf.id, buf.key, buf.offset, n)
                    payload = local[off : off + n]
                    try:
                        sent = sock.sendmsg([hdr, payload], (), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    if sent != _REQ.size + n:
                        _send_by(sock, (hdr + bytes(payload))[sent:], deadline)
                    want = _RESP.size
                else:
                    req = _REQ.pack(_READ, seq, buf.id, buf.key, buf.offset, n)
                    try:
                        sent = sock.send(req, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    if sent != _REQ.size:
                        _send_by(sock, req[sent:], deadline)
                    want = _RESP.size + n
                _wait_readable(flow.poller.poll, deadline, flow.spin)
                got = sock.recv_into(scratch, want)  # never more: nothing else is in flight
                while got < _RESP.size:
                    got = _recv_more(sock, flow.poller, scratch, got, want, deadline)
                status, rseq, length = _RESP.unpack_from(scratch)
                if rseq != seq:
                    raise _Closed("response out of sequence")
                if status != _OK:  # a refusal carries no payload
                    raise _refused(op, status)
                if op == "read":
                    if length != n:
                        raise _Closed("read reply of the wrong length")
                    while got < want:
                        got = _recv_more(sock, flow.poller, scratch, got, want, deadline)
                    local[off : off + n] = scratch[_RESP.size : want]
            except BaseException as exc:
                raise self._failed(flow, op, exc) from exc
        finally:
            flow.lock.release()

    def _exchange(self, flow: _Flow, op: Op, frames: list[Pair]) -> None:
        sock, reader = flow.sock, flow.reader
        first = flow.seq
        for view, buf in frames:  # pipelined: every request first, then every response
            flow.seq = (flow.seq + 1) & 0xFFFFFFFF
            hdr = _REQ.pack(
                _WRITE if op == "write" else _READ,
                flow.seq,
                buf.id,
                buf.key,
                buf.offset,
                view.length,
            )
            if op == "write":
                _send(sock, hdr, view.memory.bytes_view[view.offset : view.offset + view.length])
            else:
                sock.sendall(hdr)
        for i, (view, _) in enumerate(frames):
            status, seq, length = _RESP.unpack(reader.exact(_RESP.size))
            if seq != (first + i + 1) & 0xFFFFFFFF:
                raise _Closed("response out of sequence")
            if status != _OK:
                flow.broken = flow.broken or i + 1 < len(frames)  # later replies still pending
                raise _refused(op, status)
            if op == "read":
                if length != view.length:
                    raise _Closed("read reply of the wrong length")
                reader.into(view.memory.bytes_view[view.offset : view.offset + view.length])

    def _close(self, deadline: float) -> None:
        self._stop.set()
        self._stopping = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        for flow in self._flows:
            if flow.jobs is not None:
                flow.jobs.put(None)
            flow.sock.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("tcp transport: threads still running after close: %s", stuck)


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeoutError(f"tcp {what} ran out of time")
    return left


def _send(sock: socket.socket, hdr: bytes, payload: memoryview) -> None:
    """Header and payload in one system call when the kernel takes them whole."""
    sent = sock.sendmsg([hdr, payload])
    if sent < len(hdr) + len(payload):
        _send_rest(sock, hdr, payload, sent)


def _send_rest(sock: socket.socket, hdr: bytes, payload: memoryview, sent: int) -> None:
    if sent < len(hdr):
        sock.sendall(hdr[sent:])
        sent = len(hdr)
    sock.sendall(payload[sent - len(hdr) :])


def _refused(op: Op, status: int) -> RemoteAccessError:
    what = "unknown buffer or wrong key" if status == _BAD_BUFFER else "out of range"
    return RemoteAccessError(f"peer refused the {op}: {what}")


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Sends ``data`` before ``deadline`` (raises TimeoutError after it)."""
    view, poller = memoryview(data), select.poll()
    poller.register(sock, select.POLLOUT)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000.0 + 1.0):
            raise TimeoutError
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT) :]
        except BlockingIOError:
            continue


class _Spin:
    """Bounded busy polling that backs off when it does not pay. A window that runs out (the
    other side is slow or idle, or has no core to run on) makes the next 1, 2, 4 ... 64 waits
    sleep at once: on an oversubscribed machine a spinning side takes the core its peer needs
    (measured with one core busy: a 16 B p50 of 150-470 us spinning, against 60 us asleep)."""

    __slots__ = ("backoff", "skip", "window")

    def __init__(self, window: float) -> None:
        self.window, self.skip, self.backoff = window, 0, 0

    def until(self) -> float:
        """When to stop polling; 0: sleep at once."""
        if self.skip or not self.window:
            self.skip = max(self.skip - 1, 0)
            return 0.0
        return time.monotonic() + self.window

    def missed(self) -> None:
        self.backoff = min(self.backoff * 2 or 1, 64)
        self.skip = self.backoff


def _wait_readable(poll: Callable[[float], list[Any]], deadline: float, spin: _Spin) -> None:
    """Waits for a reply: polls without sleeping for a while (a small transfer's reply is
    usually back by then, and a sleeping caller pays a wake-up), then sleeps in ``poll`` until
    ``deadline``; raises TimeoutError after it."""
    until = min(spin.until(), deadline)
    if until:
        while not poll(0):
            if time.monotonic() > until:
                spin.missed()
                break
        else:
            spin.backoff = 0
            return
    left = deadline - time.monotonic()
    if left <= 0 or not poll(left * 1000.0 + 1.0):
        raise TimeoutError


def _recv_idle(recv_into: Callable[..., int], buf: memoryview, spin: _Spin) -> int:
    """The server's receive of the next request: first without sleeping for a while (a busy
    peer's next small request usually comes within it), then a blocking one (close() wakes it
    with shutdown()). Raises _Closed when the peer left."""
    got, until = -1, spin.until()
    while until:
        try:
            got = recv_into(buf, 0, socket.MSG_DONTWAIT)
            spin.backoff = 0
            break
        except BlockingIOError:
            if time.monotonic() > until:
                spin.missed()
                break
    if got < 0:
        got = recv_into(buf)
    if not got:
        raise _Closed
    return got


def _recv_more(
    sock: socket.socket, poller: select.poll, buf: memoryview, got: int, want: int, deadline: float
) -> int:
    """The rest of a reply, bounded by ``deadline`` (the socket's receives are unbounded here:
    a peer that stops mid-reply must not hang the caller)."""
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000.0 + 1.0):
        raise TimeoutError
    more = sock.recv_into(buf[got:want])
    if not more:
        raise _Closed
    return got + more
