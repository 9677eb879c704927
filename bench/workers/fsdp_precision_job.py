"""One rank of a job run by ``bench/fsdp_precision.py``: a small MoE transformer under FSDP2.

Configurations (``--config``), all with bf16 compute and fp32 gradient reduction:

  bf16        torch's ``fully_shard`` per block and on the root; gates and norms in bf16 too
  override    tether's ``fully_shard`` with ``param_dtype_override_fn=keep_original_dtype(...)``:
              gates and norms all-gathered and computed in fp32 inside their block's group
  workaround  torch's ``fully_shard``; every gate and norm first sharded as a group of its own
              with an fp32 policy, then each block (and the root) in bf16

Each rank prints one ``RESULT {json}`` line: its loss at the first step and at the last timed
one, the wall time of each timed step, collectives per timed step, and the memory figures
(``peak_alloc_mib``, ``peak_rss_mib``). Run by the benchmark, never directly.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.common_fsdp import patch_all_gather, patch_reduce_scatter

import tether.fsdp

DIM, HEADS, SEQ, BATCH, EXPERTS, HIDDEN, BLOCKS = 256, 4, 64, 8, 4, 512, 4
BF16, FP32 = torch.bfloat16, torch.float32
MIB = 1 << 20


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.weight.dtype)  # as real norms do: computed in the weight's dtype
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x.to(self.weight.dtype), self.normalized_shape, self.weight, self.bias)
        return h.to(x.dtype)


class Gate(nn.Linear):
    """An MoE router: its logits in its weight's dtype, as router code casts them. A module
    called by the block (not a weight read by it), so the workaround can shard it alone: FSDP2
    unshards a group at its module's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp_norm = LayerNorm(DIM)
        self.gate = Gate(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).view(BATCH, SEQ, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(BATCH, SEQ, DIM))
        h = self.mlp_norm(x)
        probs = torch.softmax(self.gate(h), -1).to(h.dtype)
        # Dense mixing (every expert sees every token): same work on every rank and every step.
        return x + sum(probs[..., i : i + 1] * e(h) for i, e in enumerate(self.experts))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def kept(name: str) -> bool:
    return "gate" in name or "norm" in name


def shard(model: Model, config: str, mesh: Any) -> int:
    """Shard ``model`` as ``config`` says; returns how many ``fully_shard`` groups it made."""
    groups = 0
    if config == "override":
        policy: TorchPolicy = tether.fsdp.MixedPrecisionPolicy(
            param_dtype=BF16,
            reduce_dtype=FP32,
            param_dtype_override_fn=tether.fsdp.keep_original_dtype(model, kept),
        )
        shard_fn: Callable[..., Any] = tether.fsdp.fully_shard
    else:
        policy = TorchPolicy(param_dtype=BF16, reduce_dtype=FP32)
        shard_fn = torch_fully_shard
    if config == "workaround":
        # param_dtype=None: no cast of the parameters, nor of the inputs (param_dtype=fp32 would
        # cast the norm's bf16 input to fp32 and its output would stay fp32: not the same model)
        fp32 = TorchPolicy(param_dtype=None, reduce_dtype=FP32)
        small = [m for n, m in model.named_modules() if n and kept(n.rsplit(".", 1)[-1])]
        for module in small:
            torch_fully_shard(module, mesh=mesh, mp_policy=fp32)
        groups += len(small)
    for block in model.blocks:
        shard_fn(block, mesh=mesh, mp_policy=policy)
    shard_fn(model, mesh=mesh, mp_policy=policy)
    return groups + len(model.blocks) + 1


def batches(count: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(count):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(BATCH, SEQ, DIM, generator=generator)
        out.append((x, torch.roll(x, 1, dims=1).tanh()))  # a target the model can learn
    return out


@contextlib.contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """Count FSDP2's collectives (torch's test helpers swap the functions FSDP2 calls)."""
    seen: collections.Counter[str] = collections.Counter()
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def count_all_gather(output: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen["all_gather"] += 1
        seen[f"all_gather_{str(output.dtype).removeprefix('torch.')}"] += 1
        seen["all_gather_bytes"] += output.numel() * output.element_size()
        return all_gather(output, *a, **k)

    def count_reduce_scatter(*a: Any, **k: Any) -> Any:
        seen["reduce_scatter"] += 1
        return reduce_scatter(*a, **k)

    with patch_all_gather(count_all_gather), patch_reduce_scatter(count_reduce_scatter):
        yield seen


def peak_rss_mib() -> float:
    """The process's resident-set high-water mark (``VmHWM``): interpreter, torch and gloo
    included, and sticky (glibc keeps freed memory resident), so only a coarse cross-check."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def peak_alloc_mib(step: Callable[[], None]) -> float:
    """Peak bytes held by torch's CPU allocator during one step, above what it held when the
    step began: the CPU counterpart of ``torch.cuda.max_memory_allocated()`` minus the bytes
    allocated at the start. Every allocation and free (storage ``resize_`` included, which
    FSDP2 uses to free unsharded parameters) is a ``[memory]`` event of the profiler; their
    running sum in time order peaks there. Profiled steps are never timed ones."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / MIB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=("bf16", "override", "workaround"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mem-steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    torch.manual_seed(0)  # the same initial model in every configuration and on every rank
    model = Model()
    groups = shard(model, args.config, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = batches(args.warmup + args.steps + args.mem_steps, args.rank)
    losses: list[float] = []

    def step(i: int) -> None:
        x, target = data[i]
        loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for i in range(args.warmup):
        step(i)
    rss_mib = peak_rss_mib()  # start-up and warm-up steps, which are like the timed ones
    times = []
    timed = range(args.warmup, args.warmup + args.steps)
    with counted() as seen:
        for i in timed:
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
    # The peak (at a backward-prefetch all-gather) moves from one block to another between steps,
    # a block's buffers more or less: the median of a few steps.
    peaks = [peak_alloc_mib(functools.partial(step, timed.stop + i)) for i in range(args.mem_steps)]
    dist.barrier()
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": args.rank,
                "config": args.config,
                "groups": groups,
                "loss0": losses[0],
                "loss_last": losses[timed.stop - 1],
                "times": times,
                "per_step": {k: v / args.steps for k, v in seen.items()},
                "peak_alloc_mib": statistics.median(peaks) if peaks else None,
                "peak_rss_mib": rss_mib,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
