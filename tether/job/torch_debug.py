"""Where torch's own debug frontend (``torch.distributed.debug``) looks for each worker's server:
a ``debug_server`` prefix in the job's TCPStore, key ``rank<N>``, value the server's URL.

tether's rank servers answer torch's worker routes (:mod:`tether.server.torch_worker`) and
register there, so that torch's frontend shows tether's ranks. ``start_debug_server`` registers
torch's own worker under the same key: :func:`follow_torch_debug_server` puts tether's back once
it has (torch's worker keeps running, reachable only at its own address).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tether._log import get_logger
from tether.job.client import CONNECT_TIMEOUT_S, connect

__all__ = ["DEBUG_PREFIX", "follow_torch_debug_server", "register_worker", "worker_key"]

logger = get_logger(__name__)

DEBUG_PREFIX = "debug_server"
"""torch's ``torch.distributed.debug._store.tcpstore_client`` prefix."""


def worker_key(rank: int) -> str:
    return f"rank{rank}"


def register_worker(
    host: str, port: int, rank: int, url: str, *, timeout: float = CONNECT_TIMEOUT_S
) -> None:
    """Set ``rank``'s worker address for torch's frontend in the TCPStore at ``host:port``."""
    import torch.distributed as dist

    store = dist.PrefixStore(DEBUG_PREFIX, connect(host, port, timeout=timeout))  # type: ignore[attr-defined]
    store.set(worker_key(rank), url)


def follow_torch_debug_server(reregister: Callable[[], None]) -> None:
    """Call ``reregister`` each time torch's ``start_debug_server`` has registered torch's own
    worker (wrapping it once; a torch without it is left alone)."""
    try:
        import torch.distributed.debug as debug
    except ImportError:
        return
    original: Any = debug.start_debug_server
    if getattr(original, "__tether_follows__", False):
        return

    @functools.wraps(original)
    def start_debug_server(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        reregister()

    start_debug_server.__tether_follows__ = True  # type: ignore[attr-defined]
    debug.start_debug_server = start_debug_server
