"""PP(2) x FSDP(2) through ``tether.pipelining`` and ``tether.fsdp`` in a real gloo job (world 4).

Mesh (pp, dp) = (2, 2): pipeline ranks {0, 2} and {1, 3}, each holding stages pp_rank,
pp_rank + 2 and pp_rank + 4 of six; every stage module is ``tether.fsdp.fully_shard`` over its
dp pair. Each case trains two steps; each rank reports the relative error of its gradients
(whole, gathered from the shards) and losses against a single-process reference of the same
data, the order in which its stages computed, started and waited their gradient reductions, and
the FSDP state between steps. Prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
from typing import Any

import _common
import torch
import torch.distributed as dist
from _pipeline_model import DIM, copy_layer, layers, loss_fn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tether.pipelining as tpp
from tether.fsdp import fully_shard

args = _common.parse()
me, world = args.rank, args.world_size
dist.init_process_group("gloo", store=_common.connect(args), rank=me, world_size=world)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
MB_ROWS, N_MB, STEPS, N_STAGES = 2, 4, 2, 6
LAYERS = layers(N_STAGES)
X = torch.randn(STEPS, 2, N_MB * MB_ROWS, DIM)  # [step, dp rank]
Y = torch.randn(STEPS, 2, N_MB * MB_ROWS, DIM)


def reference(steps_per_update: int) -> dict[str, Any]:
    """The whole model in one process: per-microbatch losses of each dp rank's data, and the
    gradients FSDP's mean over dp gives after each update (``steps_per_update`` steps accumulate,
    divided by the number of microbatches once)."""
    model = nn.Sequential(*[copy_layer(layer) for layer in LAYERS])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[list[list[float]]] = []
    grads = []
    for step in range(STEPS):
        step_losses = []
        for dp in range(2):
            mb_losses = [
                loss_fn(model(x), y)
                for x, y in zip(X[step, dp].chunk(N_MB), Y[step, dp].chunk(N_MB), strict=True)
            ]
            (sum(mb_losses) / N_MB / 2).backward()  # type: ignore[operator]
            step_losses.append([float(v.detach()) for v in mb_losses])
        losses.append(step_losses)
        if (step + 1) % steps_per_update == 0:
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "grads": grads}


def run(name: str, steps_per_update: int, **controls: Any) -> dict[str, Any]:
    ref = reference(steps_per_update)
    stages, modules = [], {}
    events: list[list[str]] = []  # each step's
    for index in range(pp_rank, N_STAGES, 2):
        module = fully_shard(copy_layer(LAYERS[index]), mesh=mesh["dp"])
        modules[index] = module
        stage = tpp.PipelineStage(
            module, index, N_STAGES, torch.device("cpu"), group=mesh.get_group("pp")
        )
        _trace(stage, events)
        stages.append(stage)
    schedule = getattr(tpp, name)(stages, N_MB, loss_fn=loss_fn, **controls)
    params = [p for index in sorted(modules) for p in modules[index].parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    is_first, is_last = pp_rank == 0, pp_rank == 1
    loss_err, grad_err, between = 0.0, 0.0, []
    update = 0
    for step in range(STEPS):
        finalize = (step + 1) % steps_per_update == 0
        losses: list[torch.Tensor] = []
        x_mbs = [(x,) for x in X[step, dp_rank].chunk(N_MB)]
        y_mbs = list(Y[step, dp_rank].chunk(N_MB))
        kwargs: dict[str, Any] = {"finalize_gradients": finalize}
        events.append([])
        if is_last:
            kwargs.update(target_mbs=y_mbs, losses=losses)
        if is_first:
            kwargs.update(arg_mbs=x_mbs)
        schedule.step(**kwargs)
        if is_last:
            for v, r in zip(losses, ref["losses"][step][dp_rank], strict=True):
                loss_err = max(loss_err, abs(float(v) - r) / abs(r))
        groups = [m._get_fsdp_state()._fsdp_param_group for m in modules.values()]
        between.append(
            {
                "finalize": finalize,
                "unsharded": [g.is_unsharded for g in groups],
                # The optimizer's (sharded) gradients: none until a step reduces them.
                "grads_none": [
                    all(p.sharded_param.grad is None for p in g.fsdp_params) for g in groups
                ],
            }
        )
        if not finalize:
            continue
        for index, module in modules.items():
            for j, p in enumerate(module.parameters()):
                expected = ref["grads"][update][index * 2 + j]
                whole = p.grad.full_tensor()  # type: ignore[union-attr]
                grad_err = max(
                    grad_err, float((whole - expected).abs().max() / expected.abs().max())
                )
        opt.step()
        opt.zero_grad()
        update += 1
    order = schedule.pipeline_order_with_comms[dist.get_rank(mesh.get_group("pp"))]
    return {
        "name": name,
        "controls": controls,
        "steps_per_update": steps_per_update,
        "loss_rel_err": loss_err if is_last else None,
        "grad_rel_err": grad_err,
        "events": events,
        "between_steps": between,
        "actions": [str(a) for a in order],
    }


def _trace(stage: Any, events: list[list[str]]) -> None:
    """Record, in the running step's list, when each stage's gradient reduction starts and is
    waited (at its FSDP root, where every implementation reduces: ``finalize_backward`` and the
    handle it returns) and when the stage runs its backward computations."""
    module, backward = stage.submod, stage.backward_one_chunk
    finalize = module.finalize_backward

    def traced_backward(mb: int, *args: Any, **kwargs: Any) -> None:
        events[-1].append(f"backward{stage.stage_index}")
        backward(mb, *args, **kwargs)

    class Handle:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def wait(self) -> None:
            events[-1].append(f"wait{stage.stage_index}")
            self.handle.wait()

    def traced_finalize(async_op: bool = False) -> Any:
        events[-1].append(f"start{stage.stage_index}")
        handle = finalize(async_op=async_op)
        if handle is None:  # synchronous: waited already
            events[-1].append(f"wait{stage.stage_index}")
            return None
        return Handle(handle)

    module.finalize_backward = traced_finalize
    stage.backward_one_chunk = traced_backward


CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("ScheduleInterleaved1F1B", 1, {}),
    (
        "ScheduleInterleaved1F1B",
        1,
        {"unshard_lookahead": "auto", "defer_reduce_grad_wait": True, "max_outstanding_sends": 2},
    ),
    ("ScheduleInterleaved1F1B", 2, {"unshard_lookahead": "auto", "defer_reduce_grad_wait": True}),
    ("ScheduleLoopedBFS", 1, {"max_active_stages": 1, "defer_reduce_grad_wait": True}),
]
results = [run(name, per_update, **controls) for name, per_update, controls in CASES]
dist.barrier()
local = list(range(pp_rank, N_STAGES, 2))
print(
    "RESULT " + json.dumps({"rank": me, "pp_rank": pp_rank, "stages": local, "cases": results}),
    flush=True,
)
dist.destroy_process_group()
