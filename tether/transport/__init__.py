"""One-sided tensor transfers between processes: ``tether.transport``.

Processes register tensors, hand each other descriptors, then read and write each other's
registered memory directly — no process group, no collectives, no matching call on the other
side. This is torch 2.15's ``torch.distributed._transport``, name for name and default for
default (``import tether.transport as _transport`` runs 2.15 code on torch 2.13 and 2.14; on
2.15 the interface classes are torch's own), plus tether's backends, remote offsets
(``RemoteRange.view``), batches (lists of views and buffers), dead-peer errors within the
timeout, ``unregister_memory`` refusing while a transfer is in flight, and ``backend="auto"``.

    t = new_transport_rank("tcp", store=store, peer_rank=peer, rank=rank)
    mem = t.register_memory(tensor)
    store.set("desc", mem.to_remote_buffer().serialize())
    ...
    remote = type(mem.to_remote_buffer()).deserialize(store.get("desc"))
    t.write(src.to_view(), remote.view(offset, nbytes))

``tether.transport.fanout`` syncs one publisher's tensors to many subscribers (a chain of pulls:
each link carries the bytes once).

Backends: ``local`` (same host, zero copy), ``tcp`` (any host), ``nixl`` (NIXL's agent, optional
package ``nixl-cu12``), ``fake`` (in process). ``register_transport`` and the entry-point group
``torch.distributed.transports`` (torch's; tether's own backends are there as ``tether-*``) add
others.
"""

from tether._exceptions import (
    BackendUnavailableError,
    DescriptorError,
    PeerDiedError,
    RemoteAccessError,
    TransferInFlightError,
    TransportError,
    TransportTimeoutError,
    UnknownTransportError,
)
from tether.transport._work import TransferWork, Work, wait_all
from tether.transport.backend import Backend
from tether.transport.base import Memory, MemoryView, MutableMemoryView, RemoteBuffer, Transport
from tether.transport.bootstrap import new_transport_rank
from tether.transport.config import TransportConfig
from tether.transport.memory import RemoteRange
from tether.transport.registry import (
    ENTRY_POINT_GROUP,
    available_transports,
    new_transport,
    register_transport,
    supported_transports,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendUnavailableError",
    "DescriptorError",
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "PeerDiedError",
    "RemoteAccessError",
    "RemoteBuffer",
    "RemoteRange",
    "TransferInFlightError",
    "TransferWork",
    "Transport",
    "TransportConfig",
    "TransportError",
    "TransportTimeoutError",
    "UnknownTransportError",
    "Work",
    "available_transports",
    "new_transport",
    "new_transport_rank",
    "register_transport",
    "supported_transports",
    "wait_all",
]
