"""One-sided tensor transfers between processes: ``tether.transport``.

Processes register tensors, hand each other descriptors, then read and write each other's
registered memory directly — no process group, no collectives, no matching call on the other
side. The names and semantics follow torch 2.15's ``torch.distributed._transport``, plus remote
offsets (``RemoteBuffer.view``), batches (lists of views and buffers), dead-peer errors within
the timeout, and ``unregister_memory`` refusing while a transfer is in flight.

    t = new_transport_rank(store, rank, peer_rank)      # or new_transport("tcp"), bind, connect
    mem = t.register_memory(tensor)
    store.set("desc", mem.to_remote_buffer().serialize())
    ...
    remote = RemoteBuffer.deserialize(store.get("desc"))
    t.write(src.to_view(), remote.view(offset, nbytes))

Backends: ``local`` (same host, zero copy), ``tcp`` (any host), ``nixl`` (NIXL's agent, optional
package ``nixl-cu12``), ``fake`` (in process). ``register_transport`` and the entry-point group
``tether.transports`` add others.
"""

from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
    TransportTimeoutError,
)
from tether.transport._work import TransferWork
from tether.transport.base import Transport
from tether.transport.bootstrap import new_transport_rank
from tether.transport.config import TransportConfig
from tether.transport.memory import Memory, MemoryView, MutableMemoryView, RemoteBuffer
from tether.transport.registry import (
    ENTRY_POINT_GROUP,
    available_transports,
    new_transport,
    register_transport,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendUnavailableError",
    "DescriptorError",
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "PeerDiedError",
    "RemoteAccessError",
    "RemoteBuffer",
    "TransferInFlightError",
    "TransferWork",
    "Transport",
    "TransportConfig",
    "TransportError",
    "TransportTimeoutError",
    "available_transports",
    "new_transport",
    "new_transport_rank",
    "register_transport",
]
