"""The demo's training job. It imports nothing from tether: ``tether run`` records it.

A small DDP model trains for a few steps; even and odd ranks then average a metric in their own
subgroup, and rank 0 sends a tensor to rank 1.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(args.steps):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    parity, _ = dist.new_subgroups_by_enumeration(  # type: ignore[no-untyped-call]
        [list(range(0, world, 2)), list(range(1, world, 2))], group_desc="parity"
    )
    metric = loss.detach().clone()
    dist.all_reduce(metric, group=parity)

    if world > 1 and rank in (0, 1):
        buf = torch.arange(4.0) if rank == 0 else torch.zeros(4)
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
