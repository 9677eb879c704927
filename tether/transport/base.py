"""The transport API (torch 2.15's ``torch.distributed._transport`` names) and the base class of
every backend.

A backend implements six methods — ``_bind``, ``_connect``, ``_register``, ``_unregister``,
``_transfer`` and ``_close`` — and declares its descriptor fields. Everything else lives here:
argument checks, the lifecycle (new → bound/connected → closed), in-flight accounting (so
``unregister_memory`` refuses while a transfer uses the memory), ``async_op`` works, asyncio and
stream variants, timeouts.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch

from tether import _log
from tether._exceptions import (
    BackendUnavailableError,
    ConfigError,
    DescriptorError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
    TransportTimeoutError,
)
from tether.transport import descriptor
from tether.transport._work import AsyncRunner, TransferWork, await_work

__all__ = [
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "Op",
    "RemoteBuffer",
    "Timeout",
    "Transport",
    "TransportConfig",
]

log = _log.get_logger(__name__)

Timeout = timedelta | float | None
"""Seconds or a timedelta; None means the transport's ``config.timeout``."""
Op = Literal["read", "write"]
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


@dataclasses.dataclass(kw_only=True, slots=True)
class TransportConfig:
    """Settings of one transport; each backend reads the fields it needs."""

    timeout: float = 60.0
    """Seconds: the default for every blocking call (bind, connect, transfers, close)."""
    host: str = "127.0.0.1"
    """tcp: the address to listen on and to advertise. Loopback by default; a wildcard address
    is refused because peers could not reach it (give an interface's address instead)."""
    port: int = 0
    """tcp: the port to listen on; 0 picks a free one."""
    flows: int = 4
    """tcp: sockets per peer; large transfers are split over them."""
    frame_bytes: int = 4 << 20
    """tcp: the largest piece of a transfer sent as one frame."""
    busy_poll_us: int = 50
    """tcp: microseconds a side polls its socket before it sleeps: a caller waiting for a small
    transfer's reply, and a server waiting for the next request after answering one. Being put
    to sleep and woken costs 10-30 us per round trip on VMs (most of a 16 B transfer); the
    price is up to this much CPU per small transfer on each side. 0 never polls."""
    max_buffers: int = 1024
    """local: registrations a transport can hold at once."""
    max_peers: int = 16
    """local: processes that can be connected to one transport at once."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """nixl: NIXL backends the agent uses."""
    nixl_progress_us: int = 100
    """nixl: microseconds the agent's progress thread sleeps between rounds (NIXL's own default,
    0, spins a whole core; the owner's side needs the thread only to set up connections and for
    protocols that are not one-sided, such as UCX over TCP)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.host in _WILDCARD_HOSTS:
            raise ConfigError(
                f"host {self.host!r} is a wildcard: peers cannot reach it and it exposes "
                "registered memory on every interface; give this host's address instead"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not 1 <= self.flows <= 64:
            raise ConfigError(f"flows must be in [1, 64], got {self.flows}")
        if not 4096 <= self.frame_bytes <= 64 << 20:
            raise ConfigError(f"frame_bytes must be in [4 KiB, 64 MiB], got {self.frame_bytes}")
        if not 0 <= self.busy_poll_us <= 100_000:
            raise ConfigError(f"busy_poll_us must be in [0, 1e5], got {self.busy_poll_us}")
        if not 0 <= self.nixl_progress_us <= 1_000_000:
            raise ConfigError(f"nixl_progress_us must be in [0, 1e6], got {self.nixl_progress_us}")
        if not 1 <= self.max_buffers <= 65536 or not 1 <= self.max_peers <= 256:
            raise ConfigError("max_buffers must be in [1, 65536] and max_peers in [1, 256]")


def seconds(timeout: Timeout, default: float) -> float:
    if timeout is None:
        return default
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not secs > 0:
        raise ConfigError(f"a timeout must be > 0 seconds, got {secs}")
    return secs


class Memory:
    """A registered tensor: the bytes of ``tensor``, reachable by peers through
    :meth:`to_remote_buffer` until unregistered. Keeps the tensor alive while registered."""

    __slots__ = (
        "_flights",
        "_mv",
        "_registered",
        "id",
        "key",
        "nbytes",
        "ptr",
        "state",
        "tensor",
        "transport",
    )

    def __init__(self, transport: Transport, tensor: torch.Tensor) -> None:
        self.transport = transport
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.ptr = tensor.data_ptr()
        self.id = secrets.randbits(64)
        self.key = secrets.token_bytes(16)  # 128 bits: a capability, not guessable
        self.state: Any = None  # the backend's own per-registration state
        # Transfers of this side in flight on this memory. list.append/remove are atomic under
        # the GIL, so the hot path takes no lock (a lock costs ~0.5 us on a small VM).
        self._flights: list[object] = []
        self._mv: memoryview | None = None
        self._registered = False

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def bytes_view(self) -> memoryview:
        """The registered bytes as a writable memoryview (CPU memory only)."""
        if self._mv is None:
            from tether.transport._mem import ptr_memoryview

            self._mv = ptr_memoryview(self.ptr, self.nbytes)
        return self._mv

    def _range(self, offset: int, length: int | None) -> tuple[int, int]:
        if length is None:
            length = self.nbytes - offset
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ConfigError(
                f"view [{offset}, {offset + length}) is outside this memory of {self.nbytes} bytes"
            )
        return offset, length

    def to_view(self, offset: int = 0, length: int | None = None) -> MemoryView:
        """Bytes ``[offset, offset+length)`` as a transfer source."""
        return MemoryView(self, *self._range(offset, length))

    def to_mutable_view(self, offset: int = 0, length: int | None = None) -> MutableMemoryView:
        """Bytes ``[offset, offset+length)`` as a transfer destination."""
        return MutableMemoryView(self, *self._range(offset, length))

    def to_remote_buffer(self) -> RemoteBuffer:
        """What a peer needs to reach this memory; hand it only to peers you trust with it."""
        if not self._registered:
            raise TransportError("this memory is not registered (any more)")
        return RemoteBuffer(
            backend=self.transport.name,
            peer=self.transport.instance_id,
            id=self.id,
            key=self.key,
            size=self.nbytes,
            offset=0,
            length=self.nbytes,
            extra=dict(self.transport._descriptor_extra(self)),
        )

    def __repr__(self) -> str:
        return f"Memory({self.transport.name}, {self.nbytes} bytes, id={self.id:#x})"


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryView:
    """A byte range of registered memory, read by transfers. Shape and dtype are the caller's."""

    memory: Memory
    offset: int
    length: int

    @property
    def ptr(self) -> int:
        return self.memory.ptr + self.offset


@dataclasses.dataclass(frozen=True, slots=True)
class MutableMemoryView(MemoryView):
    """A byte range of registered memory that transfers may write."""


_COMMON_FIELDS: dict[str, type] = {
    "peer": str,
    "id": int,
    "key": bytes,
    "size": int,
    "offset": int,
    "length": int,
}


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A byte range of a peer's registered memory. :meth:`view` narrows it (remote offsets);
    :meth:`serialize` / :meth:`deserialize` carry it between processes as JSON."""

    backend: str
    peer: str
    """The instance id of the transport that registered it."""
    id: int
    key: bytes
    size: int
    """Bytes registered; ``offset + length <= size``."""
    offset: int
    length: int
    extra: dict[str, int | str | bytes]
    """The backend's own fields."""

    def view(self, offset: int, length: int | None = None) -> RemoteBuffer:
        """Bytes ``[offset, offset+length)`` of this range (relative to its start)."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RemoteAccessError(
                f"range [{offset}, {offset + length}) is outside the remote buffer's "
                f"{self.length} bytes"
            )
        return dataclasses.replace(self, offset=self.offset + offset, length=length)

    def serialize(self) -> bytes:
        fields: dict[str, int | str | bytes] = dict(self.extra)
        fields.update(peer=self.peer, id=self.id, key=self.key, size=self.size)
        fields.update(offset=self.offset, length=self.length)
        return descriptor.encode(self.backend, fields)

    @classmethod
    def deserialize(cls, data: bytes | str, *, backend: str | None = None) -> RemoteBuffer:
        """Parses and checks a descriptor; raises :class:`DescriptorError` when it is malformed,
        truncated, of another version or for another backend."""
        from tether.transport.registry import backend_class

        # Two passes: the backend's name says which fields are allowed.
        name = _peek_backend(data)
        if backend is not None and name != backend:
            raise DescriptorError(f"descriptor is for backend {name!r}, not {backend!r}")
        try:
            extra_schema = backend_class(name).descriptor_fields
        except BackendUnavailableError as exc:
            raise DescriptorError(f"descriptor names an unknown backend: {exc}") from exc
        schema = {**_COMMON_FIELDS, **extra_schema}
        name, fields = descriptor.decode(data, schema, backend=name)
        common = {k: fields.pop(k) for k in _COMMON_FIELDS}
        size, offset, length = int(common["size"]), int(common["offset"]), int(common["length"])
        key = common["key"]
        if not isinstance(key, bytes) or len(key) != 16:
            raise DescriptorError("descriptor key must be 16 bytes")
        if offset + length > size:
            raise DescriptorError(f"descriptor range [{offset}, {offset + length}) exceeds {size}")
        return cls(
            backend=name,
            peer=str(common["peer"]),
            id=int(common["id"]),
            key=key,
            size=size,
            offset=offset,
            length=length,
            extra=fields,
        )


def _peek_backend(data: bytes | str) -> str:
    import json

    if isinstance(data, bytes | bytearray | memoryview | str) and len(data) > descriptor.MAX_BYTES:
        raise DescriptorError(f"descriptor of {len(data)} bytes is too large to be one")
    try:
        envelope = json.loads(data)
        name = envelope["backend"]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
        raise DescriptorError(f"not a descriptor (malformed or truncated JSON): {exc}") from exc
    if not isinstance(name, str):
        raise DescriptorError("descriptor backend must be a string")
    return name


Pair = tuple[MemoryView, RemoteBuffer]
_VIEWS: dict[str, tuple[type, ...]] = {
    "write": (MemoryView, MutableMemoryView),
    "read": (MutableMemoryView,),
}


class Transport:
    """One endpoint of a pair of processes. ``bind()`` gives this side's URL, ``connect(url)``
    reaches the peer's; then ``read``/``write`` move bytes between this side's registered memory
    and the peer's (a :class:`RemoteBuffer` it handed over). No ordering between transfers."""

    name: ClassVar[str] = ""
    descriptor_fields: ClassVar[dict[str, type]] = {}
    """The backend's own descriptor fields (beyond peer, id, key, size, offset, length)."""
    supports_cuda: ClassVar[bool] = False

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()
        self.instance_id = secrets.token_hex(8)
        self._state: Literal["open", "closing", "closed"] = "open"
        self._url: bytes | None = None
        self._peer: str | None = None
        self._cv = threading.Condition()
        self._memories: dict[int, Memory] = {}
        self._registering = 0
        """register_memory() calls under way; close() waits for them as for transfers."""
        self._runner: AsyncRunner | None = None
        self._hold: threading.Event | None = None
        """Fault injection for tests: async transfers wait for this event before starting."""

    # -- what a backend implements ----------------------------------------------------------
    @staticmethod
    def supported() -> bool:
        """Whether this backend can work on this machine (its package imports, ...)."""
        return True

    def _bind(self, deadline: float) -> bytes:
        raise NotImplementedError

    def _connect(self, url: bytes, deadline: float) -> str:
        """Reaches the peer; returns its instance id."""
        raise NotImplementedError

    def _register(self, memory: Memory) -> None:
        raise NotImplementedError

    def _descriptor_extra(self, memory: Memory) -> dict[str, int | str | bytes]:
        return {}

    def _unregister(self, memory: Memory) -> None:
        """Raises TransferInFlightError when a peer's transfer on ``memory`` is in flight."""
        raise NotImplementedError

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        """Moves ``pairs`` (all checked) and returns when all are done; raises TransportError."""
        raise NotImplementedError

    def _close(self, deadline: float) -> None:
        raise NotImplementedError

    def _transfer_one(
        self, op: Op, local: MemoryView, remote: RemoteBuffer, deadline: float
    ) -> None:
        """One synchronous pair (checked): the hot path of small messages, which a backend may
        override to skip building a batch."""
        self._transfer(op, [(local, remote)], deadline)

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            hint = "; create a new one" if self._state == "closed" else " (close() is under way)"
            raise TransportError(f"this {self.name} transport is {self._state}{hint}")

    def bind(self, *, timeout: Timeout = None) -> bytes:
        """Starts listening; returns this endpoint's URL for the peer's ``connect``."""
        self._check_open()
        if self._url is None:
            deadline = time.monotonic() + seconds(timeout, self.config.timeout)
            self._url = self._bind(deadline)
        return self._url

    def connect(self, peer_url: bytes | str, *, timeout: Timeout = None) -> None:
        """Reaches the peer whose ``bind()`` returned ``peer_url``."""
        self._check_open()
        if self._peer is not None:
            raise TransportError("this transport is already connected; one peer per transport")
        url = peer_url.encode() if isinstance(peer_url, str) else bytes(peer_url)
        deadline = time.monotonic() + seconds(timeout, self.config.timeout)
        self._peer = self._connect(url, deadline)

    def connected(self) -> bool:
        return self._peer is not None and self._state == "open"

    def register_memory(self, tensor: torch.Tensor) -> Memory:
        """Registers a contiguous tensor's bytes; keeps the tensor alive until unregistered."""
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"register_memory takes a tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ConfigError("register_memory needs a contiguous tensor (call .contiguous())")
        if tensor.device.type == "cuda" and not self.supports_cuda:
            raise BackendUnavailableError(
                f"the {self.name} backend moves CPU memory only; use backend='nixl' for CUDA "
                "tensors, or register a CPU copy"
            )
        if tensor.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"cannot register memory on device {tensor.device}")
        if tensor.numel() == 0:
            raise ConfigError("cannot register an empty tensor")
        memory = Memory(self, tensor)
        with self._cv:
            self._check_open()
            self._registering += 1
        try:
            self._register(memory)
            with self._cv:
                memory._registered = True
                self._memories[memory.id] = memory
        finally:
            with self._cv:
                self._registering -= 1
        return memory

    def unregister_memory(self, memory: Memory) -> None:
        """Unregisters ``memory``; raises TransferInFlightError (and keeps it registered) while
        a transfer of this side or the peer's uses it."""
        if memory.transport is not self:
            raise ConfigError("this memory was registered with another transport")
        with self._cv:
            if not memory._registered:
                return
            # Cleared before looking at _flights, while _start appends before looking at
            # _registered: one of the two always sees the other.
            memory._registered = False
            try:
                if memory._flights:
                    raise TransferInFlightError(
                        f"{len(memory._flights)} transfer(s) on {memory!r} are in flight; "
                        "wait for them"
                    )
                self._unregister(memory)  # raises when a peer's transfer is in flight
            except BaseException:
                memory._registered = True
                raise
            del self._memories[memory.id]

    def close(self, *, timeout: Timeout = None) -> None:
        """Refuses new transfers, waits for this side's running ones, then releases everything;
        reuse is an error. A close() that times out leaves the transport open; one called while
        another runs waits for that one's outcome."""
        deadline = time.monotonic() + seconds(timeout, self.config.timeout)
        with self._cv:
            while self._state == "closing":
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeoutError("close(): another close() is still under way")
                self._cv.wait(left)
            if self._state == "closed":
                return
            # Set before looking at in-flight transfers, while _start appends to them before
            # looking at the state: either close() waits for a transfer or the transfer refuses.
            self._state = "closing"
        try:
            self._await_idle(deadline)
        except BaseException:
            self._settle("open")
            raise
        try:
            if self._runner is not None:
                self._runner.stop(max(deadline - time.monotonic(), 0.1))
            self._close(deadline)
            with self._cv:
                for memory in self._memories.values():
                    memory._registered = False
                self._memories.clear()
        finally:
            self._settle("closed")  # even after a failed teardown: it cannot be undone

    def _await_idle(self, deadline: float) -> None:
        """Waits for this side's transfers and registrations under way. Polls: the transfer hot
        path keeps no condition variable to notify (see Memory)."""
        while busy := self._registering + sum(
            len(m._flights) for m in list(self._memories.values())
        ):
            if time.monotonic() > deadline:
                raise TransportTimeoutError(
                    f"close(): {busy} transfer(s) or registration(s) still under way; the "
                    "transport stays open"
                )
            time.sleep(0.001)

    def _settle(self, state: Literal["open", "closed"]) -> None:
        with self._cv:
            self._state = state
            self._cv.notify_all()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transfers ------------------------------------------------------------------------------
    def write(
        self,
        local: MemoryView | Sequence[MemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Any:
        """Copies ``local``'s bytes into the peer's ``remote`` range (starting at its offset).
        Lists of views and buffers make one batch with one completion. Returns 0, or with
        ``async_op`` a ``torch.distributed.Work``."""
        return self._start("write", local, remote, async_op, timeout)

    def read(
        self,
        local: MutableMemoryView | Sequence[MutableMemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Any:
        """Copies the peer's ``remote`` range into ``local`` (``len(local)`` bytes)."""
        return self._start("read", local, remote, async_op, timeout)

    async def write_async(
        self,
        local: MemoryView | Sequence[MemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        timeout: Timeout = None,
    ) -> int:
        """``write`` for asyncio: the transfer runs off the event loop."""
        return await await_work(self._start("write", local, remote, True, timeout))

    async def read_async(
        self,
        local: MutableMemoryView | Sequence[MutableMemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        timeout: Timeout = None,
    ) -> int:
        """``read`` for asyncio: the transfer runs off the event loop."""
        return await await_work(self._start("read", local, remote, True, timeout))

    def write_stream(
        self,
        local: MemoryView,
        remote: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: Timeout = None,
    ) -> None:
        """``write`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        self._stream("write", local, remote, stream, timeout)

    def read_stream(
        self,
        local: MutableMemoryView,
        remote: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: Timeout = None,
    ) -> None:
        """``read`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        self._stream("read", local, remote, stream, timeout)

    def _stream(
        self, op: Op, local: MemoryView, remote: RemoteBuffer, stream: Any, timeout: Timeout
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"{op}_stream orders a transfer on a CUDA stream and this machine has no CUDA; "
                f"use {op}(..., async_op=True) instead"
            )
        # Synchronising the stream orders the transfer after its queued work. Unlike torch's
        # host-function scheme this blocks the caller and is not capturable in a CUDA graph.
        (stream or torch.cuda.current_stream()).synchronize()
        self._start(op, local, remote, False, timeout)

    def _pairs(self, op: Op, local: Any, remote: Any) -> list[Pair]:
        if isinstance(local, MemoryView) and isinstance(remote, RemoteBuffer):
            pairs = [(local, remote)]
        else:
            locals_ = [local] if isinstance(local, MemoryView) else list(local)
            remotes = [remote] if isinstance(remote, RemoteBuffer) else list(remote)
            if len(locals_) != len(remotes) or not locals_:
                raise ConfigError(
                    f"a batch needs as many local views as remote buffers (got {len(locals_)} "
                    f"and {len(remotes)}), at least one"
                )
            pairs = list(zip(locals_, remotes, strict=True))
        for view, buf in pairs:
            if not isinstance(view, MemoryView) or not isinstance(buf, RemoteBuffer):
                raise ConfigError("transfers take Memory views and RemoteBuffers")
            if op == "read" and not isinstance(view, MutableMemoryView):
                raise ConfigError("read() writes into local memory: pass memory.to_mutable_view()")
            if view.memory.transport is not self:
                raise ConfigError("the local view's memory is registered with another transport")
            if buf.backend != self.name:
                raise DescriptorError(
                    f"remote buffer is for backend {buf.backend!r}, not {self.name!r}"
                )
            if buf.peer != self._peer:
                raise DescriptorError(
                    "remote buffer belongs to a transport this one is not connected to"
                )
            if view.length > buf.length:
                raise RemoteAccessError(
                    f"{op} of {view.length} bytes does not fit the remote range of {buf.length}"
                )
        return pairs

    def _start(self, op: Op, local: Any, remote: Any, async_op: bool, timeout: Timeout) -> Any:
        if self._state != "open" or self._peer is None:
            self._check_open()
            raise TransportError(f"{op}(): connect() to the peer first")
        deadline = time.monotonic() + (
            self.config.timeout if timeout is None else seconds(timeout, self.config.timeout)
        )
        if not async_op and type(local) in _VIEWS[op] and type(remote) is RemoteBuffer:
            # The hot path (one synchronous transfer): the checks of _pairs, inlined, and no
            # lock; small messages are dominated by Python overhead.
            memory = local.memory
            if (
                memory.transport is not self
                or remote.peer != self._peer
                or remote.backend != self.name
                or local.length > remote.length
            ):
                self._pairs(op, local, remote)  # raises the precise error
            token = object()
            memory._flights.append(token)
            try:
                if not memory._registered or self._state != "open":
                    self._refuse()
                self._transfer_one(op, local, remote, deadline)
            finally:
                memory._flights.remove(token)
            return 0
        pairs = self._pairs(op, local, remote)
        memories = [view.memory for view, _ in pairs]
        token = object()
        for memory in memories:
            memory._flights.append(token)
        if not all(memory._registered for memory in memories) or self._state != "open":
            self._done(memories, token)
            self._refuse()
        if not async_op:
            try:
                self._transfer(op, pairs, deadline)
            finally:
                self._done(memories, token)
            return 0
        work = TransferWork(f"{self.name} {op} of {len(pairs)} range(s)", deadline)

        def job() -> None:
            error: BaseException | None = None
            try:
                if self._hold is not None:
                    self._hold.wait(max(deadline - time.monotonic(), 0))
                self._transfer(op, pairs, deadline)
            except BaseException as exc:  # handed to the waiter, never lost
                error = exc
            finally:
                self._done(memories, token)
            work._finish(error)

        if self._runner is None:
            self._runner = AsyncRunner(f"tether-transport-{self.name}-{self.instance_id[:6]}")
        self._runner.submit(job)
        return work

    def _refuse(self) -> None:
        """A transfer that found, once in flight, its transport closing or its memory gone
        (checked after joining the in-flight list: see close() and unregister_memory())."""
        self._check_open()
        raise ConfigError("the local view's memory is not registered (any more)")

    @staticmethod
    def _done(memories: list[Memory], token: object) -> None:
        for memory in memories:
            memory._flights.remove(token)
