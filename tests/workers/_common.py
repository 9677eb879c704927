"""Argument parsing and process-group set-up shared by the test workers."""

from __future__ import annotations

import argparse
from datetime import timedelta

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
