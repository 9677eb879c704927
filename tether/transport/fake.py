"""In-process backend for tests and examples: two transports in one process, bytes copied by
memmove. It enforces every rule the real backends do (keys, ranges, in-flight), so code that
works against it fails the same way against them."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import ClassVar

from tether._exceptions import (
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportTimeoutError,
)
from tether.transport import _mem
from tether.transport.backend import Backend, Op
from tether.transport.memory import Pair, RegisteredMemory, RemoteRange

__all__ = ["FakeRemoteBuffer", "FakeTransport"]

_bound: weakref.WeakValueDictionary[str, FakeTransport] = weakref.WeakValueDictionary()
_SCHEME = b"fake://"


@dataclasses.dataclass(frozen=True, slots=True)
class FakeRemoteBuffer(RemoteRange):
    """A descriptor of the fake backend (the common fields only)."""

    _backend: ClassVar[str] = "fake"


class FakeTransport(Backend):
    """Both ends in one process. ``hold_inside``: when set, transfers pause (with the peer's
    memory marked in flight) until it is set — fault injection for tests."""

    name: ClassVar[str] = "fake"
    remote_buffer_type: ClassVar[type[RemoteRange]] = FakeRemoteBuffer

    hold_inside: threading.Event | None = None

    def _bind(self, deadline: float) -> bytes:
        _bound[self.instance_id] = self
        return _SCHEME + self.instance_id.encode()

    def _connect(self, url: bytes, deadline: float) -> str:
        if not url.startswith(_SCHEME):
            raise DescriptorError(f"not a fake transport URL: {url[:40]!r}")
        peer = url[len(_SCHEME) :].decode(errors="replace")
        if peer not in _bound:
            raise PeerDiedError(f"no fake transport {peer!r} is bound in this process")
        return peer

    def _register(self, memory: RegisteredMemory) -> None:
        memory.state = 0  # the peer's transfers in flight on it

    def _unregister(self, memory: RegisteredMemory) -> None:
        if memory.state:
            raise TransferInFlightError(f"a peer's transfer on {memory!r} is in flight")

    def _transfer(self, op: Op, pairs: list[Pair], deadline: float) -> None:
        peer = _bound.get(self._peer or "")
        if peer is None or peer._state == "closed":
            raise PeerDiedError("the fake peer transport is closed")
        targets: list[RegisteredMemory] = []
        try:
            with peer._cv:
                for _, buf in pairs:
                    target = peer._memories.get(buf.id)
                    if target is None or target.key != buf.key:
                        raise RemoteAccessError("peer refused: unknown buffer or wrong key")
                    if buf.offset + buf.length > target.nbytes:
                        raise RemoteAccessError("peer refused: range outside the registration")
                    target.state += 1
                    targets.append(target)
            if self.hold_inside is not None and not self.hold_inside.wait(
                max(deadline - time.monotonic(), 0)
            ):
                raise TransportTimeoutError("fake transfer held past its deadline")
            for (view, buf), target in zip(pairs, targets, strict=True):
                remote = target.ptr + buf.offset
                if op == "write":
                    _mem.copy(remote, view.ptr, view.length)
                else:
                    _mem.copy(view.ptr, remote, view.length)
        finally:
            with peer._cv:
                for target in targets:
                    target.state -= 1

    def _close(self, deadline: float) -> None:
        _bound.pop(self.instance_id, None)
