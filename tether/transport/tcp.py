"""Any-host backend: registered memory served over several TCP sockets.

Bytes go straight between tensor memory and the kernel: the sender hands a memoryview of the
tensor to ``sendmsg``/``sendall`` and the receiver ``recv_into`` a memoryview of the destination.
Only small frames (a header and payload that arrive in one ``recv``) are copied out of a scratch
buffer, which is cheaper than a second system call. Large transfers are cut into frames of
``config.frame_bytes`` spread over ``config.flows`` sockets, one thread per extra socket.

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
import hmac
import queue
import secrets
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, ClassVar

from tether import _log
from tether._exceptions import (
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
    TransportTimeoutError,
)
from tether.transport.base import Memory, Op, Pair, Transport

__all__ = ["TcpTransport"]

log = _log.get_logger(__name__)

_HELLO = struct.Struct("<8sI16s")
_MAGIC = b"tetherT1"
_REQ = struct.Struct("<B3xIQ16sQQ")
_RESP = struct.Struct("<B3xIQ")
_WRITE, _READ = 1, 2
_OK, _BAD_BUFFER, _BAD_RANGE = 0, 1, 2
_MAX_FRAME = 64 << 20
_SCRATCH = 64 << 10


def _set_io_timeout(sock: socket.socket, secs: float) -> None:
    """Bounds every blocking send/recv of a blocking socket (SO_RCVTIMEO/SO_SNDTIMEO). Cheaper
    than Python's socket timeouts, which add a poll() before every recv on the small-message path;
    an expiry surfaces as BlockingIOError/TimeoutError (EAGAIN)."""
    tv = struct.pack("ll", int(secs), int((secs % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Closed(Exception):
    """The other side closed the connection."""


class _Reader:
    """Reads frames from a socket; small payloads come with their header in one recv."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = memoryview(bytearray(_SCRATCH))
        self.start = self.end = 0

    def exact(self, n: int) -> memoryview:
        if self.end - self.start < n:
            if self.start:  # keep the unread bytes at the front
                self.buf[: self.end - self.start] = self.buf[self.start : self.end]
                self.end -= self.start
                self.start = 0
            while self.end < n:
                got = self.sock.recv_into(self.buf[self.end :])
                if not got:
                    raise _Closed
                self.end += got
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
            got = self.sock.recv_into(dst[have:])
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
    __slots__ = ("inflight", "mv")

    def __init__(self, mv: memoryview) -> None:
        self.inflight = 0
        self.mv = mv


