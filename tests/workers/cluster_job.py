"""The training job of the multi-node tests and of ``bench/cluster.py``, run by ``tether run`` on
every simulated node (it imports nothing from tether: tether's own frames are not the user's).

A small DDP model trains; every step the ranks average the loss. At ``--fault-step`` rank
``--culprit`` hangs (sleeps before the step's all_reduce), desyncs (all_gathers where the others
all_reduce), raises a ValueError or dies of SIGKILL. After its first step each rank writes
``<--ready>/ready_<rank>``, so that node-level faults (kill, link down, freeze) are injected once
every rank is training. With ``--timing``, rank 0 prints ``STEP_TIME <seconds>``: the mean step
over the steps after the first.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--fault", choices=("hang", "desync", "raise", "kill", "none"), default="none"
    )
    parser.add_argument("--culprit", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--ready", default="")
    parser.add_argument("--timing", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    started = 0.0
    for step in range(args.steps):
        faulty = rank == args.culprit and step == args.fault_step
        if faulty and args.fault == "hang":
            time.sleep(3600)  # the culprit's line
        if faulty and args.fault == "raise":
            raise ValueError(f"bad batch at step {step}")  # the culprit's line
        if faulty and args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        mean = loss.detach().reshape(1)
        if faulty and args.fault == "desync":
            dist.all_gather([torch.zeros_like(mean) for _ in range(world)], mean)  # desync line
        else:
            dist.all_reduce(mean)
        if step == 0:
            started = time.perf_counter()
            if args.ready:
                Path(args.ready, f"ready_{rank}").write_text(str(os.getpid()))
    if args.timing and rank == 0 and args.steps > 1:
        print(f"STEP_TIME {(time.perf_counter() - started) / (args.steps - 1):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
