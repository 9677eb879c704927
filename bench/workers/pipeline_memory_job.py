"""One rank of bench/pipeline_memory.py: a 4-stage MLP pipeline (one stage per rank, or two for
Interleaved1F1B), 16 microbatches, under torch's own classes or tether's; prints ``RESULT <json>``.

``--mode=memory``: one configuration; what the rank held in its last step, and peak RSS.
``--mode=time``: torch's schedule and the configuration's side by side on the same ranks, one step
of each in turn (the order alternating), each between two barriers: rank 0 reports both step
times per round, so that a ratio compares steps taken moments apart in the same processes.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as torch_pp
from torch import nn

N_MB = 16
CONFIGS = ("torch", "tether", "tether-k2", "tether-edges")


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--port", "--steps", "--warmup", "--rows", "--dim"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--config", required=True, choices=CONFIGS)
    parser.add_argument("--mode", required=True, choices=("memory", "time"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # what torchrun sets (OMP_NUM_THREADS=1) with several ranks a host
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)
    x = torch.randn(N_MB * args.rows, args.dim)
    y = torch.randn(N_MB * args.rows, args.dim)
    where = (args.rank, args.world_size, args.dim)
    if args.mode == "memory":
        pipe = Pipe(args.schedule, args.config, *where)
        for _ in range(args.warmup + args.steps):
            pipe.step(x, y)
        result = {"rank": args.rank, **pipe.held()}
        result["max_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    else:
        pipes = {
            "base": Pipe(args.schedule, "torch", *where),
            "config": Pipe(args.schedule, args.config, *where),
        }
        times: dict[str, list[float]] = {"base": [], "config": []}
        for round_ in range(args.warmup + args.steps):
            for name in ("base", "config") if round_ % 2 == 0 else ("config", "base"):
                dist.barrier()
                start = time.perf_counter()
                pipes[name].step(x, y)
                dist.barrier()  # the step ends when the slowest rank's does
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        result = {"rank": args.rank, "base_s": times["base"], "config_s": times["config"]}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


class Pipe:
    """This rank's stages and schedule under one configuration."""

    def __init__(self, schedule: str, config: str, me: int, world: int, dim: int) -> None:
        if config == "torch":
            pp: Any = torch_pp
        else:
            import tether.pipelining as pp

            pp.config.pipeline_per_edge_p2p = config == "tether-edges"
        self.plain = config == "torch"
        self.me = me
        interleaved = schedule == "Interleaved1F1B"
        n_stages = 2 * world if interleaved else world
        torch.manual_seed(0)
        self.stages = [
            pp.PipelineStage(
                nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh()),
                index,
                n_stages,
                torch.device("cpu"),
            )
            for index in (range(me, n_stages, world) if interleaved else [me])
        ]
        controls = {"max_outstanding_sends": 2} if config == "tether-k2" else {}
        cls = getattr(pp, f"Schedule{schedule}")
        self.schedule = cls(
            self.stages if interleaved else self.stages[0], N_MB, loss_fn=_loss, **controls
        )
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.pp = pp

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        kwargs: dict[str, Any] = {"target": y} if self.last else {}
        self.schedule.step(x, **kwargs) if self.first else self.schedule.step(**kwargs)

    def held(self) -> dict[str, Any]:
        """What this rank held in the last step: tether counts it; torch keeps every receive
        buffer it allocated, and (runtime schedules) every send to the step's end."""
        stats = None if self.plain else self.pp.memory_stats(self.schedule)
        if stats is not None:
            return {
                "recv_buffers": stats.recv_buffers_peak,
                "recv_bytes": stats.recv_bytes_peak,
                "pending_sends": stats.pending_sends_peak,
                "pending_send_bytes": stats.pending_send_bytes_peak,
                "fwd_outputs": stats.fwd_outputs_peak,
            }
        buffers = [
            info.buffer
            for s in self.stages
            for infos in (*s.args_recv_info.values(), *getattr(s, "grad_recv_info", {}).values())
            for info in infos
            if not info.is_root_arg and info.buffer is not None
        ]
        order = getattr(self.schedule, "pipeline_order_with_comms", None)
        sends = None
        if order is not None:
            sends = sum(1 for a in order[self.me] if str(a.computation_type.value)[:4] == "SEND")
        return {
            "recv_buffers": len(buffers),
            "recv_bytes": sum(t.numel() * t.element_size() for t in buffers),
            "pending_sends": sends,
            "pending_send_bytes": sends * buffers[0].nbytes if sends and buffers else None,
            "fwd_outputs": None,  # torch counts nothing: its stages hold each output to backward
        }


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


if __name__ == "__main__":
    main()
