"""torch 2.15's FSDP2 controls through ``tether.fsdp`` in a real gloo job (CPU; world 2 or 4):
tether's backport on torch 2.13/2.14, torch's own classes on 2.15, with the same expectations.

Each stage builds its own models and reports what it saw; the test asserts. Stages: parity of a
bf16 model with fp32 gates/norms against a single-process reference applying the same casts, and
its collective counts against the bf16 policy's; gradient accumulation in every dtype combination;
the "256 + 1 - 256" accumulation; grad_dtype kept across fully_shard, model.to() and
load_state_dict(assign=True), and promoted reductions; manual finalization (sync and async) and
every error it raises; set_keep_unsharded_storage; the override function's errors. With world 4
the numeric stages again and HSDP's refusals, not the world-independent errors. Prints
``RESULT <json>``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import _common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import patch_all_gather, patch_reduce_scatter

from tether._versions import TORCH_FSDP_CONTROLS
from tether.fsdp import (
    GradientReductionHandle,
    MixedPrecisionPolicy,
    fully_shard,
    keep_original_dtype,
    reduce_dtype_none_follows_grad_dtype,
)

BACKPORT = not TORCH_FSDP_CONTROLS
"""``tether.fsdp`` is tether's backport (torch 2.13/2.14), not torch 2.15's own classes: the
stages of tether-only switches and refusals run only then."""

args = _common.parse()
me, world = args.rank, args.world_size
dist.init_process_group("gloo", store=_common.connect(args), rank=me, world_size=world)
mesh = init_device_mesh("cpu", (world,))
BF16, FP32 = torch.bfloat16, torch.float32
DIM = 16
out: dict[str, Any] = {}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.weight.dtype)  # as real norms do: computed in the weight's dtype
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.gate = nn.Linear(DIM, 4, bias=False)  # an MoE router: precision-sensitive
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        route = torch.softmax(F.linear(h.to(self.gate.weight.dtype), self.gate.weight), -1)
        scale = route.max(-1, keepdim=True).values.to(h.dtype)
        return x + self.down(F.gelu(self.up(h))) * scale


class Model(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        # Distinct hidden sizes tell the blocks' reduce-scatters apart.
        self.blocks = nn.ModuleList(Block(16 + 8 * i) for i in range(blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fp32_names(name: str) -> bool:
    return "gate" in name or "norm" in name


def new_model(seed: int = 0, dtype: torch.dtype = FP32) -> Model:
    torch.manual_seed(seed)
    return Model().to(dtype)


def shard(model: nn.Module, policy: Any, shard_fn: Callable[..., Any] = fully_shard) -> Any:
    for block in model.blocks:  # type: ignore[union-attr]
        shard_fn(block, mesh=mesh, mp_policy=policy)
    return shard_fn(model, mesh=mesh, mp_policy=policy)


def batch(step: int, rank: int, dtype: torch.dtype = FP32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, DIM, generator=generator).to(dtype)


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def reference_grads(
    master: dict[str, torch.Tensor], keep: Callable[[str], bool], step: int, cast: torch.dtype
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process reference with FSDP's casts: ``cast`` for every parameter but the kept
    ones, inputs cast at the root; each rank's loss, and the gradients averaged over ranks."""
    model = Model()
    losses, total = [], {name: torch.zeros_like(p) for name, p in master.items()}
    for rank in range(world):
        leaves = {n: p.detach().clone().requires_grad_() for n, p in master.items()}
        params = {n: (p if keep(n) else p.to(cast)) for n, p in leaves.items()}
        output = torch.func.functional_call(model, params, (batch(step, rank).to(cast),))
        loss = loss_of(output)
        loss.backward()
        losses.append(loss.item())
        for name, leaf in leaves.items():
            total[name] += leaf.grad / world
    return losses, total


@contextlib.contextmanager
def counted() -> Iterator[dict[str, list[Any]]]:
    seen: dict[str, list[Any]] = {"all_gather": [], "reduce_scatter": []}
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def count_all_gather(*a: Any, **k: Any) -> Any:
        seen["all_gather"].append(str(a[1].dtype))
        return all_gather(*a, **k)

    def count_reduce_scatter(*a: Any, **k: Any) -> Any:
        seen["reduce_scatter"].append((str(k["input"].dtype), k["input"].numel()))
        return reduce_scatter(*a, **k)

    with patch_all_gather(count_all_gather), patch_reduce_scatter(count_reduce_scatter):
        yield seen


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor()  # type: ignore[attr-defined,no-any-return]


