"""Finding backends by name, as torch 2.15's ``torch.distributed._transport`` registry does:
``register_transport`` in this process, then the entry points of ``torch.distributed.transports``
(and tether's older group ``tether.transports``), tether's own backends among them.

Names are lower-cased. torch's errors: an empty name is a ``ValueError``, a factory that is not
callable a ``TypeError``, a name taken (by a registration or an entry point, built-ins included)
without ``replace=True`` a ``ValueError``, an unknown name a ``ValueError`` listing the known ones,
several entry points of one name, one that fails to load, a failed construction or an unsupported
backend a ``RuntimeError``, a factory returning something else than a Transport a ``TypeError``.

tether's backends are built in under two names: ``tether-local``, ``tether-tcp``, ``tether-nixl``
and the short ``local``, ``tcp``, ``nixl``, ``fake``. All but ``nixl`` and ``fake`` are also entry
points of ``torch.distributed.transports`` (pyproject.toml), so torch 2.15's own registry creates
them by those names. An installed entry point of a short name takes it (torch 2.15's ``nixl``: in
tether's registry, as in torch's, ``nixl`` is then torch's backend), never a ``tether-`` one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, TypeGuard, cast

import torch

from tether import _log
from tether._exceptions import BackendUnavailableError, UnknownTransportError
from tether.transport.backend import Backend
from tether.transport.base import Transport
from tether.transport.memory import RemoteRange, use_descriptor_classes

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

_OWN = {
    "fake": "tether.transport.fake:FakeTransport",
    "local": "tether.transport.local:LocalTransport",
    "tcp": "tether.transport.tcp:TcpTransport",
    "nixl": "tether.transport.nixl:NixlTransport",
}
"""tether's backends by short name."""
_ALIASED = ("local", "tcp", "nixl")
"""Also built in as ``tether-<name>``, their name in torch's registry."""

Factory = Callable[..., Transport]
_registered_transports: dict[str, Factory] = {}
"""Factories registered in this process, and entry points once loaded."""


def _key(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a transport name is a string, not {type(name).__name__}")
    if not name:
        raise ValueError("transport name cannot be empty")
    return name.lower()


def _builtins() -> dict[str, str]:
    own = dict(_OWN)
    own.update((f"tether-{name}", _OWN[name]) for name in _ALIASED)
    return own


def _iter_entry_points() -> Iterator[metadata.EntryPoint]:
    """tether's built-ins (a short name only where no installed entry point has it), then the
    installed entry points that are not one of them."""
    builtins = _builtins()
    installed: dict[tuple[str, str], metadata.EntryPoint] = {}
    for group in (ENTRY_POINT_GROUP, LEGACY_ENTRY_POINT_GROUP):
        for ep in metadata.entry_points(group=group):
            key = (ep.name.lower(), ep.value)
            if builtins.get(key[0]) != key[1]:  # tether's tether-* entry points are built in
                installed.setdefault(key, ep)  # one package in both groups counts once
    taken = {name for name, _ in installed}
    for name, target in builtins.items():
        if name in _OWN and name in taken:
            logger.debug("transport %r: an installed entry point has the name", name)
            continue
        yield metadata.EntryPoint(name, target, ENTRY_POINT_GROUP)
    yield from installed.values()


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


def _is_transport_class(factory: object) -> TypeGuard[type[Transport]]:
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
            if _is_transport_class(factory) and factory.supported():
                out.append(name)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.debug("transport backend %s unavailable: %s", name, exc)
    return out


def remote_buffer_type(backend: str) -> type[RemoteRange]:
    """The descriptor class of a tether backend's descriptors named ``backend``: one of
    tether's own, or of a :class:`Backend` registered in this process. A descriptor comes from
    another process: its name never makes this process import an installed plugin."""
    classes = dict(_own_descriptor_classes())
    for factory in _registered_transports.values():
        if isinstance(factory, type) and issubclass(factory, Backend):
            classes.setdefault(factory.remote_buffer_type._backend, factory.remote_buffer_type)
    found = classes.get(backend)
    if found is None:
        raise ValueError(f"no tether backend writes descriptors of {backend!r}")
    return found


use_descriptor_classes(remote_buffer_type)


@functools.cache
def _own_descriptor_classes() -> dict[str, type[RemoteRange]]:
    classes = {}
    for name, target in _OWN.items():
        backend = _load(metadata.EntryPoint(name, target, ENTRY_POINT_GROUP), name)
        classes[backend.remote_buffer_type._backend] = backend.remote_buffer_type
    return classes


def auto_order(same_host: bool) -> list[str]:
    """Preference for ``backend="auto"``, among tether's backends: ``local`` between processes
    of one host (zero copy); ``nixl`` where CUDA is (GPU memory, RDMA); else ``tcp``. NIXL
    without RDMA falls back to UCX over TCP, which measured slower than ours, so it is not chosen
    on CPU-only machines."""
    order = ["tether-local"] if same_host else []
    if torch.cuda.is_available():
        order.append("tether-nixl")
    order.append("tether-tcp")
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
    if _is_transport_class(factory) and not factory.supported():
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
