"""Real torch.distributed clients over recorded (``--mode tether``) or plain (``--mode plain``)
process groups, one after the other in the same processes: DDP, FSDP2 with bf16 parameters and
fp32 gradient reduction, DTensor on a DeviceMesh, and two-stage pipelining (GPipe, then 1F1B),
each pipeline on a group of its own.

Each rank saves what the workloads computed, plus facts the test checks the recorded entries
against, to ``<out>/<mode>_rank_<r>.pt``. In tether mode it also dumps after every workload (reason
= the workload's name), so the entries of workload k are those of dump k that dump k-1 lacks; the
dump paths are saved too, in workload order.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
WIDTH = 16
ROWS = 8
MICROBATCHES = 4
WORKLOADS: dict[str, Callable[[int, int], dict[str, Any]]] = {}


def workload(fn: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    WORKLOADS[fn.__name__] = fn
    return fn


def _mlp(depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameter values (its shard, for DTensor parameters)."""
    out = {}
    for name, t in module.state_dict().items():
        local = t.to_local() if hasattr(t, "to_local") else t
        out[name] = local.detach().clone()
    return out


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


@workload
def ddp(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_mlp())  # small enough for one gradient bucket
    losses = _train(model, rank)
    return {
        "params": _params(model.module),
        "losses": losses,
        "bucket_numel": sum(p.numel() for p in model.parameters()),
        "steps": STEPS,
    }


@workload
def fsdp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _mlp()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for layer in linears:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # WIDTH divides by the world size, so no shard is padded.
    shard_numels = [sum(p.to_local().numel() for p in m.parameters()) for m in linears]
    losses = _train(model, rank)
    return {
        "params": _params(model),
        "losses": losses,
        "shard_numels": shard_numels,
        "steps": STEPS,
    }


@workload
def dtensor(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # A 2-D mesh, so the mesh creates groups of its own (its "dp" dim: one size-1 group per rank).
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))["tp"]
    torch.manual_seed(0)
    a = torch.randn(4 * world, 8)
    b = torch.randn(8, 6)
    gathered = distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    # Shard(1) @ Shard(0) gives a Partial result; making it Replicate all-reduces it.
    product = distribute_tensor(a, mesh, [Shard(1)]) @ distribute_tensor(b, mesh, [Shard(0)])
    product = product.redistribute(mesh, [Replicate()])
    return {
        "a": a,
        "b": b,
        "gathered": gathered.to_local(),
        "product": product.to_local(),
        "shard_shape": [a.shape[0] // world, a.shape[1]],
    }


def _pipeline(rank: int, world: int, schedule: str, desc: str) -> dict[str, Any]:
    from torch.distributed import pipelining

    torch.manual_seed(0)
    full = _mlp(depth=2 * world)
    per_stage = len(full) // world
    stage_mod = full[rank * per_stage : (rank + 1) * per_stage]
    group = dist.new_group(list(range(world)), group_desc=desc)
    stage = pipelining.PipelineStage(
        stage_mod, stage_index=rank, num_stages=world, device=torch.device("cpu"), group=group
    )
    sched = getattr(pipelining, schedule)(
        stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss
    )
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    losses: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = _batch(0, step)  # the pipeline's batch: the same on every stage
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            step_losses: list[torch.Tensor] = []
            sched.step(target=y, losses=step_losses)
            losses.extend(t.detach().clone() for t in step_losses)
        else:
            sched.step()
        opt.step()
    return {
        "params": _params(stage_mod),
        "losses": losses,
        "group_desc": desc,
        "microbatch_shape": [ROWS // MICROBATCHES, WIDTH],
        "microbatches": MICROBATCHES,
        "steps": STEPS,
    }


@workload
def gpipe(rank: int, world: int) -> dict[str, Any]:
    return _pipeline(rank, world, "ScheduleGPipe", "pipeline_gpipe")


@workload
def pipe_1f1b(rank: int, world: int) -> dict[str, Any]:
    # Last: its dump's p2p entries are known to trip torch's analyzer (see the test).
    return _pipeline(rank, world, "Schedule1F1B", "pipeline_1f1b")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["tether", "plain"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = _common.parse(parser)
    t0 = time.monotonic()
    torch.set_num_threads(1)  # two ranks on two cores; also keeps the arithmetic repeatable
    store = _common.connect(args)
    kwargs: dict[str, Any] = {"store": store, "rank": args.rank, "world_size": args.world_size}
    if args.mode == "tether":
        import tether

        tether.init_process_group("gloo", dump_dir=args.dump_dir, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    print(f"rank {args.rank}: {args.mode} init {time.monotonic() - t0:.2f}s", flush=True)

    results: dict[str, Any] = {"dumps": {}}
    for name in args.workloads.split(","):
        results[name] = WORKLOADS[name](args.rank, args.world_size)
        if args.mode == "tether":
            results["dumps"][name] = str(tether.dump(reason=name))
        print(f"rank {args.rank}: {name} done {time.monotonic() - t0:.2f}s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"{args.mode}_rank_{args.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
