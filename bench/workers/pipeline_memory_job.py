"""One rank of bench/pipeline_memory.py: a 4-stage MLP pipeline (one stage per rank, or two for
Interleaved1F1B), 16 microbatches, under torch's own classes or tether's; prints ``RESULT <json>``
with the step time and what the rank held."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
from torch import nn

N_MB, MB_ROWS, DIM = 16, 32, 512


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--steps", "--warmup"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--config", required=True)  # torch[-again] | tether[-k2 | -edges]
    args = parser.parse_args()
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)
    me, world = args.rank, args.world_size
    plain = args.config.startswith("torch")
    if plain:
        pp: Any = torch_pp
    else:
        import tether.pipelining as pp

        pp.config.pipeline_per_edge_p2p = args.config == "tether-edges"
    interleaved = args.schedule == "Interleaved1F1B"
    n_stages = 2 * world if interleaved else world
    torch.manual_seed(0)
    stages = []
    for index in range(me, n_stages, world) if interleaved else [me]:
        module = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())
        stages.append(pp.PipelineStage(module, index, n_stages, torch.device("cpu")))
    controls = {"max_outstanding_sends": 2} if args.config == "tether-k2" else {}
    cls = getattr(pp, f"Schedule{args.schedule}")
    schedule = cls(stages if interleaved else stages[0], N_MB, loss_fn=_loss, **controls)
    x = torch.randn(N_MB * MB_ROWS, DIM)
    y = torch.randn(N_MB * MB_ROWS, DIM)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    times = []
    for step in range(args.warmup + args.steps):
        kwargs: dict[str, Any] = {"target": y} if last else {}
        dist.barrier()
        start = time.perf_counter()
        schedule.step(x, **kwargs) if first else schedule.step(**kwargs)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    stats = None if plain else pp.memory_stats(schedule)
    if stats is not None:
        recv, recv_bytes = stats.recv_buffers_peak, stats.recv_bytes_peak
        sends, send_bytes = stats.pending_sends_peak, stats.pending_send_bytes_peak
        outputs = stats.fwd_outputs_peak
    else:  # torch keeps every buffer it allocated, and (runtime schedules) every send to the end
        held = [
            info.buffer
            for s in stages
            for infos in (*s.args_recv_info.values(), *getattr(s, "grad_recv_info", {}).values())
            for info in infos
            if not info.is_root_arg and info.buffer is not None
        ]
        recv, recv_bytes = len(held), sum(t.numel() * t.element_size() for t in held)
        outputs = None  # torch counts nothing: its stages hold each output to its backward
        order = getattr(schedule, "pipeline_order_with_comms", None)
        sends = None
        send_bytes = None
        if order is not None:
            sends = sum(1 for a in order[me] if str(a.computation_type.value).startswith("SEND"))
            send_bytes = sends * MB_ROWS * DIM * 4
    result = {
        "rank": me,
        "step_s": statistics.median(times),
        "recv_buffers": recv,
        "recv_bytes": recv_bytes,
        "pending_sends": sends,
        "pending_send_bytes": send_bytes,
        "fwd_outputs": outputs,
        "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


if __name__ == "__main__":
    main()
