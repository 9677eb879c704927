"""Four pipeline ranks (eight stages) through ``tether.pipelining``, recorded by tether, with
per-edge P2P groups where the test's environment has ``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P=1``.

Interleaved1F1B (stages r and r + 4 on rank r), ZBVZeroBubble (r and 7 - r) and 1F1B (four
stages of two layers, stage r on rank r) train two steps each against a single-process
reference; then every rank dumps, and reports the groups its dump names (an edge's group by its
edge: tether's are named for it, torch 2.15's by their split round, their members in edge order),
the point-to-point entries recorded on each, the transfers its schedules make over each edge
("a->b", global ranks), and the most forward outputs its 1F1B stage held (``_pipeline_probe``).
Prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import _common
import _pipeline_probe
import torch
import torch.distributed as dist
from _pipeline_model import DIM, copy_layer, layers, loss_fn
from torch import nn

import tether
import tether.pipelining as tpp

args = _common.parse()
me, world = args.rank, args.world_size
_common.init_recorded(args)
MB_ROWS, N_MB, STEPS, N_STAGES = 2, 8, 2, 2 * world
LAYERS = layers(N_STAGES)
X = torch.randn(STEPS, N_MB * MB_ROWS, DIM)
Y = torch.randn(STEPS, N_MB * MB_ROWS, DIM)


def reference() -> list[list[torch.Tensor]]:
    model = nn.Sequential(*[copy_layer(layer) for layer in LAYERS])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        mb = zip(X[step].chunk(N_MB), Y[step].chunk(N_MB), strict=True)
        (sum(loss_fn(model(x), y) for x, y in mb) / N_MB).backward()  # type: ignore[union-attr]
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
    return grads


PLANNED: Counter[str] = Counter()
"""Sends and receives the lowered schedules make over each edge, all steps."""


def plan(schedule: Any) -> None:
    to_rank = schedule.stage_index_to_group_rank
    for action in schedule.pipeline_order_with_comms[me]:
        kind, stage = str(action.computation_type.value), action.stage_index
        peer = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}.get(kind)
        if peer is not None:
            other = to_rank[stage + peer]
            edge = (me, other) if kind.startswith("SEND") else (other, me)
            PLANNED[f"{edge[0]}->{edge[1]}"] += STEPS


def run(
    name: str, indices: list[int], ref: list[list[torch.Tensor]], per_stage: int = 1
) -> tuple[float, int]:
    """Train stages ``indices`` of ``N_STAGES // per_stage`` (``per_stage`` layers each)."""
    n_stages = N_STAGES // per_stage
    modules = {
        i: nn.Sequential(*[copy_layer(LAYERS[i * per_stage + k]) for k in range(per_stage)])
        for i in indices
    }
    stages = [tpp.PipelineStage(modules[i], i, n_stages, torch.device("cpu")) for i in indices]
    if per_stage == 1:
        schedule = getattr(tpp, name)(stages, N_MB, loss_fn=loss_fn, max_outstanding_sends=2)
        plan(schedule)
    else:  # 1F1B, stage me: n forward sends to me + 1, n gradients from it; the reverse for me - 1
        schedule = getattr(tpp, name)(stages[0], N_MB, loss_fn=loss_fn)
        for peer in (me - 1, me + 1):
            if 0 <= peer < n_stages:
                PLANNED[f"{me}->{peer}"] += N_MB * STEPS
                PLANNED[f"{peer}->{me}"] += N_MB * STEPS
    opt = torch.optim.SGD([p for i in indices for p in modules[i].parameters()], lr=0.05)
    probe = _pipeline_probe.watch(stages)
    err, held = 0.0, 0
    for step in range(STEPS):
        opt.zero_grad()
        probe.reset()
        kwargs: dict[str, Any] = {"target": Y[step]} if n_stages - 1 in indices else {}
        if 0 in indices:
            schedule.step(X[step], **kwargs)
        else:
            schedule.step(**kwargs)
        for i in indices:
            for j, p in enumerate(modules[i].parameters()):
                expected = ref[step][2 * per_stage * i + j]
                err = max(err, float((p.grad - expected).abs().max() / expected.abs().max()))
        held = max(held, probe.outputs_peak)
        opt.step()
    return err, held


REF = reference()
runs = {
    "ScheduleInterleaved1F1B": run("ScheduleInterleaved1F1B", [me, me + world], REF),
    "ScheduleZBVZeroBubble": run("ScheduleZBVZeroBubble", [me, N_STAGES - 1 - me], REF),
    "Schedule1F1B": run("Schedule1F1B", [me], REF, per_stage=2),
}
dump = tether.load_dump(tether.dump(reason="edges"))


def edge_of(config: dict[str, Any]) -> str | None:
    desc = config["desc"]
    if desc.startswith("pipeline_p2p:"):  # tether's
        return str(desc.removeprefix("pipeline_p2p:"))
    if desc.startswith("pp_p2p_round_"):  # torch 2.15's: [source, destination]
        source, destination = json.loads(config["ranks"])
        return f"{source}->{destination}"
    return None


edges = {name: edge_of(cfg) for name, cfg in dump["pg_config"].items()}
# The schedules' transfers (an activation or a gradient: one microbatch's rows, float), apart from
# set-up traffic (warm-ups, 2.15's shape inference over the edge groups).
payload, setup = Counter(), Counter()
for e in dump["entries"]:
    if e["is_p2p"]:
        where = edges[e["process_group"][0]] or e["process_group"][1]
        moves = e["input_sizes"] == [[MB_ROWS, DIM]] and e["input_dtypes"] == ["Float"]
        (payload if moves else setup)[where] += 1
dist.barrier()
print(
    "RESULT "
    + json.dumps(
        {
            "rank": me,
            "world": world,
            "per_edge": tpp.config.pipeline_per_edge_p2p,
            "grad_rel_err": {name: err for name, (err, _) in runs.items()},
            "fwd_outputs_peak_1f1b": runs["Schedule1F1B"][1],
            "edge_groups": sorted(e for e in edges.values() if e is not None),
            "edge_descs": sorted(
                cfg["desc"] for name, cfg in dump["pg_config"].items() if edges[name] is not None
            ),
            "other_groups": sorted(
                cfg["desc"] for name, cfg in dump["pg_config"].items() if edges[name] is None
            ),
            "p2p_entries": dict(payload),
            "setup_entries": dict(setup),
            "planned": dict(PLANNED),
        }
    ),
    flush=True,
)
dist.destroy_process_group()
