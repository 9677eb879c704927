"""tether's registered memory and what points into it: :class:`RegisteredMemory` (a registered
tensor), its :class:`ByteView` ranges (transfer sources) and :class:`MutableByteView` ranges
(destinations), and :class:`RemoteRange`, a peer's range carried between processes as a
descriptor. They are what torch 2.15's ``Memory``, ``MemoryView``, ``MutableMemoryView`` and
``RemoteBuffer`` protocols (``base``) describe."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Protocol

import torch

from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    RemoteAccessError,
    TransportError,
)
from tether.transport.config import TransportConfig, seconds
from tether.transport.descriptor import WireDescriptor, decode

__all__ = [
    "COMMON_FIELDS",
    "ByteView",
    "MutableByteView",
    "Owner",
    "Pair",
    "RegisteredMemory",
    "RemoteRange",
    "use_descriptor_classes",
]


class Owner(Protocol):
    """What registered memory needs of the transport that registered it: a
    :class:`~tether.transport.backend.Backend`, declared here because ``backend`` imports this
    module."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> TransportConfig: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def remote_buffer_type(self) -> type[RemoteRange]: ...

    def _descriptor_fields(self, memory: RegisteredMemory) -> dict[str, int | str | bytes]:
        """The backend's own fields of ``memory``'s descriptor."""
        ...


class RegisteredMemory:
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

    def __init__(self, transport: Owner, tensor: torch.Tensor) -> None:
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

    def _range(self, offset: int | None, length: int | None) -> tuple[int, int]:
        offset = 0 if offset is None else offset
        if length is None:
            length = self.nbytes - offset
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(
                f"view [{offset}, {offset + length}) is outside this memory of {self.nbytes} bytes"
            )
        return offset, length

    def to_view(self, offset: int | None = None, length: int | None = None) -> ByteView:
        """Bytes ``[offset, offset+length)`` as a transfer source."""
        return ByteView(self, *self._range(offset, length))

    def to_mutable_view(
        self, offset: int | None = None, length: int | None = None
    ) -> MutableByteView:
        """Bytes ``[offset, offset+length)`` as a transfer destination."""
        return MutableByteView(self, *self._range(offset, length))

    def to_remote_buffer(self, *, timeout: float | None = None) -> RemoteRange:
        """What a peer needs to reach this memory; hand it only to peers you trust with it.
        ``timeout``: checked as torch checks it (making a descriptor does not block)."""
        seconds(timeout, self.transport.config.timeout)
        if not self._registered:
            raise TransportError("this memory is not registered (any more)")
        t = self.transport
        return t.remote_buffer_type(
            peer=t.instance_id,
            id=self.id,
            key=self.key,
            size=self.nbytes,
            offset=0,
            length=self.nbytes,
            **t._descriptor_fields(self),
        )

    def __repr__(self) -> str:
        return f"RegisteredMemory({self.transport.name}, {self.nbytes} bytes, id={self.id:#x})"


@dataclasses.dataclass(frozen=True, slots=True)
class ByteView:
    """A byte range of registered memory, read by transfers. Shape and dtype are the caller's."""

    memory: RegisteredMemory
    offset: int
    length: int

    def size(self) -> int:
        return self.length

    @property
    def ptr(self) -> int:
        return self.memory.ptr + self.offset


@dataclasses.dataclass(frozen=True, slots=True)
class MutableByteView(ByteView):
    """A byte range of registered memory that transfers may write."""

    writable: ClassVar[Literal[True]] = True


COMMON_FIELDS: dict[str, type] = {
    "peer": str,
    "id": int,
    "key": bytes,
    "size": int,
    "offset": int,
    "length": int,
}
"""Every tether descriptor's fields; a backend's descriptor class adds its own."""


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteRange(WireDescriptor):
    """tether's RemoteBuffer: a byte range of a peer's registered memory. Each backend has its
    subclass naming its ``_backend`` and ``_fields``, as torch 2.15's backends have theirs;
    :meth:`view` narrows a range (remote offsets); ``RemoteRange.deserialize`` takes any tether
    backend's descriptor, a backend's class only its own."""

    _backend: ClassVar[str] = ""
    _fields: ClassVar[Mapping[str, type]] = COMMON_FIELDS

    peer: str
    """The instance id of the transport that registered it."""
    id: int
    key: bytes
    """128 random bits: the capability to reach this memory."""
    size: int
    """Bytes registered; ``offset + length <= size``."""
    offset: int
    length: int

    @property
    def backend(self) -> str:
        return self._backend

    def view(self, offset: int, length: int | None = None) -> RemoteRange:
        """Bytes ``[offset, offset+length)`` of this range (relative to its start)."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RemoteAccessError(
                f"range [{offset}, {offset + length}) is outside the remote buffer's "
                f"{self.length} bytes"
            )
        return dataclasses.replace(self, offset=self.offset + offset, length=length)

    @classmethod
    def deserialize(cls, data: bytes) -> Any:
        """Parses and checks a descriptor: :class:`DescriptorError` when it is malformed,
        truncated, of another version or of a backend ``cls`` does not take."""
        name, fields = decode(data, cls._schema)
        made: RemoteRange = cls._class_of(name)(**fields)  # type: ignore[arg-type]  # checked
        # Checked here, not at construction: a backend must still refuse a range built by hand.
        if len(made.key) != 16:
            raise DescriptorError("invalid descriptor field 'key': not 16 bytes")
        if made.offset + made.length > made.size:
            raise DescriptorError(
                f"descriptor range [{made.offset}, {made.offset + made.length}) exceeds the "
                f"{made.size} bytes registered"
            )
        return made

    @classmethod
    def _schema(cls, backend: str) -> Mapping[str, type]:
        return cls._class_of(backend)._fields

    @classmethod
    def _class_of(cls, backend: str) -> type[RemoteRange]:
        if cls._backend:
            if backend != cls._backend:
                raise DescriptorError(
                    f"descriptor belongs to a different backend ({backend!r}, not {cls._backend!r})"
                )
            return cls
        if _descriptor_classes is None:  # only while the package is being imported
            raise DescriptorError("no transport registry is loaded to read this descriptor")
        try:
            return _descriptor_classes(backend)
        except (BackendUnavailableError, TypeError, ValueError) as exc:
            raise DescriptorError(f"descriptor of an unknown backend: {exc}") from exc


Pair = tuple[ByteView, RemoteRange]
"""One range of a transfer: this side's view and the peer's buffer (checked to fit)."""

_descriptor_classes: Callable[[str], type[RemoteRange]] | None = None
"""A backend's name -> its descriptor class: the registry's, handed over as the registry loads
(the package's ``__init__`` imports it). Not imported from here: the registry imports the
backends, which import this module."""


def use_descriptor_classes(lookup: Callable[[str], type[RemoteRange]]) -> None:
    """Where ``RemoteRange.deserialize`` finds the class of a backend's descriptors."""
    global _descriptor_classes
    _descriptor_classes = lookup
