"""Transport settings: one frozen sub-config per backend (``tcp=``, ``local=``, ``nixl=``), nested
in :class:`TransportConfig` with the timeout they share, and the timeout argument of blocking calls.

A setting out of range raises :class:`ConfigError` naming the field to change.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

from tether._exceptions import ConfigError

__all__ = [
    "LocalConfig",
    "NixlConfig",
    "TcpConfig",
    "Timeout",
    "TransportConfig",
    "seconds",
    "validate_timeout",
]

Timeout = timedelta | float | None
"""Seconds or a timedelta; None means the transport's ``config.timeout``."""
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
_TIMEOUT_S = 60.0
T = TypeVar("T")


def _check_range(owner: str, name: str, value: int, low: int, high: int, shown: str = "") -> None:
    if not low <= value <= high:
        raise ConfigError(f"{owner}.{name} must be in {shown or [low, high]}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TcpConfig:
    """The ``tcp`` backend's settings."""

    host: str = "127.0.0.1"
    """The address to listen on and to advertise. Loopback by default; a wildcard address is
    refused because peers could not reach it (give an interface's address instead)."""
    port: int = 0
    """The port to listen on; 0 picks a free one."""
    flows: int = 4
    """Sockets per peer; large transfers are split over them."""
    frame_bytes: int = 4 << 20
    """The largest piece of a transfer sent as one frame."""
    busy_poll_us: int = 50
    """Microseconds a side polls its socket before it sleeps: a caller waiting for a small
    transfer's reply, and a server waiting for the next request after answering one. Being put
    to sleep and woken costs 10-30 us per round trip on VMs (most of a 16 B transfer); the price
    is up to this much CPU per small transfer on each side. 0 never polls."""

    def __post_init__(self) -> None:
        if self.host in _WILDCARD_HOSTS:
            raise ConfigError(
                f"tcp.host {self.host!r} is a wildcard: peers cannot reach it and it exposes "
                "registered memory on every interface; give this host's address instead"
            )
        _check_range("tcp", "port", self.port, 0, 65535)
        _check_range("tcp", "flows", self.flows, 1, 64)
        _check_range("tcp", "frame_bytes", self.frame_bytes, 4096, 64 << 20, "[4 KiB, 64 MiB]")
        _check_range("tcp", "busy_poll_us", self.busy_poll_us, 0, 100_000, "[0, 1e5]")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalConfig:
    """The ``local`` backend's settings (sizes of its shared control block)."""

    max_buffers: int = 1024
    """Registrations a transport can hold at once."""
    max_peers: int = 16
    """Processes that can be connected to one transport at once."""

    def __post_init__(self) -> None:
        _check_range("local", "max_buffers", self.max_buffers, 1, 65536)
        _check_range("local", "max_peers", self.max_peers, 1, 256)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NixlConfig:
    """The ``nixl`` backend's settings."""

    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends the agent uses."""
    progress_us: int = 100
    """Microseconds the agent's progress thread sleeps between rounds (NIXL's own default, 0,
    spins a whole core; the owner's side needs the thread only to set up connections and for
    protocols that are not one-sided, such as UCX over TCP)."""
    max_buffers: int = 1024
    """Registrations a transport can hold at once."""

    def __post_init__(self) -> None:
        _check_range("nixl", "progress_us", self.progress_us, 0, 1_000_000, "[0, 1e6]")
        _check_range("nixl", "max_buffers", self.max_buffers, 1, 65536)


_C = TypeVar("_C", TcpConfig, LocalConfig, NixlConfig)


class _Flat(Generic[T]):
    """A field of a sub-config under its name of before the sub-configs (``config.flows`` for
    ``config.tcp.flows``); setting it replaces the sub-config(s), checked again."""

    def __init__(self, *paths: str) -> None:
        self.paths = [tuple(path.split(".")) for path in paths]  # the first is the one read

    @overload
    def __get__(self, obj: None, owner: type) -> _Flat[T]: ...
    @overload
    def __get__(self, obj: TransportConfig, owner: type) -> T: ...
    def __get__(self, obj: TransportConfig | None, owner: type) -> _Flat[T] | T:
        if obj is None:
            return self
        sub, name = self.paths[0]
        value: T = getattr(getattr(obj, sub), name)
        return value

    def __set__(self, obj: TransportConfig, value: T) -> None:
        for sub, name in self.paths:
            setattr(obj, sub, dataclasses.replace(getattr(obj, sub), **{name: value}))


def _sub(kind: type[_C], given: _C | None, **flat: Any) -> _C:
    """``given`` (or the defaults) with the flat keywords that were passed laid over it."""
    if given is not None and not isinstance(given, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(given).__name__}")
    changes = {name: value for name, value in flat.items() if value is not None}
    if given is None:
        return kind(**changes)
    return dataclasses.replace(given, **changes) if changes else given


@dataclasses.dataclass(kw_only=True, slots=True, init=False)
class TransportConfig:
    """Settings of one transport: the timeout, and each backend's own sub-config.

    The flat keywords (``host=`` ... ``nixl_progress_us=``) and attributes of the same names are
    those of before the sub-configs and stay: each sets a field of its backend's sub-config, over
    the sub-config given (``max_buffers`` sets both ``local``'s and ``nixl``'s).
    """

    timeout: float = _TIMEOUT_S
    """Seconds: the default for every blocking call (bind, connect, transfers, close)."""
    tcp: TcpConfig = dataclasses.field(default_factory=TcpConfig)
    local: LocalConfig = dataclasses.field(default_factory=LocalConfig)
    nixl: NixlConfig = dataclasses.field(default_factory=NixlConfig)

    def __init__(
        self,
        *,
        timeout: float = _TIMEOUT_S,
        tcp: TcpConfig | None = None,
        local: LocalConfig | None = None,
        nixl: NixlConfig | None = None,
        host: str | None = None,
        port: int | None = None,
        flows: int | None = None,
        frame_bytes: int | None = None,
        busy_poll_us: int | None = None,
        max_buffers: int | None = None,
        max_peers: int | None = None,
        nixl_backends: tuple[str, ...] | None = None,
        nixl_progress_us: int | None = None,
    ) -> None:
        if not (math.isfinite(timeout) and timeout > 0):
            raise ConfigError(f"timeout must be finite and > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.tcp = _sub(
            TcpConfig,
            tcp,
            host=host,
            port=port,
            flows=flows,
            frame_bytes=frame_bytes,
            busy_poll_us=busy_poll_us,
        )
        self.local = _sub(LocalConfig, local, max_buffers=max_buffers, max_peers=max_peers)
        self.nixl = _sub(
            NixlConfig,
            nixl,
            backends=nixl_backends,
            progress_us=nixl_progress_us,
            max_buffers=max_buffers,
        )

    host = _Flat[str]("tcp.host")
    port = _Flat[int]("tcp.port")
    flows = _Flat[int]("tcp.flows")
    frame_bytes = _Flat[int]("tcp.frame_bytes")
    busy_poll_us = _Flat[int]("tcp.busy_poll_us")
    max_buffers = _Flat[int]("local.max_buffers", "nixl.max_buffers")
    max_peers = _Flat[int]("local.max_peers")
    nixl_backends = _Flat[tuple[str, ...]]("nixl.backends")
    nixl_progress_us = _Flat[int]("nixl.progress_us")


def validate_timeout(timeout: Timeout) -> float | None:
    """torch 2.15's rule and words for every ``timeout=``: None, or seconds that are finite and
    nonnegative, checked before anything is submitted (0 gives up at once on what is not already
    done). A timedelta is tether's too."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, timedelta | int | float):
        raise TypeError(f"timeout must be seconds or a timedelta, not {type(timeout).__name__}")
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(secs) and secs >= 0):
        raise ValueError("timeout must be finite and nonnegative")
    return secs


def seconds(timeout: Timeout, default: float) -> float:
    """``timeout`` checked by :func:`validate_timeout`, in seconds; ``default`` when None."""
    secs = validate_timeout(timeout)
    return default if secs is None else secs
