"""One rank of a job run by ``bench/crash_exit.py``: DDP on a small model; at step ``--step`` the
culprit notes the time (``--sync/raised``, ns since the epoch) and raises ValueError in the
script's own code, between two collectives, as a bad batch would. Run by the benchmark, never
directly: under ``torchrun`` or ``tether run``, the same script for both."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--sync", type=Path, required=True)
parser.add_argument("--culprit", type=int, default=1)
parser.add_argument("--step", type=int, default=3)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(32, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(args.step + 2):
    loss = model(torch.randn(16, 32)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == args.culprit and step == args.step:
        (args.sync / "raised").write_text(str(time.time_ns()))
        raise ValueError(f"bad batch at step {step}")
    dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
