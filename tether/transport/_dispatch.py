"""What :class:`~tether.transport.backend.Backend`'s calls do before and around its backend's
methods: argument checks, in-flight accounting (so ``unregister_memory`` refuses while a transfer
uses the memory, and ``close()`` waits for running ones), ``async_op`` works.

Plain functions of the transport, not methods of a mixin, so that they type-check against the
one class they serve. Wrong arguments raise ``ValueError``/``TypeError``; a transport or memory
in the wrong state raises :class:`TransportError`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
)
from tether.transport._work import AsyncRunner, TransferWork
from tether.transport.config import Timeout, seconds
from tether.transport.memory import ByteView, MutableByteView, Pair, RegisteredMemory, RemoteRange

if TYPE_CHECKING:
    from tether.transport.backend import Backend, Op

__all__ = ["register", "start", "unregister"]

_VIEWS: dict[str, tuple[type, ...]] = {
    "write": (ByteView, MutableByteView),
    "read": (MutableByteView,),
}


def register(t: Backend, tensor: torch.Tensor) -> RegisteredMemory:
    t._check_open()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"register_memory takes a tensor, not {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("register_memory needs a contiguous tensor (call .contiguous())")
    if tensor.device.type == "cuda" and not t.supports_cuda:
        raise BackendUnavailableError(
            f"the {t.name} backend moves CPU memory only; use backend='nixl' for CUDA "
            "tensors, or register a CPU copy"
        )
    if t.device is not None and (
        tensor.device.type != t.device.type
        or (t.device.index is not None and tensor.device.index != t.device.index)
    ):
        raise ValueError(f"expected a tensor on {t.device}, got {tensor.device}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot register memory on device {tensor.device}")
    if tensor.numel() == 0:
        raise ValueError("cannot register an empty tensor")
    memory = RegisteredMemory(t, tensor)
    with t._cv:
        t._check_open()
        t._registering += 1
    try:
        t._register(memory)
        with t._cv:
            memory._registered = True
            t._memories[memory.id] = memory
    finally:
        with t._cv:
            t._registering -= 1
    return memory


def unregister(t: Backend, memory: RegisteredMemory) -> None:
    if memory.transport is not t:
        raise ValueError("this memory was registered with another transport")
    with t._cv:
        if not memory._registered:
            return
        # Cleared before looking at _flights, while start() appends before looking at
        # _registered: one of the two always sees the other.
        memory._registered = False
        try:
            if memory._flights:
                raise TransferInFlightError(
                    f"{len(memory._flights)} transfer(s) on {memory!r} are in flight; wait for them"
                )
            t._unregister(memory)  # raises when a peer's transfer is in flight
        except BaseException:
            memory._registered = True
            raise
        del t._memories[memory.id]


def _pairs(t: Backend, op: Op, local: Any, remote: Any) -> list[Pair]:
    if isinstance(local, ByteView) and isinstance(remote, RemoteRange):
        pairs = [(local, remote)]
    else:
        locals_ = [local] if isinstance(local, ByteView) else list(local)
        remotes = [remote] if isinstance(remote, RemoteRange) else list(remote)
        if len(locals_) != len(remotes) or not locals_:
            raise ValueError(
                f"a batch needs as many local views as remote buffers (got {len(locals_)} "
                f"and {len(remotes)}), at least one"
            )
        pairs = list(zip(locals_, remotes, strict=True))
    for view, buf in pairs:
        if not isinstance(view, ByteView) or not isinstance(buf, RemoteRange):
            raise TypeError("transfers take views of registered memory and remote buffers")
        if op == "read" and not isinstance(view, MutableByteView):
            raise TypeError("read() writes into local memory: pass memory.to_mutable_view()")
        if view.memory.transport is not t:
            raise ValueError("the local view's memory is registered with another transport")
        if not isinstance(buf, t.remote_buffer_type):  # the backend relies on its own fields
            raise DescriptorError(f"remote buffer is for backend {buf.backend!r}, not {t.name!r}")
        if buf.peer != t._peer:
            raise DescriptorError(
                "remote buffer belongs to a transport this one is not connected to"
            )
        if view.length > buf.length:
            raise RemoteAccessError(
                f"{op} of {view.length} bytes does not fit the remote range of {buf.length}"
            )
    return pairs


def start(t: Backend, op: Op, local: Any, remote: Any, async_op: bool, timeout: Timeout) -> Any:
    """Checks and runs one transfer or batch: returns 0, or with ``async_op`` its work."""
    if t._state != "open" or t._peer is None:
        t._check_open()
        raise TransportError(f"{op}(): connect() to the peer first")
    deadline = time.monotonic() + seconds(timeout, t.config.timeout)
    if not async_op and type(local) in _VIEWS[op] and type(remote) is t.remote_buffer_type:
        # The hot path (one synchronous transfer): the checks of _pairs, inlined, and no lock;
        # small messages are dominated by Python overhead.
        memory = local.memory
        if memory.transport is not t or remote.peer != t._peer or local.length > remote.length:
            _pairs(t, op, local, remote)  # raises the precise error
        token = object()
        memory._flights.append(token)
        try:
            if not memory._registered or t._state != "open":
                _refuse(t)
            t._transfer_one(op, local, remote, deadline)
        finally:
            memory._flights.remove(token)
        return 0
    pairs = _pairs(t, op, local, remote)
    memories = [view.memory for view, _ in pairs]
    token = object()
    for memory in memories:
        memory._flights.append(token)
    if not all(memory._registered for memory in memories) or t._state != "open":
        _done(memories, token)
        _refuse(t)
    if not async_op:
        try:
            t._transfer(op, pairs, deadline)
        finally:
            _done(memories, token)
        return 0
    work = TransferWork(f"{t.name} {op} of {len(pairs)} range(s)", deadline)

    def job() -> None:
        error: BaseException | None = None
        try:
            if t._hold is not None:
                t._hold.wait(max(deadline - time.monotonic(), 0))
            t._transfer(op, pairs, deadline)
        except BaseException as exc:  # handed to the waiter, never lost
            error = exc
        finally:
            _done(memories, token)
        work._finish(error)

    runner = t._runner
    if runner is None:
        with t._cv:  # two first async transfers at once start one thread, not two
            if t._runner is None:
                t._runner = AsyncRunner(f"tether-transport-{t.name}-{t.instance_id[:6]}")
            runner = t._runner
    runner.submit(job)
    return work


def _refuse(t: Backend) -> None:
    """A transfer that found, once in flight, its transport closing or its memory gone (checked
    after joining the in-flight list: see Backend.close() and unregister())."""
    t._check_open()
    raise TransportError("the local view's memory is not registered (any more)")


def _done(memories: list[RegisteredMemory], token: object) -> None:
    for memory in memories:
        memory._flights.remove(token)