def error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- parity and collective counts ------------------------------------------------------------
def parity(steps: int = 3) -> dict[str, Any]:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model = new_model()
    override = MixedPrecisionPolicy(
        param_dtype=BF16,
        reduce_dtype=FP32,
        param_dtype_override_fn=keep_original_dtype(model, fp32_names),
    )
    baseline = shard(new_model(), policy)
    shard(model, override)
    compute: list[list[str]] = []
    model.blocks[0].up.register_forward_pre_hook(
        lambda m, a: compute.append(
            [str(model.blocks[0].up.weight.dtype), str(model.blocks[0].gate.weight.dtype)]
        )
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    result: dict[str, Any] = {"losses_equal": [], "grad_err": [], "counts": [], "baseline": []}
    for step in range(steps):
        master = {n: full(p).detach() for n, p in model.named_parameters()}
        ref_losses, ref_grads = reference_grads(master, fp32_names, step, BF16)
        with counted() as seen:
            loss = loss_of(model(batch(step, me)))
            loss.backward()
        result["counts"].append(seen)
        with counted() as seen:
            loss_of(baseline(batch(step, me))).backward()
        result["baseline"].append(seen)
        result["losses_equal"].append(loss.item() == ref_losses[me])
        errors = [
            ((full(p.grad) - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
            for n, p in model.named_parameters()
        ]
        result["grad_err"].append(max(errors))
        result["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        optim.step()
        optim.zero_grad()
        baseline.zero_grad()
    result["compute_dtypes"] = compute[0]
    result["groups"] = len(model.blocks)  # the root's group holds the head
    return result


# -- gradient accumulation ---------------------------------------------------------------------
def accumulation(combo: str, micro: int = 3) -> dict[str, Any]:
    """k micro-steps, sync off then on; gradients against the reference's sum."""
    reduce_dtype = FP32 if combo == "bf16+reduce_fp32" else None
    if BACKPORT:  # 2.15 always follows grad_dtype (the switch only refuses False there)
        reduce_dtype_none_follows_grad_dtype(combo == "bf16+follow_grad_dtype")
    model = new_model(1)
    policy = MixedPrecisionPolicy(
        param_dtype=BF16,
        reduce_dtype=reduce_dtype,
        param_dtype_override_fn=keep_original_dtype(model, fp32_names),
    )
    shard(model, policy)
    master = {n: full(p).detach() for n, p in model.named_parameters()}
    expected = {n: torch.zeros_like(p) for n, p in master.items()}
    with counted() as seen:
        for step in range(micro):
            model.set_requires_gradient_sync(step == micro - 1)
            loss_of(model(batch(step, me))).backward()
            expected = {
                n: g + reference_grads(master, fp32_names, step, BF16)[1][n]
                for n, g in expected.items()
            }
    if BACKPORT:
        reduce_dtype_none_follows_grad_dtype(False)
    errors = [
        ((full(p.grad) - expected[n]).abs().max() / expected[n].abs().max()).item()
        for n, p in model.named_parameters()
    ]
    return {
        "err": max(errors),
        "reduce_dtypes": sorted({d for d, _ in seen["reduce_scatter"]}),
        "reduce_scatters": len(seen["reduce_scatter"]),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
    }


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(world * 2, dtype=BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def accumulate_256(shard_fn: Callable[..., Any]) -> list[float]:
    """bf16 parameter, fp32 grad_dtype, gradients 256, 1, -256 over three micro-steps: fp32
    accumulation gives 1; bf16 would give 0 (256 + 1 rounds to 256)."""
    model = Scale()
    model.weight.grad_dtype = FP32
    shard_fn(model, mesh=mesh)
    for step, value in enumerate((256.0, 1.0, -256.0)):
        model.set_requires_gradient_sync(step == 2)
        model(torch.full((world * 2,), value, dtype=BF16)).backward()
    return full(model.weight.grad).float().tolist()  # type: ignore[no-any-return]


# -- grad_dtype kept; mixed gradient dtypes promote ----------------------------------------------
def grad_dtype_kept() -> dict[str, Any]:
    result: dict[str, Any] = {}
    torch_model = new_model(2, BF16)
    torch_model.blocks[0].gate.weight.grad_dtype = FP32
    shard(torch_model, MixedPrecisionPolicy(), torch_fully_shard)
    result["torch_after_fully_shard"] = str(torch_model.blocks[0].gate.weight.grad_dtype)

    model = new_model(2, BF16)
    model.blocks[0].gate.weight.grad_dtype = FP32
    shard(model, MixedPrecisionPolicy())
    master = {n: full(p).detach() for n, p in model.named_parameters()}
    gate = "blocks.0.gate.weight"
    result["after_fully_shard"] = str(model.blocks[0].gate.weight.grad_dtype)
    with counted() as seen:
        loss_of(model(batch(0, me, BF16))).backward()
    result["reduce_dtypes"] = sorted({d for d, _ in seen["reduce_scatter"]})
    result["reduce_scatters"] = len(seen["reduce_scatter"])
    result["shard_grad_dtypes"] = {
        n: str(p.grad.dtype) for n, p in model.named_parameters() if n in (gate, "head.weight")
    }
    _, expected = reference_grads(master, lambda n: True, 0, BF16)
    result["gate_err"] = (
        (full(model.blocks[0].gate.weight.grad) - expected[gate]).abs().max()
        / expected[gate].abs().max()
    ).item()
    model.to(torch.float16)
    gate_param = model.blocks[0].gate.weight
    result["after_to"] = [str(t) for t in (gate_param.dtype, gate_param.grad_dtype)] + [
        str(gate_param.grad.dtype)
    ]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    result["after_assign"] = str(model.blocks[0].gate.weight.grad_dtype)
    result["others_after_to"] = str(model.blocks[0].up.weight.grad_dtype)
    return result


def policy_edges() -> dict[str, Any]:
    """A grad_dtype set after fully_shard (before the first forward); CPU offload with one
    gradient dtype; with the backport also the reduce_dtype=None switch turned after the first
    unshard, CPU offload with two gradient dtypes (refused) and torch's and tether's fully_shard
    mixed in one model."""
    result: dict[str, Any] = {}
    model = new_model(11, BF16)
    shard(model, MixedPrecisionPolicy())
    model.blocks[0].gate.weight.grad_dtype = FP32  # on the sharded parameter
    loss_of(model(batch(0, me, BF16))).backward()
    result["set_after_fully_shard"] = str(model.blocks[0].gate.weight.grad.dtype)

    offload = torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=False)
    model = Scale()
    model.weight.grad_dtype = FP32
    fully_shard(model, mesh=mesh, offload_policy=offload)
    model(torch.ones(world * 2, dtype=BF16)).backward()
    result["offload_one_dtype"] = str(model.weight.grad.dtype)
    if BACKPORT:
        result.update(backport_edges(offload))
    return result


def backport_edges(offload: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    model = new_model(12)
    shard(model, MixedPrecisionPolicy(param_dtype=BF16))
    model.set_requires_gradient_sync(False)
    loss_of(model(batch(0, me))).backward()
    reduce_dtype_none_follows_grad_dtype(True)  # too late for this model: its leaves exist
    with counted() as seen:
        model.set_requires_gradient_sync(True)
        result["toggled"] = error_of(lambda: loss_of(model(batch(1, me))).backward())
    reduce_dtype_none_follows_grad_dtype(False)
    result["toggled_reduce_dtypes"] = sorted({d for d, _ in seen["reduce_scatter"]})

    model = new_model(13, BF16)
    model.blocks[0].gate.weight.grad_dtype = FP32
    shard_offload = lambda m, **k: fully_shard(m, offload_policy=offload, **k)  # noqa: E731
    shard(model, MixedPrecisionPolicy(), shard_offload)
    result["offload_mixed"] = error_of(lambda: model(batch(0, me, BF16)))

    model = new_model(14)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result["mixed_twice"] = [error_of(lambda: model(batch(0, me))) for _ in range(2)]
    return result


def unused_param_error() -> str:
    model = new_model(3, BF16)
    for block in model.blocks:
        block.up.bias.grad_dtype = None  # explicit: any dtype
    shard(model, MixedPrecisionPolicy())
    model.set_reduce_scatter_unused_params(True)
    return error_of(lambda: loss_of(model(batch(0, me, BF16))).backward())


def override_errors() -> dict[str, Any]:
    calls: list[str] = []

    def counting(param: nn.Parameter) -> torch.dtype | None:
        calls.append(str(param.dtype))
        return None

    model = new_model(4)
    shard(model, MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=counting))
    return {
        "calls": len(calls),
        "params": sum(1 for _ in model.parameters()),
        "not_a_dtype": error_of(
            lambda: fully_shard(
                new_model(4),
                mesh=mesh,
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=BF16, param_dtype_override_fn=lambda p: "float32"
                ),
            )
        ),
        "other_dtype": error_of(
            lambda: fully_shard(
                new_model(4),
                mesh=mesh,
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=BF16, param_dtype_override_fn=lambda p: torch.float16
                ),
            )
        ),
    }


# -- manual finalization -----------------------------------------------------------------------
def manual_vs_automatic(async_op: bool, micro: int = 2) -> dict[str, Any]:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    automatic, manual = shard(new_model(5), policy), shard(new_model(5), policy)
    for step in range(micro):
        automatic.set_requires_gradient_sync(step == micro - 1)
        loss_of(automatic(batch(step, me))).backward()
    manual.set_manual_backward_finalization(True)
    manual.set_requires_gradient_sync(False)
    with counted() as during:
        for step in range(micro):
            loss_of(manual(batch(step, me))).backward()
    manual.set_requires_gradient_sync(True)
    with counted() as finalizing:
        handle = manual.finalize_backward(async_op=async_op)
        is_handle = isinstance(handle, GradientReductionHandle)
        # 2.15 returns a private implementation of the public class
        returned = "GradientReductionHandle" if is_handle else type(handle).__name__
        if is_handle:
            handle.wait()
    same = all(
        torch.equal(full(a.grad), full(m.grad))
        for a, m in zip(automatic.parameters(), manual.parameters(), strict=True)
    )
    # A second accumulation step in the same mode, then back to automatic.
    loss_of(manual(batch(9, me))).backward()
    manual.finalize_backward()
    manual.set_manual_backward_finalization(False)
    loss_of(manual(batch(9, me))).backward()
    return {
        "equal": same,
        "returned": returned,
        "reduce_scatters_in_backward": len(during["reduce_scatter"]),
        "finalize_order": [n for _, n in finalizing["reduce_scatter"]],
        "group_numels": [
            sum(p.numel() for p in block.parameters()) for block in new_model(5).blocks
        ]
        + [sum(p.numel() for p in new_model(5).head.parameters())],
    }


def manual_errors() -> dict[str, str]:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    errors: dict[str, str] = {}
    model = shard(new_model(6), policy)
    errors["before_forward"] = str(model.finalize_backward()) + str(
        model.finalize_backward(async_op=True).wait()
    )
    loss_of(model(batch(0, me))).backward()
    errors["not_manual"] = error_of(model.finalize_backward)
    errors["non_root_finalize"] = error_of(model.blocks[0].finalize_backward)
    block = model.blocks[0]
    errors["non_root_set"] = error_of(lambda: block.set_manual_backward_finalization(True))
    model.set_manual_backward_finalization(True)
    loss = loss_of(model(batch(1, me)))
    loss.register_hook(lambda g: model.set_manual_backward_finalization(False))
    errors["during_backward"] = error_of(loss.backward)
    model.reset_iter_state()

    model = shard(new_model(6), policy)
    model.set_manual_backward_finalization(True)
    x = batch(1, me).requires_grad_()
    # The input's gradient comes last, after every pre-backward queued FSDP's final callback.
    x.register_hook(lambda g: model.finalize_backward())
    errors["finalize_in_backward"] = error_of(loss_of(model(x)).backward)
    model.reset_iter_state()
    loss_of(model(batch(1, me))).backward()
    turn_off = lambda: model.set_manual_backward_finalization(False)  # noqa: E731
    errors["after_backward_starts"] = error_of(turn_off)
    handle = model.finalize_backward(async_op=True)
    errors["twice"] = error_of(model.finalize_backward)
    handle.wait()
    loss_of(model(batch(2, me))).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    errors["invalidated"] = error_of(handle.wait)

    late = new_model(6)
    shard(late, policy)
    late.blocks[0].set_manual_backward_finalization(True)  # not yet known to be a non-root
    errors["non_root_at_lazy_init"] = error_of(lambda: late(batch(0, me)))

    first, second = shard(new_model(7), policy), shard(new_model(8), policy)
    torch.distributed.fsdp.share_comm_ctx([first, second])
    for root in (first, second):
        root.set_manual_backward_finalization(True)
        loss_of(root(batch(3, me))).backward()
        root.finalize_backward()
    loss_of(first(batch(4, me))).backward()
    handle = first.finalize_backward(async_op=True)
    errors["forward_pending"] = error_of(lambda: second(batch(4, me)))
    errors["shared_pending"] = error_of(second.finalize_backward)
    handle.wait()
    for root in (first, second):
        loss_of(root(batch(5, me))).backward()
    errors["shared_overlap"] = error_of(lambda: first.finalize_backward(async_op=True))
    second.finalize_backward()
    first.finalize_backward(async_op=True).wait()
    return errors


def keep_storage() -> dict[str, Any]:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model = shard(new_model(9), policy)
    model.set_keep_unsharded_storage(True)
    group = torch_fully_shard.state(model.blocks[0])._fsdp_param_groups[0]
    pointers, sizes = [], []
    for step in range(3):
        loss_of(model(batch(step, me))).backward()
        output = group.fsdp_params[0].all_gather_outputs[0]
        pointers.append(output.data_ptr())
        sizes.append(output.untyped_storage().size())
    model.set_keep_unsharded_storage(False)
    loss_of(model(batch(3, me))).backward()
    freed = group.fsdp_params[0].all_gather_outputs[0].untyped_storage().size()
    return {"pointers_equal": len(set(pointers)) == 1, "kept_sizes": sizes, "freed": freed}


def hsdp_errors() -> dict[str, str]:
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model = new_model(10)
    for block in model.blocks:
        fully_shard(block, mesh=mesh2, mp_policy=policy)
    fully_shard(model, mesh=mesh2, mp_policy=policy)
    errors: dict[str, str] = {}
    model.set_manual_backward_finalization(True)
    model.set_requires_all_reduce(False)
    loss_of(model(batch(0, me))).backward()
    errors["no_all_reduce"] = error_of(model.finalize_backward)
    model.reset_iter_state()
    model.set_manual_backward_finalization(False)
    loss_of(model(batch(1, me))).backward()  # automatic: a partial (reduce-scattered) output
    model.set_manual_backward_finalization(True)
    model.set_requires_all_reduce(True)
    loss_of(model(batch(2, me))).backward()
    errors["partial"] = error_of(model.finalize_backward)
    return errors


out["parity"] = parity()
for combo in ("bf16+reduce_fp32", "bf16+legacy", "bf16+follow_grad_dtype"):
    if BACKPORT or combo != "bf16+legacy":  # 2.13/2.14's reduce_dtype=None: the backport's switch
        out[f"accumulate {combo}"] = accumulation(combo)
out["256_tether"] = accumulate_256(fully_shard)
out["256_torch"] = accumulate_256(torch_fully_shard)
out["grad_dtype"] = grad_dtype_kept()
out["manual_sync"] = manual_vs_automatic(async_op=False)
out["manual_async"] = manual_vs_automatic(async_op=True)
if world == 4:  # 4 processes on 2 cores: what needs 4 ranks, and numerics again
    out["hsdp"] = hsdp_errors()
else:  # errors and bookkeeping, which do not depend on the world size
    out["unused"] = unused_param_error()
    out["edges"] = policy_edges()
    out["override"] = override_errors()
    out["manual_errors"] = manual_errors()
    out["keep_storage"] = keep_storage()
dist.barrier()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
