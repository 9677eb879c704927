"""torch 2.15's transport interface, name for name: the protocols of registered memory and remote
buffers, and the abstract :class:`Transport` every backend implements.

On a torch that ships ``torch.distributed._transport`` (2.15+) these are torch's own objects, so
tether's backends are torch transports there and torch's registry can create them; on 2.13 and
2.14 they are defined here with the same members, defaults and error texts. tether's own backends
implement this interface through :class:`~tether.transport.backend.Backend`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

from tether import _versions
from tether._exceptions import BackendUnavailableError
from tether.transport._work import wait_all
from tether.transport.config import validate_timeout

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "RemoteBuffer",
    "Transport",
]


@runtime_checkable
class MemoryView(Protocol):
    """A byte range of registered memory that a transfer reads."""

    def size(self) -> int: ...


@runtime_checkable
class MutableMemoryView(MemoryView, Protocol):
    """A byte range of registered memory that a transfer may write."""

    @property
    def writable(self) -> Literal[True]: ...


@runtime_checkable
class RemoteBuffer(Protocol):
    """A peer's registered memory, as a descriptor that crosses processes as bytes."""

    def serialize(self) -> bytes: ...

    @classmethod
    def deserialize(cls, data: bytes) -> Self: ...


@runtime_checkable
class Memory(Protocol):
    """A tensor registered with a transport."""

    def to_view(self, offset: int | None = None, length: int | None = None) -> MemoryView: ...

    def to_mutable_view(
        self, offset: int | None = None, length: int | None = None
    ) -> MutableMemoryView: ...

    def to_remote_buffer(self, *, timeout: float | None = None) -> RemoteBuffer: ...


class Transport(ABC):
    """One endpoint of a pair of processes: ``bind()`` gives this side's URL, ``connect(url)``
    reaches the peer's, then ``read``/``write`` move bytes between this side's registered memory
    and the peer's. Synchronous calls return 0; ``async_op=True`` returns a
    ``torch.distributed.Work``. A timeout bounds the caller's wait, never a transfer in flight."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        """The device this transport moves memory of; None: any."""

    @staticmethod
    @abstractmethod
    def supported() -> bool:
        """Whether this backend can work in this process."""

    @abstractmethod
    def bind(self, *, timeout: float | None = None) -> bytes:
        """Starts listening; returns this endpoint's URL for the peer's ``connect``."""

    @abstractmethod
    def connect(self, peer_url: bytes, *, timeout: float | None = None) -> int:
        """Reaches the peer whose ``bind()`` returned ``peer_url``; returns 0."""

    @abstractmethod
    def connected(self) -> bool:
        """Whether the peer is reachable through this transport."""

    @abstractmethod
    def register_memory(self, tensor: torch.Tensor, *, timeout: float | None = None) -> Memory:
        """Registers a contiguous tensor's bytes for transfers."""

    def unregister_memory(self, memory: Memory, *, timeout: float | None = None) -> None:
        raise NotImplementedError("transport does not support memory unregistration")

    @abstractmethod
    def write(
        self,
        local_buffer: MemoryView,
        remote_buffer: RemoteBuffer,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Copies a local view into the peer's buffer: 0, or with ``async_op`` a Work."""

    @abstractmethod
    def read(
        self,
        local_buffer: MutableMemoryView,
        remote_buffer: RemoteBuffer,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Copies the peer's buffer into a local view: 0, or with ``async_op`` a Work."""

    def write_stream(
        self,
        local_buffer: MemoryView,
        remote_buffer: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: float | None = None,
    ) -> None:
        """``write`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        self._on_stream(self.write, local_buffer, remote_buffer, stream, timeout)

    def read_stream(
        self,
        local_buffer: MutableMemoryView,
        remote_buffer: RemoteBuffer,
        *,
        stream: Any = None,
        timeout: float | None = None,
    ) -> None:
        """``read`` ordered after the work queued on a CUDA ``stream`` (default: current)."""
        self._on_stream(self.read, local_buffer, remote_buffer, stream, timeout)

    @staticmethod
    def _on_stream(
        submit: Callable[..., Any], local: Any, remote: Any, stream: Any, timeout: float | None
    ) -> None:
        # torch 2.15 enqueues a host function that hands the transfer to a progress thread (and
        # kills the process if it fails). Here the caller waits for the stream's queued work,
        # then transfers: the same order, but blocking, and not capturable in a CUDA graph.
        if validate_timeout(timeout) == 0:
            raise ValueError("stream transfers require a positive timeout")
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "stream transfers order a transfer on a CUDA stream and this machine has no "
                "CUDA; use read/write(..., async_op=True) instead"
            )
        (stream or torch.cuda.current_stream()).synchronize()
        submit(local, remote, timeout=timeout)

    async def write_async(
        self, local_buffer: MemoryView, remote_buffer: RemoteBuffer, *, timeout: float | None = None
    ) -> None:
        """``write`` for asyncio: submitted asynchronously, awaited without blocking the loop."""
        await self._submit_and_wait(self.write, local_buffer, remote_buffer, timeout)

    async def read_async(
        self,
        local_buffer: MutableMemoryView,
        remote_buffer: RemoteBuffer,
        *,
        timeout: float | None = None,
    ) -> None:
        """``read`` for asyncio: submitted asynchronously, awaited without blocking the loop."""
        await self._submit_and_wait(self.read, local_buffer, remote_buffer, timeout)

    @staticmethod
    async def _submit_and_wait(
        submit: Callable[..., Any], local: Any, remote: Any, timeout: float | None
    ) -> None:
        # Checked before anything is submitted; the time submission took comes off the wait.
        secs = validate_timeout(timeout)
        loop = asyncio.get_running_loop()
        started = loop.time()
        work = submit(local, remote, async_op=True, timeout=timeout)
        spent = loop.time() - started
        await wait_all([work], timeout=None if secs is None else max(secs - spent, 0.0))

    @abstractmethod
    def close(self, *, timeout: float | None = None) -> None:
        """Waits for this side's transfers, then releases everything."""

    async def close_async(self, *, timeout: float | None = None) -> None:
        raise NotImplementedError("async close is unsupported by this transport")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if _versions.TORCH_TRANSPORT:  # torch 2.15+: torch's own classes (tether's backends join them)
    from torch.distributed._transport import (  # type: ignore[import-not-found, no-redef]
        Memory,
        MemoryView,
        MutableMemoryView,
        RemoteBuffer,
        Transport,
    )
