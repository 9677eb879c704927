"""A recorded job that hangs with its debug servers up: a few steps of all_reduce on the world
and on a "pair" group of ranks 0 and 1, then the culprit sleeps (GIL released, so its server
answers) while every other rank waits in the next world all_reduce. The job never ends on its
own: the test kills it."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import _common
import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--culprit", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=60.0)
    args = _common.parse(parser)
    _common.init_recorded(
        args, hang_timeout=args.hang_timeout, on_hang="dump", timeout=timedelta(seconds=600)
    )
    pair = dist.new_group([0, 1], group_desc="pair")
    t = torch.ones(8)
    for _ in range(args.steps):
        dist.all_reduce(t)
        if args.rank in (0, 1):
            dist.all_reduce(t, group=pair)
    if args.rank == args.culprit:
        time.sleep(3600)  # STUCK: never joins the next all_reduce
    dist.all_reduce(t)  # WAITS for the culprit


if __name__ == "__main__":
    main()
