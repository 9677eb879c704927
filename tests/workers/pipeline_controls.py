"""torch 2.15's pipeline controls through ``tether.pipelining`` in a real gloo job (CPU, world 2).

Every schedule, with torch's own classes and ``tether.pipelining``'s (tether's backport before
torch 2.15, torch's own classes on 2.15) under each control, trains the same model for two steps;
each rank reports its losses, its stages' gradients and what it held (receive buffers, pending
sends, forward outputs: ``_pipeline_probe``, alike for every implementation; tether's own count
beside it where tether runs the stages), and the test compares them with a single-process
reference computed here. Some cases wrap the stage modules in DDP (over a one-rank group: 2.15
never releases their outputs) or pass pre-split microbatches to ``step``.
Prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
from typing import Any

import _common
import _pipeline_probe
import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
from _pipeline_model import DIM, copy_layer, layers, loss_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tether.pipelining as tpp

args = _common.parse()
me, world = args.rank, args.world_size
dist.init_process_group("gloo", store=_common.connect(args), rank=me, world_size=world)
MB_ROWS, N_MB, STEPS = 2, 8, 2
LAYERS = layers(2 * world)
SOLO = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
X = torch.randn(STEPS, N_MB * MB_ROWS, DIM)
Y = torch.randn(STEPS, N_MB * MB_ROWS, DIM)


def reference() -> dict[str, Any]:
    """One process, the whole model: per-microbatch losses and the scaled gradients (the
    schedules divide by the number of microbatches)."""
    model = nn.Sequential(*[copy_layer(layer) for layer in LAYERS])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        mb_losses = [
            loss_fn(model(x), y)
            for x, y in zip(X[step].chunk(N_MB), Y[step].chunk(N_MB), strict=True)
        ]
        (sum(mb_losses) / N_MB).backward()  # type: ignore[operator]
        losses.append([float(v.detach()) for v in mb_losses])
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
    return {"losses": losses, "grads": grads}


def stage_indices(kind: str, n_stages: int) -> list[int]:
    if kind == "single":
        return [me]
    if kind == "v":  # rank 0 holds 0 and 3, rank 1 holds 1 and 2
        return [me, n_stages - 1 - me]
    return list(range(me, n_stages, world))


def run(
    name: str,
    cls: Any,
    stage_cls: Any,
    kind: str,
    *,
    ddp: bool = False,
    presplit: bool = False,
    **controls: Any,
) -> dict[str, Any]:
    n_stages = world if kind == "single" else 2 * world
    per_stage = len(LAYERS) // n_stages
    stages, modules = [], {}
    for index in stage_indices(kind, n_stages):
        module = nn.Sequential(
            *[copy_layer(layer) for layer in LAYERS[index * per_stage : (index + 1) * per_stage]]
        )
        modules[index] = module
        submod = DistributedDataParallel(module, process_group=SOLO[me]) if ddp else module
        stages.append(stage_cls(submod, index, n_stages, torch.device("cpu")))
    schedule = cls(stages[0] if kind == "single" else stages, N_MB, loss_fn=loss_fn, **controls)
    params = [p for index in sorted(modules) for p in modules[index].parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    probe = _pipeline_probe.watch(stages)
    losses_ok, grad_err, held, sends, outputs, counted = [], 0.0, [], [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        probe.reset()
        if presplit:  # the same microbatches, split here
            if is_last:
                kwargs.update(target_mbs=list(Y[step].chunk(N_MB)), losses=losses)
            if is_first:
                kwargs.update(arg_mbs=[(x,) for x in X[step].chunk(N_MB)])
            schedule.step(**kwargs)
        else:
            if is_last:
                kwargs.update(target=Y[step], losses=losses)
            if is_first:
                schedule.step(X[step], **kwargs)
            else:
                schedule.step(**kwargs)
        if is_last:
            losses_ok.append(
                max(
                    abs(float(v) - r) / abs(r)
                    for v, r in zip(losses, REF["losses"][step], strict=True)
                )
            )
        for index, module in modules.items():
            for j, p in enumerate(module.parameters()):
                expected = REF["grads"][step][index * per_stage * 2 + j]
                grad_err = max(
                    grad_err, float((p.grad - expected).abs().max() / expected.abs().max())
                )
        held.append(probe.recv_peak)
        sends.append(probe.sends_peak)
        outputs.append(probe.outputs_peak)
        stats = tpp.memory_stats(schedule)  # tether's own count, where tether runs the stages
        if stats is not None:
            counted.append([stats.recv_buffers_peak, stats.fwd_outputs_peak])
            if stats.pending_sends_peak is not None:
                counted[-1].append(stats.pending_sends_peak)
        opt.step()
    order = getattr(schedule, "pipeline_order_with_comms", None)
    return {
        "name": name,
        "loss_rel_err": max(losses_ok) if losses_ok else None,
        "grad_rel_err": grad_err,
        "recv_buffers_peak": held,
        "pending_sends_peak": sends,
        "fwd_outputs_peak": outputs,
        "counted_by_tether": counted,
        "n_stages": n_stages,
        "actions": None if order is None else [str(a) for a in order[me]],
        "n_local_stages": len(stages),
    }


REF = reference()
CASES: list[tuple[str, str, str, dict[str, Any]]] = [  # options: run()'s keywords
    ("ScheduleGPipe", "single", "torch", {}),
    ("ScheduleGPipe", "single", "tether", {}),
    ("Schedule1F1B", "single", "torch", {}),
    ("Schedule1F1B", "single", "tether", {}),
]
for name, kind in (
    ("ScheduleInterleaved1F1B", "loop"),
    ("ScheduleLoopedBFS", "loop"),
    ("ScheduleInterleavedZeroBubble", "loop"),
    ("ScheduleZBVZeroBubble", "v"),
    ("ScheduleDualPipeV", "v"),
):
    CASES.append((name, kind, "torch", {}))
    CASES.append((name, kind, "tether", {}))
    CASES.append((name, kind, "tether", {"max_outstanding_sends": 1}))
    CASES.append(
        (name, kind, "tether", {"max_outstanding_sends": 2, "defer_reduce_grad_wait": True})
    )
CASES += [
    (
        "ScheduleInterleaved1F1B",
        "loop",
        "tether",
        {"defer_pp_recv": True, "max_outstanding_sends": 2},
    ),
    ("ScheduleInterleaved1F1B", "loop", "tether", {"max_outstanding_sends": 1, "ddp": True}),
    ("ScheduleInterleaved1F1B", "loop", "tether", {"max_outstanding_sends": 1, "presplit": True}),
    ("Schedule1F1B", "single", "tether", {"presplit": True}),
]

results = []
for name, kind, which, controls in CASES:
    cls = getattr(torch_pp if which == "torch" else tpp, name)
    stage_cls = torch_pp.PipelineStage if which == "torch" else tpp.PipelineStage
    result = run(name, cls, stage_cls, kind, **controls)
    result.update(which=which, controls=controls)
    results.append(result)
dist.barrier()
print(
    "RESULT " + json.dumps({"rank": me, "world": world, "n_mb": N_MB, "cases": results}), flush=True
)
dist.destroy_process_group()
