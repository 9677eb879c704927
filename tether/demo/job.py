"""The demo's training job. It imports nothing from tether: ``tether run`` records it.

A small DDP model trains; even and odd ranks average a metric in their own subgroup every step,
and rank 0 sends rank 1 a tensor. At ``--fault-step`` the ``--culprit`` rank misbehaves:

  hang   it stops (sleeps) before the step's collectives; the others wait for it
  crash  it dies from SIGKILL
  gil    it is stuck in a C call that holds the GIL
  none   nothing goes wrong
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FAULTS = ("hang", "crash", "gil", "none")


def misbehave(fault: str) -> None:
    if fault == "hang":
        time.sleep(3600)  # the culprit's line: it never reaches the step's collectives
    elif fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "gil":
        while True:  # a C call that never releases the GIL
            ctypes.PyDLL(None).sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--culprit", type=int, default=2)
    parser.add_argument("--fault-step", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parity, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [list(range(0, world, 2)), list(range(1, world, 2))], group_desc="parity"
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for step in range(args.steps):
        if step == args.fault_step and rank == args.culprit:
            misbehave(args.fault)
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        metric = loss.detach().clone()
        dist.all_reduce(metric, group=parity)
        if rank in (0, 1):
            buf = torch.full((4,), float(step)) if rank == 0 else torch.zeros(4)
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
