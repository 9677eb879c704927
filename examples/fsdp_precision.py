"""A small transformer block trained with FSDP2 in bf16, its router gate and norms kept in fp32
with one line: torch 2.15's ``param_dtype_override_fn`` through ``tether.fsdp`` (torch's own
objects on 2.15+, tether's backport on 2.13/2.14).

    torchrun --standalone --nproc-per-node 2 examples/fsdp_precision.py   # or: tether run ...

Each rank prints the dtypes its block computes in and the loss of every step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tether.fsdp import MixedPrecisionPolicy, fully_shard, keep_original_dtype

DIM, HEADS, EXPERTS = 32, 4, 4


class Block(nn.Module):
    """Pre-norm attention, then a mixture of experts routed by an fp32 gate."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ffn_norm = nn.LayerNorm(DIM)
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._norm(self.attn_norm, x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self._norm(self.ffn_norm, x)
        # The router in fp32, as MoE code does: small logit differences pick the experts.
        probs = torch.softmax(F.linear(h.to(self.gate.weight.dtype), self.gate.weight), -1)
        mixed = sum(
            probs[..., i : i + 1].to(h.dtype) * expert(h) for i, expert in enumerate(self.experts)
        )
        return x + mixed

    @staticmethod
    def _norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.to(norm.weight.dtype), (DIM,), norm.weight, norm.bias).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(DIM, 1))

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        # The one line: parameters named like a norm or the router stay in fp32.
        param_dtype_override_fn=keep_original_dtype(model, lambda n: "norm" in n or "gate" in n),
    )
    for block in model[:2]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    block = model[0]

    def report(module: nn.Module, inputs: object) -> None:  # inside the forward: unsharded
        print(
            f"rank {rank} computes experts in {block.experts[0].weight.dtype}, the gate in "
            f"{block.gate.weight.dtype}, norms in {block.attn_norm.weight.dtype}",
            flush=True,
        )
        once.remove()

    once = block.experts[0].register_forward_pre_hook(report)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(16, 8, DIM, generator=generator)
    targets = inputs.sum(-1, keepdim=True).tanh()
    for step in range(args.steps):
        loss = F.mse_loss(model(inputs).float(), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
