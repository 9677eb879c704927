"""Pipeline memory: torch 2.13's schedules against tether.pipelining's, in one run.

1F1B and Interleaved1F1B (2 stages per rank), 4 gloo ranks on CPU, 16 microbatches of 32x512
activations (64 KiB each), a 4-stage (8 for interleaved) MLP: per configuration (plain torch,
plain torch again as a control, tether with its defaults, tether with
``max_outstanding_sends=2``, tether with per-edge P2P groups), the most receive buffers a rank
held, the bytes in them, the sends not yet waited (torch keeps every one to the step's end), the
forward outputs held for backward (tether's count), peak RSS, and the step time (the slowest
rank's median step; ratios taken within each repetition), each repetition in fresh processes,
interleaved. Ends with one JSON line.

    python bench/pipeline_memory.py            # 3 repetitions, about 4 minutes on 2 cores
    python bench/pipeline_memory.py --quick    # 1 repetition, fewer steps
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from _common import REPO, run_ranks, spread

WORKER = REPO / "bench" / "workers" / "pipeline_memory_job.py"
WORLD = 4
SCHEDULES = ("1F1B", "Interleaved1F1B")
CONFIGS = {  # Schedule1F1B takes no send budget, in 2.15 either
    "1F1B": ("torch", "torch-again", "tether"),
    "Interleaved1F1B": ("torch", "torch-again", "tether", "tether-k2", "tether-edges"),
}
"""``torch-again`` is plain torch once more, later in each repetition: its ratio to ``torch`` is
this machine's noise floor for the step-time ratios."""


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The slowest rank's step time (the pipeline's), and the most any rank held."""
    return {
        "step_s": max(r["step_s"] for r in ranks),
        **{
            key: max((r[key] for r in ranks if r[key] is not None), default=None)
            for key in (
                "recv_buffers",
                "recv_bytes",
                "pending_sends",
                "pending_send_bytes",
                "fwd_outputs",
            )
        },
        "max_rss_mb": max(r["max_rss_kb"] for r in ranks) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 3, 1
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.reps):
        for schedule in SCHEDULES:
            for config in CONFIGS[schedule]:
                extra = [
                    f"--schedule={schedule}",
                    f"--config={config}",
                    f"--steps={args.steps}",
                    f"--warmup={args.warmup}",
                ]
                ranks = run_ranks(WORKER, WORLD, extra, label=f"pp-{schedule}-{config}")
                runs.setdefault((schedule, config), []).append(summarize(ranks))

    def col(schedule: str, config: str, key: str) -> list[float]:
        return [r[key] for r in runs.get((schedule, config), []) if r[key] is not None]

    def ratio(schedule: str, config: str, key: str) -> list[float]:  # per repetition
        return [
            t[key] / p[key]
            for t, p in zip(
                runs.get((schedule, config), []), runs[(schedule, "torch")], strict=False
            )
            if p[key]
        ]

    print(
        "| schedule | config | recv buffers | recv KiB | pending sends | outputs held "
        "| RSS MiB | step / torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for schedule in SCHEDULES:
        for config in CONFIGS[schedule]:
            kib = [b / 1024 for b in col(schedule, config, "recv_bytes")]
            print(
                f"| {schedule} | {config} "
                f"| {spread(col(schedule, config, 'recv_buffers'), '{:.0f}')} "
                f"| {spread(kib, '{:.0f}')} "
                f"| {spread(col(schedule, config, 'pending_sends'), '{:.0f}')} "
                f"| {spread(col(schedule, config, 'fwd_outputs'), '{:.0f}')} "
                f"| {spread(col(schedule, config, 'max_rss_mb'), '{:.0f}')} "
                f"| {spread(ratio(schedule, config, 'step_s'))} |"
            )

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    figures = {
        "world": WORLD,
        "n_microbatches": 16,
        "reps": args.reps,
        "recv_buffers_peak_plain": {s: med(col(s, "torch", "recv_buffers")) for s in SCHEDULES},
        "recv_buffers_peak_tether": {s: med(col(s, "tether", "recv_buffers")) for s in SCHEDULES},
        "pending_sends_peak_plain": {s: med(col(s, "torch", "pending_sends")) for s in SCHEDULES},
        "pending_sends_peak_tether": {s: med(col(s, "tether", "pending_sends")) for s in SCHEDULES},
        "pending_sends_peak_tether_k2": {
            s: med(col(s, "tether-k2", "pending_sends")) for s in SCHEDULES
        },
        "fwd_outputs_peak_tether": {s: med(col(s, "tether", "fwd_outputs")) for s in SCHEDULES},
        "fwd_outputs_peak_tether_k2": {
            s: med(col(s, "tether-k2", "fwd_outputs")) for s in SCHEDULES
        },
        "peak_activation_bytes_ratio": {
            s: med(ratio(s, "tether", "recv_bytes")) for s in SCHEDULES
        },
        "step_time_ratio": {s: med(ratio(s, "tether", "step_s")) for s in SCHEDULES},
        "step_time_ratio_k2": {s: med(ratio(s, "tether-k2", "step_s")) for s in SCHEDULES},
        "step_time_ratio_edges": {s: med(ratio(s, "tether-edges", "step_s")) for s in SCHEDULES},
        "peak_rss_ratio": {s: med(ratio(s, "tether", "max_rss_mb")) for s in SCHEDULES},
        "step_time_ratio_torch_again": {
            s: med(ratio(s, "torch-again", "step_s")) for s in SCHEDULES
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
