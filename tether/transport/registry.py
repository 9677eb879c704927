"""Finding backends by name, as torch 2.15's ``torch.distributed._transport`` registry does:
``register_transport`` in this process, then the entry points of ``torch.distributed.transports``
(and tether's older group ``tether.transports``), tether's built-ins first among them.

Names are lower-cased. torch's errors: an empty name is a ``ValueError``, a factory that is not
callable a ``TypeError``, a name taken (by a registration or an entry point, built-ins included)
without ``replace=True`` a ``ValueError``, an unknown name a ``ValueError`` listing the known ones,
several entry points of one name, one that fails to load, a failed construction or an unsupported
backend a ``RuntimeError``, a factory returning something else than a Transport a ``TypeError``.

tether's backends are also entry points of ``torch.distributed.transports`` as ``tether-local``,
``tether-tcp`` and ``tether-nixl`` (pyproject.toml): torch 2.15's own registry creates them under
those names without colliding with its ``nixl``, and so does this one, beside the short names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, cast

import torch

from tether import _log
from tether._exceptions import BackendUnavailableError, UnknownTransportError
from tether.transport.backend import Backend
from tether.transport.base import Transport
from tether.transport.memory import RemoteRange

__all__ = [
    "ENTRY_POINT_GROUP",
    "LEGACY_ENTRY_POINT_GROUP",
    "auto_order",
    "available_transports",
    "new_transport",
    "register_transport",
    "remote_buffer_type",
    "supported_transports",
]

logger = _log.get_logger(__name__)

ENTRY_POINT_GROUP = "torch.distributed.transports"
"""torch 2.15's: ``[project.entry-points."torch.distributed.transports"] NAME = "pkg:Cls"``."""
LEGACY_ENTRY_POINT_GROUP = "tether.transports"
"""The group tether read before torch had one; still read."""

_BUILTIN = {
    "fake": "tether.transport.fake:FakeTransport",
    "local": "tether.transport.local:LocalTransport",
    "tcp": "tether.transport.tcp:TcpTransport",
    "nixl": "tether.transport.nixl:NixlTransport",
}

Factory = Callable[..., Transport]
_registered_transports: dict[str, Factory] = {}
"""Factories registered in this process, and entry points once loaded."""


