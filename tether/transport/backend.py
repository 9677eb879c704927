"""What tether's backends share: torch 2.15's :class:`~tether.transport.base.Transport`
implemented once, with the lifecycle around it (open → closing → closed), tether's additions
(remote offsets, batches, in-flight accounting) and one configuration.

A backend implements six methods — ``_bind``, ``_connect``, ``_register``, ``_unregister``,
``_transfer`` and ``_close`` — and names its descriptor class (a
:class:`~tether.transport.memory.RemoteRange` with the backend's fields). The calls users make
are checked in ``_dispatch`` and their transfers accounted in flight here, by the class that owns
that state; settings are in ``config``, registered memory and descriptors in ``memory``.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from tether._exceptions import TransferInFlightError, TransportError, TransportTimeoutError
from tether.transport._dispatch import VIEWS, Op, check_tensor, pairs
from tether.transport._work import AsyncRunner, TransferWork
from tether.transport.base import Transport
from tether.transport.config import Timeout, TransportConfig, seconds
from tether.transport.memory import ByteView, MutableByteView, Pair, RegisteredMemory, RemoteRange

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "Op"]


class Backend(Transport):
    """One endpoint of a pair of processes. ``bind()`` gives this side's URL, ``connect(url)``
    reaches the peer's; then ``read``/``write`` move bytes between this side's registered memory
    and the peer's (a :class:`RemoteRange` it handed over). No ordering between transfers.
    ``config``: tether's settings (timeout, each backend's own)."""

    name: ClassVar[str] = ""
    remote_buffer_type: ClassVar[type[RemoteRange]] = RemoteRange
    """The backend's descriptor class: its ``_backend`` is ``name``, its ``_fields`` the common
    ones and the backend's own."""
    supports_cuda: ClassVar[bool] = False

    def __init__(
        self, device: torch.device | str | None = None, *, config: TransportConfig | None = None
    ) -> None:
        if config is not None and not isinstance(config, TransportConfig):
            raise TypeError(f"config must be a TransportConfig, not {type(config).__name__}")
        super().__init__(device)
        self.config = config or TransportConfig()
        """The timeout, and the backends' sub-configs: each backend reads its own."""
        self.instance_id = secrets.token_hex(8)
        self._state: Literal["open", "closing", "closed"] = "open"
        self._url: bytes | None = None
        self._peer: str | None = None
        self._cv = threading.Condition()
        self._memories: dict[int, RegisteredMemory] = {}
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

    def _register(self, memory: RegisteredMemory) -> None:
        raise NotImplementedError

    def _descriptor_fields(self, memory: RegisteredMemory) -> dict[str, int | str | bytes]:
        """The backend's own fields of ``memory``'s descriptor."""
        return {}

    def _unregister(self, memory: RegisteredMemory) -> None:
        """Raises TransferInFlightError when a peer's transfer on ``memory`` is in flight."""
        raise NotImplementedError

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        """Moves ``pairs`` (all checked) and returns when all are done; raises TransportError."""
        raise NotImplementedError

    def _transfer_one(self, op: Op, local: ByteView, remote: RemoteRange, deadline: float) -> None:
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

    def connect(self, peer_url: bytes | str, *, timeout: Timeout = None) -> int:
        """Reaches the peer whose ``bind()`` returned ``peer_url``; returns 0 (torch's)."""
        self._check_open()
        if self._peer is not None:
            raise TransportError("this transport is already connected; one peer per transport")
        url = peer_url.encode() if isinstance(peer_url, str) else bytes(peer_url)
        deadline = time.monotonic() + seconds(timeout, self.config.timeout)
        self._peer = self._connect(url, deadline)
        return 0

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
            # Set before looking at in-flight transfers, while _start() appends to them
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
        finally:  # even after a failed teardown, which cannot be undone: nothing stays usable
            with self._cv:
                for memory in self._memories.values():
                    memory._registered = False
                self._memories.clear()
            self._settle("closed")

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

    async def close_async(self, *, timeout: Timeout = None) -> None:
        """:meth:`close` for asyncio, off the event loop."""
        seconds(timeout, self.config.timeout)  # checked before anything starts
        await asyncio.to_thread(self.close, timeout=timeout)

    # -- memory and transfers (arguments checked in _dispatch, accounted in flight here) -----
    def register_memory(self, tensor: torch.Tensor, *, timeout: Timeout = None) -> RegisteredMemory:
        """Registers a contiguous tensor's bytes; keeps the tensor alive until unregistered.
        ``timeout``: checked as torch checks it (registration here does not block)."""
        seconds(timeout, self.config.timeout)
        self._check_open()
        check_tensor(
            tensor, backend=self.name, supports_cuda=self.supports_cuda, device=self.device
        )
        memory = RegisteredMemory(self, tensor)
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

    def unregister_memory(self, memory: RegisteredMemory, *, timeout: Timeout = None) -> None:  # type: ignore[override]
        """Unregisters ``memory``; raises TransferInFlightError (and keeps it registered) while
        a transfer of this side or the peer's uses it (it never waits for one)."""
        seconds(timeout, self.config.timeout)
        if memory.transport is not self:
            raise ValueError("this memory was registered with another transport")
        with self._cv:
            if not memory._registered:
                return
            # Cleared before looking at _flights, while _start() appends before looking at
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

    def write(  # type: ignore[override]  # also takes lists: a batch
        self,
        local_buffer: ByteView | Sequence[ByteView],
        remote_buffer: RemoteRange | Sequence[RemoteRange],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Any:
        """Copies ``local_buffer``'s bytes into the peer's ``remote_buffer`` range (from its
        offset). Lists of views and buffers make one batch with one completion. Returns 0, or
        with ``async_op`` a ``torch.distributed.Work``."""
        return self._start("write", local_buffer, remote_buffer, async_op, timeout)

    def read(  # type: ignore[override]  # also takes lists: a batch
        self,
        local_buffer: MutableByteView | Sequence[MutableByteView],
        remote_buffer: RemoteRange | Sequence[RemoteRange],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Any:
        """Copies the peer's ``remote_buffer`` range into ``local_buffer`` (its length)."""
        return self._start("read", local_buffer, remote_buffer, async_op, timeout)

    def _pairs(self, op: Op, local: Any, remote: Any) -> list[Pair]:
        return pairs(
            op,
            local,
            remote,
            transport=self,
            peer=self._peer,
            buffer_type=self.remote_buffer_type,
            backend=self.name,
        )

    def _start(self, op: Op, local: Any, remote: Any, async_op: bool, timeout: Timeout) -> Any:
        """Checks and runs one transfer or batch: returns 0, or with ``async_op`` its work."""
        if self._state != "open" or self._peer is None:
            self._check_open()
            raise TransportError(f"{op}(): connect() to the peer first")
        deadline = time.monotonic() + seconds(timeout, self.config.timeout)
        if not async_op and type(local) in VIEWS[op] and type(remote) is self.remote_buffer_type:
            # The hot path (one synchronous transfer): the checks of pairs(), inlined, and no
            # lock; small messages are dominated by Python overhead.
            memory = local.memory
            if (
                memory.transport is not self
                or remote.peer != self._peer
                or (local.length > remote.length)
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
        checked = self._pairs(op, local, remote)
        memories = [view.memory for view, _ in checked]
        token = object()
        for memory in memories:
            memory._flights.append(token)
        if not all(memory._registered for memory in memories) or self._state != "open":
            _done(memories, token)
            self._refuse()
        if not async_op:
            try:
                self._transfer(op, checked, deadline)
            finally:
                _done(memories, token)
            return 0
        work = TransferWork(f"{self.name} {op} of {len(checked)} range(s)", deadline)

        def job() -> None:
            error: BaseException | None = None
            try:
                if self._hold is not None:
                    self._hold.wait(max(deadline - time.monotonic(), 0))
                self._transfer(op, checked, deadline)
            except BaseException as exc:  # handed to the waiter, never lost
                error = exc
            finally:
                _done(memories, token)
            work._finish(error)

        runner = self._runner
        if runner is None:
            with self._cv:  # two first async transfers at once start one thread, not two
                if self._runner is None:
                    self._runner = AsyncRunner(
                        f"tether-transport-{self.name}-{self.instance_id[:6]}"
                    )
                runner = self._runner
        runner.submit(job)
        return work

    def _refuse(self) -> None:
        """A transfer that found, once in flight, its transport closing or its memory gone
        (checked after joining the in-flight list: see close() and unregister_memory())."""
        self._check_open()
        raise TransportError("the local view's memory is not registered (any more)")


def _done(memories: list[RegisteredMemory], token: object) -> None:
    for memory in memories:
        memory._flights.remove(token)
