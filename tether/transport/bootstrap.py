"""Connecting a pair of ranks through a ``torch.distributed.Store``, no collectives: torch 2.15's
``new_transport_rank``, its keys and its errors, so a tether rank and a torch 2.15 rank of the same
backend meet.

    pair    = transport/<backend>/<lower rank>/<higher rank>
    attempt = store.add(pair/attempts/<rank>, 1)       a retried pair meets in fresh keys
    scoped  = PrefixStore(pair/<attempt>, store)
    scoped.set(<rank>, bind()); scoped.wait([<peer>]); connect(scoped.get(<peer>))

``backend="auto"`` is tether's: both ranks first publish their host and supported backends under
``scoped`` ``info/<rank>`` and take the first of ``local`` (same host), ``nixl`` (CUDA machines),
``tcp`` that both support. A host is one kernel and one network stack: two network namespaces of
one machine (containers, simulated nodes) are two hosts, which reach each other by their network.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from tether import _log
from tether._exceptions import BackendUnavailableError, DescriptorError, TransportTimeoutError
from tether.transport.base import Transport
from tether.transport.config import validate_timeout
from tether.transport.local import _boot_id
from tether.transport.registry import auto_order, new_transport, supported_transports

__all__ = ["new_transport_rank"]

logger = _log.get_logger(__name__)


def _host() -> str:
    """This host, as ``auto`` compares it: the kernel's boot id and the network namespace."""
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{_boot_id()}/{net}"


def _nonnegative(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a nonnegative integer")
    return value


def new_transport_rank(
    backend: str,
    device: torch.device | str | None = None,
    *,
    store: Store | None = None,
    peer_rank: int,
    rank: int | None = None,
    bootstrap_timeout: float | timedelta = 30.0,
    **kwargs: Any,
) -> Transport:
    """A transport of ``backend`` connected to ``peer_rank``; both ranks call it, each naming
    the other. ``store``: the default group's store where None; ``rank``: this process's rank in
    the default group where None; ``kwargs`` go to the backend (tether's: ``config=``)."""
    rank = dist.get_rank() if rank is None else rank
    _nonnegative(rank, "rank")
    _nonnegative(peer_rank, "peer_rank")
    if peer_rank == rank:
        raise ValueError("peer_rank must differ from the local rank")
    secs = validate_timeout(bootstrap_timeout)
    if secs is None:
        raise ValueError("bootstrap_timeout must be finite and nonnegative")
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + secs
    lo, hi = sorted((rank, peer_rank))
    name = backend.lower()
    pair = f"transport/{name}/{lo}/{hi}"
    attempt = store.add(f"{pair}/attempts/{rank}", 1)
    scoped = PrefixStore(f"{pair}/{attempt}", store)

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    def exchange(key: str, value: bytes) -> bytes:
        scoped.set(f"{key}{rank}", value)  # type: ignore[arg-type]  # bytes work
        try:
            scoped.wait([f"{key}{peer_rank}"], timedelta(seconds=left()))
        except RuntimeError as exc:  # the store's timeout (DistStoreError) or its failure
            raise TransportTimeoutError(
                f"rank {peer_rank} did not publish its transport {key or 'url'} within "
                f"{secs:g} s (attempt {attempt}; the store said: {exc}); is it running and "
                "calling new_transport_rank?"
            ) from exc
        return bytes(scoped.get(f"{key}{peer_rank}"))

    if name == "auto":
        mine = {"host": _host(), "backends": supported_transports()}
        try:
            theirs = json.loads(exchange("info/", json.dumps(mine).encode()))
            same_host = theirs["host"] == mine["host"]
            common = set(mine["backends"]) & set(theirs["backends"])
        except (ValueError, TypeError, KeyError) as exc:
            raise DescriptorError(f"rank {peer_rank} published malformed backend info") from exc
        choice = next((b for b in auto_order(same_host) if b in common), None)
        if choice is None:
            raise BackendUnavailableError(f"ranks {rank} and {peer_rank} share no backend")
        name = choice
    transport = new_transport(name, device, **kwargs)
    try:
        url = transport.bind(timeout=left())
        transport.connect(exchange("", url), timeout=left())
    except BaseException:
        try:
            transport.close(timeout=left())
        except Exception:
            logger.exception("new_transport_rank: closing the transport after a failure failed")
        raise
    return transport
