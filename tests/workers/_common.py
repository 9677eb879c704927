"""Argument parsing and process-group set-up shared by the test workers."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def parse(extra: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = extra or argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dump-dir", required=True)
    return parser.parse_args()


def connect(args: argparse.Namespace, timeout_s: float = 60.0) -> dist.TCPStore:
    """A client of the test's TCPStore."""
    return dist.TCPStore(
        "127.0.0.1",
        args.port,
        args.world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )


def init_recorded(args: argparse.Namespace, **tether_options: Any) -> dist.TCPStore:
    """Join the test's store and start a recorded gloo job (``tether_options`` are
    ``tether.init_process_group``'s own: hang_timeout, on_hang, ring_size, ...)."""
    import tether

    store = connect(args)
    tether.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world_size,
        dump_dir=args.dump_dir,
        **tether_options,
    )
    return store