class _Flow:
    """One client socket to the peer and its reader; used by one thread at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = _Reader(sock)
        self.lock = threading.Lock()
        self.seq = 0
        self.broken = False
        self.short = False
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


class TcpTransport(Transport):
    """Transfers over TCP between any two hosts (loopback by default)."""

    name: ClassVar[str] = "tcp"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._token = secrets.token_bytes(16)
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._regs: dict[int, _Reg] = {}
        self._reg_lock = threading.Lock()
        self._flows: list[_Flow] = []
        self._addr: tuple[str, int] = ("", 0)
        self._peer_token = b""

    # -- the server: this side's memory ---------------------------------------------------------
    def _bind(self, deadline: float) -> bytes:
        host, port = self.config.host, self.config.port
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
            {"flows": self.config.flows, "token": self._token.hex(), "id": self.instance_id}
        )
        return f"tcp://{shown}:{port}?{query}".encode()

    def _spawn(self, target: Callable[..., None], what: str, *args: Any) -> None:
        thread = threading.Thread(
            target=target, args=args, name=f"tether-transport-tcp-{what}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()  # close() wakes it with shutdown()
            except OSError:
                if not self._stop.is_set():
                    log.exception("tcp transport: accept failed")
                return
            self._spawn(self._serve, "serve", conn)

    def _serve(self, conn: socket.socket) -> None:
        self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A blocking socket (close() wakes it with shutdown()); a peer that stalls within a
            # frame for the timeout is dropped.
            _set_io_timeout(conn, self.config.timeout)
            reader = _Reader(conn)
            magic, version, token = _HELLO.unpack(reader.exact(_HELLO.size))
            if magic != _MAGIC or version != 1 or not hmac.compare_digest(token, self._token):
                log.warning("tcp transport: refused a connection with a bad hello")
                return
            conn.sendall(b"\x00")
            while not self._stop.is_set():
                self._serve_one(conn, reader)
        except (_Closed, ConnectionError):
            pass  # the peer went away: this connection only
        except (OSError, struct.error, ValueError) as exc:
            if not self._stop.is_set():
                log.warning("tcp transport: dropped a connection: %s", exc)
        finally:
            self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket, reader: _Reader) -> None:
        while True:
            try:
                hdr = reader.exact(_REQ.size)
                break
            except (BlockingIOError, TimeoutError):
                if reader.end != reader.start or self._stop.is_set():
                    raise  # stalled within a frame
                # idle between frames for a whole timeout: fine, keep waiting
        op, seq, buf_id, key, offset, length = _REQ.unpack(hdr)
        if op not in (_WRITE, _READ) or length > _MAX_FRAME:
            raise ValueError(f"malformed request (op {op}, length {length})")
        with self._reg_lock:
            reg = self._regs.get(buf_id)
            memory = self._memories.get(buf_id)
            if reg is None or memory is None or not hmac.compare_digest(key, memory.key):
                status = _BAD_BUFFER
            elif offset + length > len(reg.mv):
                status = _BAD_RANGE
            else:
                status = _OK
                reg.inflight += 1
        if status != _OK or reg is None:
            if op == _WRITE:
                reader.discard(length)
            conn.sendall(_RESP.pack(status, seq, 0))
            return
        try:
            window = reg.mv[offset : offset + length]
            if op == _WRITE:
                reader.into(window)
                conn.sendall(_RESP.pack(_OK, seq, 0))
            else:
                _send(conn, _RESP.pack(_OK, seq, length), window)
        finally:
            with self._reg_lock:
                reg.inflight -= 1

    def _register(self, memory: Memory) -> None:
        with self._reg_lock:
            self._regs[memory.id] = _Reg(memory.bytes_view)

    def _unregister(self, memory: Memory) -> None:
        with self._reg_lock:
            reg = self._regs[memory.id]
            if reg.inflight:
                raise TransferInFlightError(f"a peer's transfer on {memory!r} is in flight")
            del self._regs[memory.id]

    # -- the client: the peer's memory ------------------------------------------------------------
    def _connect(self, url: bytes, deadline: float) -> str:
        host, port, _, token, instance = _parse_url(url)
        self._addr, self._peer_token = (host, port), token
        self._flows = [self._open(deadline) for _ in range(self.config.flows)]
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
            _set_io_timeout(sock, self.config.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(_MAGIC, 1, self._peer_token))
            if sock.recv(1) != b"\x00":
                raise PeerDiedError(f"the peer at {self._addr} refused the connection")
        except OSError as exc:
            sock.close()
            raise PeerDiedError(f"handshake with the peer at {self._addr} failed: {exc}") from exc
        return _Flow(sock)

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        frame = self.config.frame_bytes
        if len(pairs) == 1 and pairs[0][0].length <= frame:
            flow = self._flows[0]
            for candidate in self._flows:  # an idle flow if there is one
                if not candidate.lock.locked():
                    flow = candidate
                    break
            self._run_flow(flow, op, [pairs[0]], deadline)
            return
        frames: list[Pair] = []
        for view, buf in pairs:
            for start in range(0, view.length, frame):
                n = min(frame, view.length - start)
                frames.append((type(view)(view.memory, view.offset + start, n), buf.view(start, n)))
        shares = [frames[i :: len(self._flows)] for i in range(len(self._flows))]
        errors: list[BaseException] = []
        done = threading.Semaphore(0)
        helpers = 0
        for flow, share in zip(self._flows[1:], shares[1:], strict=False):
            if share:
                helpers += 1
                self._hand_off(flow, op, share, deadline, errors, done)
        try:
            if shares[0]:
                self._run_flow(self._flows[0], op, shares[0], deadline)
        except BaseException as exc:
            errors.append(exc)
        for _ in range(helpers):
            # Helpers honour the same deadline; the margin covers their last system call.
            if not done.acquire(timeout=max(deadline - time.monotonic(), 0) + 5.0):
                errors.append(TransportTimeoutError(f"tcp {op} timed out"))
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
    ) -> None:
        if flow.jobs is None:
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            flow.jobs = jobs

            def loop() -> None:
                while (job := jobs.get()) is not None:
                    try:
                        job()
                    except BaseException:
                        log.exception("tcp transport: flow job failed")

            flow.thread = threading.Thread(
                target=loop, name="tether-transport-tcp-flow", daemon=True
            )
            flow.thread.start()

        def job() -> None:
            try:
                self._run_flow(flow, op, share, deadline)
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.release()

        flow.jobs.put(job)

    def _run_flow(self, flow: _Flow, op: Op, frames: list[Pair], deadline: float) -> None:
        with flow.lock:
            if flow.broken:
                fresh = self._open(deadline)
                flow.sock.close()
                flow.sock, flow.reader, flow.broken = fresh.sock, fresh.reader, False
            try:
                left = _remaining(deadline, op)
                if left < self.config.timeout - 1.0:  # shorter than usual: bound it
                    _set_io_timeout(flow.sock, left)
                    flow.short = True
                elif flow.short:
                    _set_io_timeout(flow.sock, self.config.timeout)
                    flow.short = False
                self._exchange(flow, op, frames)
            except TransportError:
                raise  # a refusal (RemoteAccessError is an OSError too): the flow is fine
            except (TimeoutError, BlockingIOError) as exc:
                flow.broken = True  # mid-frame: the stream is out of step; reconnect next time
                raise TransportTimeoutError(f"tcp {op} did not finish in time") from exc
            except (_Closed, OSError) as exc:
                flow.broken = True
                raise PeerDiedError(
                    f"the tcp transport peer at {self._addr[0]}:{self._addr[1]} is gone "
                    f"(closed or killed) during a {op}: {exc or 'connection closed'}"
                ) from exc

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
                what = "unknown buffer or wrong key" if status == _BAD_BUFFER else "out of range"
                flow.broken = flow.broken or i + 1 < len(frames)  # later replies still pending
                raise RemoteAccessError(f"peer refused the {op}: {what}")
            if op == "read":
                if length != view.length:
                    raise _Closed("read reply of the wrong length")
                reader.into(view.memory.bytes_view[view.offset : view.offset + view.length])

    def _close(self, deadline: float) -> None:
        self._stop.set()
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
            log.warning("tcp transport: threads still running after close: %s", stuck)


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeoutError(f"tcp {what} ran out of time")
    return left


def _send(sock: socket.socket, hdr: bytes, payload: memoryview) -> None:
    """Header and payload in one system call when the kernel takes them whole."""
    sent = sock.sendmsg([hdr, payload])
    total = len(hdr) + len(payload)
    if sent < total:
        if sent < len(hdr):
            sock.sendall(hdr[sent:])
            sent = len(hdr)
        sock.sendall(payload[sent - len(hdr) :])
