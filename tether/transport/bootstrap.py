"""Connecting a pair of ranks through a ``torch.distributed.Store`` — no collectives."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

from tether._exceptions import BackendUnavailableError, TransportTimeoutError
from tether.transport.base import Transport
from tether.transport.config import Timeout, TransportConfig, seconds
from tether.transport.local import _boot_id
from tether.transport.registry import auto_order, available_transports, new_transport

__all__ = ["new_transport_rank"]


def new_transport_rank(
    store: Store,
    rank: int,
    peer_rank: int,
    *,
    backend: str = "auto",
    config: TransportConfig | None = None,
    timeout: Timeout = None,
) -> Transport:
    """A transport connected to ``peer_rank``; both ranks call it with each other's rank.

    Each side counts its attempts for this pair with ``store.add``, so a retried pair meets in a
    fresh key space (``PrefixStore`` per attempt) and never reads a stale URL. With ``"auto"``,
    the ranks exchange their host identity and backends and pick the first of ``local`` (same
    host), ``nixl`` (CUDA machines), ``tcp`` that both support.
    """
    secs = seconds(timeout, (config or TransportConfig()).timeout)
    deadline = time.monotonic() + secs
    lo, hi = sorted((rank, peer_rank))
    pair = f"tether/transport/{lo}-{hi}"
    attempt = store.add(f"{pair}/attempts/{rank}", 1)
    scoped = PrefixStore(f"{pair}/{attempt}/", store)

    def exchange(what: str, value: bytes) -> bytes:
        scoped.set(f"{what}/{rank}", value)  # type: ignore[arg-type]  # bytes work
        left = deadline - time.monotonic()
        try:
            scoped.wait([f"{what}/{peer_rank}"], timedelta(seconds=max(left, 0.001)))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TransportTimeoutError(
                f"rank {peer_rank} did not publish its transport {what} within {secs:.0f} s "
                f"(attempt {attempt}); is it running and calling new_transport_rank?"
            ) from exc
        return bytes(scoped.get(f"{what}/{peer_rank}"))

    if backend == "auto":
        mine = {"host": _boot_id(), "backends": available_transports()}
        theirs = json.loads(exchange("info", json.dumps(mine).encode()))
        same_host = theirs.get("host") == mine["host"]
        common = set(mine["backends"]) & set(theirs.get("backends", []))
        choice = next((b for b in auto_order(same_host) if b in common), None)
        if choice is None:
            raise BackendUnavailableError(f"ranks {rank} and {peer_rank} share no backend")
        backend = choice
    transport = new_transport(backend, config=config)
    try:
        url = transport.bind(timeout=max(deadline - time.monotonic(), 0.001))
        peer_url = exchange("url", url)
        transport.connect(peer_url, timeout=max(deadline - time.monotonic(), 0.001))
    except BaseException:
        transport.close()
        raise
    return transport