def _key(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a transport name is a string, not {type(name).__name__}")
    if not name:
        raise ValueError("transport name cannot be empty")
    return name.lower()


def _iter_entry_points() -> Iterator[metadata.EntryPoint]:
    """tether's built-ins, then the installed entry points (tether's ``tether-*`` names among
    them, which torch 2.15's registry knows too) except those of a built-in's name."""
    for name, target in _BUILTIN.items():
        yield metadata.EntryPoint(name, target, ENTRY_POINT_GROUP)
    seen = {(name, target) for name, target in _BUILTIN.items()}
    for group in (ENTRY_POINT_GROUP, LEGACY_ENTRY_POINT_GROUP):
        for ep in metadata.entry_points(group=group):
            key = (ep.name.lower(), ep.value)
            if key in seen:  # one package in both groups
                continue
            if key[0] in _BUILTIN:
                # torch 2.15's own "nixl": in tether's registry the name is tether's backend's
                logger.debug("entry point %s = %s left to torch's registry", ep.name, ep.value)
                continue
            seen.add(key)
            yield ep


def register_transport(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``new_transport(name)`` call ``factory(**kwargs)``: a :class:`Transport` subclass, or
    any callable returning a Transport. A name already taken needs ``replace=True``."""
    key = _key(name)
    if not callable(factory):
        raise TypeError("transport factory must be callable")
    taken = key in _registered_transports or any(
        ep.name.lower() == key for ep in _iter_entry_points()
    )
    if taken and not replace:
        raise ValueError(f"transport {key!r} is already registered")
    _registered_transports[key] = factory


def _load(ep: metadata.EntryPoint, key: str) -> Any:
    try:
        return ep.load()
    except Exception as exc:
        raise BackendUnavailableError(
            f"failed to load transport entry point {key!r} ({ep.value}): {exc}"
        ) from exc


def _find_factory(key: str) -> Factory:
    factory = _registered_transports.get(key)
    if factory is not None:
        return factory
    matches = [ep for ep in _iter_entry_points() if ep.name.lower() == key]
    if len(matches) > 1:
        raise BackendUnavailableError(f"multiple entry points registered transport {key!r}")
    if not matches:
        known = ", ".join(available_transports()) or "none"
        raise UnknownTransportError(f"unknown transport {key!r}; available: {known}")
    loaded = _load(matches[0], key)
    if not callable(loaded):
        raise TypeError(f"transport entry point {key!r} must load a callable")
    factory = cast(Factory, loaded)
    _registered_transports[key] = factory
    return factory


def _is_transport_class(factory: object) -> bool:
    return isinstance(factory, type) and issubclass(factory, Transport)


def available_transports() -> tuple[str, ...]:
    """Every backend name known here, sorted, whether or not it works on this machine
    (:func:`supported_transports` says which do)."""
    names = set(_registered_transports)
    names.update(ep.name.lower() for ep in _iter_entry_points())
    return tuple(sorted(names))


def supported_transports() -> list[str]:
    """The backends that load and report themselves supported here: what ``"auto"`` picks
    from. A factory that is not a Transport class cannot say without being called: left out."""
    out = []
    for name in available_transports():
        try:
            factory = _find_factory(name)
            if _is_transport_class(factory) and factory.supported():  # type: ignore[attr-defined]
                out.append(name)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.debug("transport backend %s unavailable: %s", name, exc)
    return out


def remote_buffer_type(name: str) -> type[RemoteRange]:
    """The descriptor class of tether backend ``name`` (a ``TypeError`` for another kind)."""
    factory = _find_factory(_key(name))
    if not (isinstance(factory, type) and issubclass(factory, Backend)):
        raise TypeError(f"transport {name!r} is not one of tether's backends")
    return factory.remote_buffer_type


def auto_order(same_host: bool) -> list[str]:
    """Preference for ``backend="auto"``: ``local`` between processes of one host (zero copy);
    ``nixl`` where CUDA is (GPU memory, RDMA); else ``tcp``. NIXL without RDMA falls back to UCX
    over TCP, which measured slower than ours, so it is not chosen on CPU-only machines."""
    order = ["local"] if same_host else []
    if torch.cuda.is_available():
        order.append("nixl")
    order.append("tcp")
    return order


def new_transport(
    backend: str, device: torch.device | str | None = None, **kwargs: Any
) -> Transport:
    """A new, unbound transport of ``backend``, made by its factory with ``kwargs`` (and
    ``device`` where given); tether's backends also take ``config=TransportConfig(...)``.

    ``"auto"`` (tether's) picks the best backend this machine supports (``local`` first: connect
    it only to a peer on this host; ``new_transport_rank`` chooses per pair)."""
    key = _key(backend)
    if key == "auto":
        supported = supported_transports()
        for name in auto_order(same_host=True):
            if name in supported:
                return new_transport(name, device, **kwargs)
        raise BackendUnavailableError("no transport backend is supported on this machine")
    if device is not None:
        kwargs["device"] = device
    factory = _find_factory(key)
    if _is_transport_class(factory) and not factory.supported():  # type: ignore[attr-defined]
        raise BackendUnavailableError(f"transport {key!r} is not supported")
    try:
        transport = factory(**kwargs)
    except Exception as exc:
        raise BackendUnavailableError(f"failed to create transport {key!r}: {exc}") from exc
    if not isinstance(transport, Transport):
        raise TypeError(
            f"transport entry point {key!r} returned {type(transport).__name__}, "
            "expected a Transport"
        )
    if not transport.supported():
        transport.close()
        raise BackendUnavailableError(f"transport {key!r} is not supported")
    return transport
