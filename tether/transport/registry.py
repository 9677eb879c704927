"""Finding backends: built-ins, ``register_transport``, the ``tether.transports`` entry points."""

from __future__ import annotations

import importlib
from importlib import metadata

import torch

from tether import _log
from tether._exceptions import BackendUnavailableError
from tether.transport.base import Transport
from tether.transport.config import TransportConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_transports",
    "backend_class",
    "new_transport",
    "register_transport",
]

logger = _log.get_logger(__name__)

ENTRY_POINT_GROUP = "tether.transports"
"""Third-party backends: ``[project.entry-points."tether.transports"] NAME = "pkg.mod:Class"``."""

_BUILTIN = {
    "fake": "tether.transport.fake:FakeTransport",
    "local": "tether.transport.local:LocalTransport",
    "tcp": "tether.transport.tcp:TcpTransport",
    "nixl": "tether.transport.nixl:NixlTransport",
}
_registered: dict[str, type[Transport]] = {}


def register_transport(name: str, cls: type[Transport]) -> None:
    """Makes ``cls`` available as ``new_transport(name)`` (replacing an earlier one)."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"{cls!r} is not a Transport subclass")
    _registered[name] = cls


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def backend_class(name: str) -> type[Transport]:
    """The class behind ``name``; importing it never imports an optional dependency."""
    if name in _registered:
        return _registered[name]
    target = _BUILTIN.get(name) or _entry_points().get(name)
    if target is None:
        known = sorted({*_BUILTIN, *_registered, *_entry_points()})
        raise BackendUnavailableError(f"no transport backend {name!r}; known: {known}")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"transport backend {name!r} ({target}) failed to load"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise BackendUnavailableError(f"{target} is not a Transport subclass")
    _registered[name] = cls
    return cls


def available_transports() -> list[str]:
    """Backends that report themselves supported on this machine."""
    names = sorted({*_BUILTIN, *_registered, *_entry_points()})
    out = []
    for name in names:
        try:
            if backend_class(name).supported():
                out.append(name)
        except BackendUnavailableError as exc:
            logger.debug("transport backend %s unavailable: %s", name, exc)
    return out


def auto_order(same_host: bool) -> list[str]:
    """Preference for ``backend="auto"``: ``local`` between processes of one host (zero copy);
    ``nixl`` where CUDA is (GPU memory, RDMA); else ``tcp``. NIXL without RDMA falls back to UCX
    over TCP, which measured slower than ours, so it is not chosen on CPU-only machines."""
    order = ["local"] if same_host else []
    if torch.cuda.is_available():
        order.append("nixl")
    order.append("tcp")
    return order


def new_transport(backend: str = "auto", *, config: TransportConfig | None = None) -> Transport:
    """A new, unbound transport. ``"auto"`` picks the best backend this machine supports
    (``local`` first: connect it only to a peer on this host; ``new_transport_rank`` chooses
    per pair)."""
    if backend == "auto":
        for name in auto_order(same_host=True):
            cls = backend_class(name)
            if cls.supported():
                return cls(config)
        raise BackendUnavailableError("no transport backend is supported on this machine")
    cls = backend_class(backend)
    if not cls.supported():
        raise BackendUnavailableError(f"transport backend {backend!r} is not supported here")
    return cls(config)
