"""The base class of every transport backend, under torch 2.15's ``torch.distributed._transport``
names: what a backend implements, and the lifecycle around it (open → closing → closed).

A backend implements six methods — ``_bind``, ``_connect``, ``_register``, ``_unregister``,
``_transfer`` and ``_close`` — and declares its descriptor fields. The calls users make are checked
and their transfers accounted in flight in ``_dispatch``; settings are in ``config``, registered
memory and descriptors in ``memory``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from tether._exceptions import TransportError, TransportTimeoutError
from tether.transport import _dispatch
from tether.transport._work import AsyncRunner, await_work
from tether.transport.config import Timeout, TransportConfig, seconds
from tether.transport.memory import Memory, MemoryView, MutableMemoryView, Pair, RemoteBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["Op", "Transport"]

Op = Literal["read", "write"]


class Transport:
    """One endpoint of a pair of processes. ``bind()`` gives this side's URL, ``connect(url)``
    reaches the peer's; then ``read``/``write`` move bytes between this side's registered memory
    and the peer's (a :class:`RemoteBuffer` it handed over). No ordering between transfers."""

    name: ClassVar[str] = ""
    descriptor_fields: ClassVar[dict[str, type]] = {}
    """The backend's own descriptor fields (beyond peer, id, key, size, offset, length)."""
    supports_cuda: ClassVar[bool] = False

    def __init__(self, config: TransportConfig | None = None) -> None:
        if config is not None and not isinstance(config, TransportConfig):
            raise TypeError(f"config must be a TransportConfig, not {type(config).__name__}")
        self.config = config or TransportConfig()
        """The timeout, and the backends' sub-configs: each backend reads its own."""
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

    # -- what a backend implements --------------------------------------------------------------
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

    def _transfer_one(
        self, op: Op, local: MemoryView, remote: RemoteBuffer, deadline: float
    ) -> None:
        """One synchronous pair (checked): the hot path of small messages, which a backend may
        override to skip building a batch."""
        self._transfer(op, [(local, remote)], deadline)

    def _close(self, deadline: float) -> None:
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------------
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
            # Set before looking at in-flight transfers, while _dispatch.start appends to them
            # before looking at the state: either close() waits for a transfer or it refuses.
            self._state = "closing"
        try:
            self._await_idle(deadline)
        except BaseException:
            self._settle("open")
            raise
        try:
            if self._runner is not None:
                self._runner.close(max(deadline - time.monotonic(), 0.1))
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

    # -- memory and transfers (checked and accounted in _dispatch) ------------------------------
    def register_memory(self, tensor: torch.Tensor) -> Memory:
        """Registers a contiguous tensor's bytes; keeps the tensor alive until unregistered."""
        return _dispatch.register(self, tensor)

    def unregister_memory(self, memory: Memory) -> None:
        """Unregisters ``memory``; raises TransferInFlightError (and keeps it registered) while
        a transfer of this side or the peer's uses it."""
        _dispatch.unregister(self, memory)

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
        return _dispatch.start(self, "write", local, remote, async_op, timeout)

    def read(
        self,
        local: MutableMemoryView | Sequence[MutableMemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Any:
        """Copies the peer's ``remote`` range into ``local`` (``len(local)`` bytes)."""
        return _dispatch.start(self, "read", local, remote, async_op, timeout)

    async def write_async(
        self,
        local: MemoryView | Sequence[MemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        timeout: Timeout = None,
    ) -> int:
        """``write`` for asyncio: the transfer runs off the event loop."""
        return await await_work(_dispatch.start(self, "write", local, remote, True, timeout))

    async def read_async(
        self,
        local: MutableMemoryView | Sequence[MutableMemoryView],
        remote: RemoteBuffer | Sequence[RemoteBuffer],
        *,
        timeout: Timeout = None,
    ) -> int:
        """``read`` for asyncio: the transfer runs off the event loop."""
        return await await_work(_dispatch.start(self, "read", local, remote, True, timeout))

    def write_stream(
        self,
        local: MemoryView,
        remote: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: Timeout = None,
    ) -> None:
        """``write`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        _dispatch.stream(self, "write", local, remote, stream, timeout)

    def read_stream(
        self,
        local: MutableMemoryView,
        remote: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: Timeout = None,
    ) -> None:
        """``read`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        _dispatch.stream(self, "read", local, remote, stream, timeout)
