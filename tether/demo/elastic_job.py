"""The elastic demo's training job (``tether demo --fault crash --elastic``), under ``tether run
--elastic``.

Every step's global batch is fixed by the step number and re-sharded over the ranks alive, so the
losses a job commits must equal one process training on each whole global batch
(:func:`reference_losses`), whatever deaths and replacements it went through. At ``--fault-step``
the ``--culprit`` rank (its first incarnation) dies from SIGKILL in the middle of the step (none
with ``--culprit -1``: the fault comes from outside, a node killed once every rank has written its
name in ``--progress-dir`` at that step); the job
runs at least ``--steps`` steps, and on until a replacement has been a member for two steps.
Each worker writes ``OUT/<rank>.<incarnation>.json``: its committed losses, its parameters'
digest and what its manager went through.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tether.elastic

GLOBAL_BATCH = 120
"""Divisible by every size from 1 to 6: every membership of a 4-rank job, and of a job of three
nodes with two ranks each, gets equal shards."""
DIM = 16


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).double()
    return model, optimizer(model)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The training's optimizer over ``model``'s parameters (made again once FSDP2 has
    replaced them with its shards)."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def shard(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    if GLOBAL_BATCH % size:
        raise ValueError(f"a global batch of {GLOBAL_BATCH} has no equal shards for {size} ranks")
    n = GLOBAL_BATCH // size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def reference_losses(steps: int) -> list[float]:
    """The same training, fault-free, in one process over each whole global batch."""
    model, opt = model_and_optimizer()
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def shard_across_nodes(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under FSDP2 on the elastic job's HSDP mesh (sharded over a node's ranks,
    replicated across nodes): each ``Linear`` a group of its own, then the root. Make its
    optimizer after: FSDP2 replaces the parameters with their shards."""
    from tether.fsdp import fully_shard

    mesh = tether.elastic.hsdp_mesh()
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # in place: the same module, now an FSDPModule too
    return model


def digest(model: torch.nn.Module) -> str:
    """The parameters' and buffers' bytes, hashed: of this rank's shards, under FSDP2."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for t in model.state_dict().values():
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--culprit", type=int, default=2)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--progress-dir", default="")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    incarnation = int(os.environ.get("TETHER_ELASTIC_REPLACEMENT", "0"))

    dist.init_process_group("gloo")
    model, opt = model_and_optimizer()
    ddp = tether.elastic.DistributedDataParallel(model)
    manager = tether.elastic.Manager(state={"model": model, "optimizer": opt})
    losses: dict[int, float] = {}
    full_since: int | None = None
    for step in manager.steps(50 * args.steps):
        if manager.world_size < world:
            full_since = None
        elif full_since is None:
            full_since = step  # every member sees the same world at the same step
        if step >= args.steps and full_since is not None and step >= full_since + 2:
            break
        if args.progress_dir and step == args.fault_step and not incarnation:
            Path(args.progress_dir, str(rank)).touch()
        with manager.attempt():
            x, y = shard(step, manager.rank, manager.world_size)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if rank == args.culprit and step == args.fault_step and not incarnation:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others are in backward
            loss.backward()  # type: ignore[no-untyped-call]
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if manager.should_commit():
                opt.step()
                losses[step] = float(mean) / manager.world_size
        time.sleep(args.step_sleep)  # a step of real work would take this long
    Path(args.out, f"{rank}.{incarnation}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "incarnation": incarnation,
                "losses": {str(k): v for k, v in sorted(losses.items())},
                "digest": digest(model),
                "world_size": manager.world_size,
                "history": manager.history,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
