"""Registered memory and what points into it: :class:`Memory` (a registered tensor), its
:class:`MemoryView` ranges (transfer sources) and :class:`MutableMemoryView` ranges (destinations),
and :class:`RemoteBuffer`, a peer's range, carried between processes as a JSON descriptor."""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import TYPE_CHECKING, Any

import torch

from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    RemoteAccessError,
    TransportError,
)
from tether.transport import descriptor

if TYPE_CHECKING:
    from tether.transport.base import Transport

__all__ = ["Memory", "MemoryView", "MutableMemoryView", "Pair", "RemoteBuffer"]


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
            from tether.transport._mem import ptr_memoryview  # loads libc: only when used

            self._mv = ptr_memoryview(self.ptr, self.nbytes)
        return self._mv

    def _range(self, offset: int, length: int | None) -> tuple[int, int]:
        if length is None:
            length = self.nbytes - offset
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(
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
        from tether.transport.registry import backend_class  # the registry imports the backends

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
"""One range of a transfer: this side's view and the peer's buffer (checked to fit)."""
