"""The demo's training job. It imports nothing from tether: ``tether run`` records it.

A small DDP model trains; every step all ranks average the loss, even and odd ranks average a
metric in their own subgroup, and rank 0 sends rank 1 a tensor. At ``--fault-step`` the
``--culprit`` rank misbehaves:

  hang       it stops (sleeps) before the step's collectives; the others wait for it
  crash      it dies from SIGKILL
  gil        it is stuck in a C call that holds the GIL
  desync     it all_gathers the loss where the others all_reduce it; everyone then waits
  straggler  it is slow at everything, every step (the fault step does not apply): it reaches
             every collective late
  none       nothing goes wrong
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

FAULTS = ("hang", "crash", "gil", "desync", "straggler", "none")
STRAGGLER_DELAY_S = 0.05
"""How much longer than the others the straggler takes to reach each collective."""


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
    slow = rank == args.culprit and args.fault == "straggler"

    def arrive() -> None:
        """Where a slow rank loses time: before each of the step's collectives."""
        if slow:
            time.sleep(STRAGGLER_DELAY_S)

    for step in range(args.steps):
        faulty = rank == args.culprit and step == args.fault_step
        if faulty:
            misbehave(args.fault)
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        arrive()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        # DDP all_reduces the gradients during backward
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        mean_loss = loss.detach().reshape(1) / world
        arrive()
        if faulty and args.fault == "desync":
            # the culprit's line: a code path the other ranks did not take
            dist.all_gather([torch.zeros_like(mean_loss) for _ in range(world)], mean_loss)
        else:
            dist.all_reduce(mean_loss)
        metric = loss.detach().clone()
        arrive()
        dist.all_reduce(metric, group=parity)
        arrive()
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
