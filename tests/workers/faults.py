"""A recorded job with an injected fault on one rank (the culprit).

  --fault sleep     the culprit sleeps (GIL released) instead of joining the step's all_reduce
  --fault inside    the culprit waits inside a receive that nobody answers
  --fault gil       the culprit is stuck in a C call that holds the GIL
  --fault subgroup  the culprit skips an all_reduce on a subgroup; the world group keeps running
  --fault none      no fault
The job trains a few steps of all_reduce; the fault hits at --fault-step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from datetime import timedelta

import _common
import torch
import torch.distributed as dist

import tether


def hold_the_gil(seconds: int) -> None:
    # PyDLL calls keep the GIL held, like a C extension that never releases it. A signal ends
    # sleep() early, so sleep again: between two calls other threads may briefly run.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctypes.PyDLL(None).sleep(seconds)  # STUCK:gil


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="sleep")
    parser.add_argument("--culprit", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hang-timeout", type=float, default=2.0)
    parser.add_argument("--on-hang", default="abort")
    parser.add_argument("--gil-seconds", type=int, default=8)
    args = _common.parse(parser)
    store = _common.connect(args)
    tether.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world_size,
        dump_dir=args.dump_dir,
        hang_timeout=args.hang_timeout,
        on_hang=args.on_hang,
        timeout=timedelta(seconds=120),
    )
    rank, culprit = args.rank, args.culprit
    others = dist.new_group([r for r in range(args.world_size) if r != culprit], group_desc="rest")
    everyone_but_last = list(range(args.world_size - 1))
    sub = dist.new_group(everyone_but_last, group_desc="sub")
    t = torch.ones(8)
    for step in range(args.steps):
        faulty = rank == culprit and step == args.fault_step
        if faulty and args.fault == "sleep":
            time.sleep(600)  # STUCK:sleep
        elif faulty and args.fault == "inside":
            dist.recv(torch.zeros(1), src=(rank + 1) % args.world_size)  # STUCK:inside
        elif faulty and args.fault == "gil":
            hold_the_gil(args.gil_seconds)
        if args.fault == "subgroup" and step == args.fault_step:
            if rank in everyone_but_last and not faulty:
                dist.all_reduce(t, group=sub)  # every member but the culprit: hangs
            elif rank not in everyone_but_last:
                for _ in range(50):  # the world group's other traffic keeps flowing
                    dist.all_reduce(torch.ones(1), group=others)
            else:
                time.sleep(600)  # STUCK:subgroup
        dist.all_reduce(t)  # STEP:all_reduce
    print("RESULT " + json.dumps({"pid": os.getpid(), "finished": True}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
