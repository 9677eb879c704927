"""Pipeline memory: torch 2.13's schedules against tether.pipelining's, in one run.

1F1B and Interleaved1F1B (2 stages per rank), 4 gloo ranks on CPU, 16 microbatches of 32x512
activations (64 KiB each; ``--rows``, ``--dim``), a 4-stage (8 for interleaved) MLP;
configurations: plain torch, tether with its defaults, tether with ``max_outstanding_sends=2``,
tether with per-edge P2P groups.

Memory, one job per configuration: the most receive buffers a rank held, the bytes in them, the
sends not yet waited (torch keeps every one to the step's end), the forward outputs held for
backward (tether's count), peak RSS.

Step time, one job per configuration: torch's schedule and the configuration's built side by side
on the same ranks, one step of each in turn (order alternating), each between barriers; the ratio
of each round's two steps, pooled over repetitions (median and quartiles). Steps taken moments
apart in the same processes share the machine's state, which separate jobs do not (on 2 shared
cores, two runs of one configuration differ by up to 5 %). The ``torch`` row pairs torch with
itself: the method's noise floor. Each repetition in fresh processes; ends with one JSON line.

    python bench/pipeline_memory.py            # 3 repetitions, about 16 minutes on 2 cores
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
    "1F1B": ("torch", "tether"),
    "Interleaved1F1B": ("torch", "tether", "tether-k2", "tether-edges"),
}


def held(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The most any rank held."""
    keys = ("recv_buffers", "recv_bytes", "pending_sends", "pending_send_bytes", "fwd_outputs")
    out = {k: max((r[k] for r in ranks if r[k] is not None), default=None) for k in keys}
    out["max_rss_mb"] = max(r["max_rss_kb"] for r in ranks) / 1024
    return out


def quartiles(values: list[float]) -> str:
    if len(values) < 4:
        return spread(values)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{q2:.3f} [{q1:.3f}-{q3:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds per repetition")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32, help="rows of a microbatch")
    parser.add_argument("--dim", type=int, default=512, help="width of the MLP")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 4, 1
    memory: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for schedule in SCHEDULES:
            for config in CONFIGS[schedule]:
                common = [
                    f"--schedule={schedule}",
                    f"--config={config}",
                    f"--warmup={args.warmup}",
                    f"--rows={args.rows}",
                    f"--dim={args.dim}",
                ]
                label = f"pp-{schedule}-{config}"
                ranks = run_ranks(
                    WORKER, WORLD, [*common, "--mode=memory", "--steps=2"], label=label
                )
                memory.setdefault((schedule, config), []).append(held(ranks))
                ranks = run_ranks(
                    WORKER, WORLD, [*common, "--mode=time", f"--steps={args.steps}"], label=label
                )
                rounds = zip(ranks[0]["base_s"], ranks[0]["config_s"], strict=True)
                ratios.setdefault((schedule, config), []).extend(c / b for b, c in rounds)

    def col(schedule: str, config: str, key: str) -> list[float]:
        return [r[key] for r in memory.get((schedule, config), []) if r[key] is not None]

    def vs_torch(schedule: str, config: str, key: str) -> list[float]:  # per repetition
        pairs = zip(memory.get((schedule, config), []), memory[(schedule, "torch")], strict=False)
        return [t[key] / p[key] for t, p in pairs if p[key]]

    print(
        "| schedule | config | recv buffers | recv KiB | pending sends | outputs held "
        "| RSS MiB | step / torch, same processes |"
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
                f"| {quartiles(ratios[(schedule, config)])} |"
            )

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    def per_schedule(config: str, key: str | None = None) -> dict[str, float | None]:
        if key is None:
            return {s: med(ratios.get((s, config), [])) for s in SCHEDULES}
        return {s: med(col(s, config, key)) for s in SCHEDULES}

    figures = {
        "world": WORLD,
        "n_microbatches": 16,
        "microbatch": [args.rows, args.dim],
        "reps": args.reps,
        "rounds": args.steps,
        "recv_buffers_peak_plain": per_schedule("torch", "recv_buffers"),
        "recv_buffers_peak_tether": per_schedule("tether", "recv_buffers"),
        "pending_sends_peak_plain": per_schedule("torch", "pending_sends"),
        "pending_sends_peak_tether": per_schedule("tether", "pending_sends"),
        "pending_sends_peak_tether_k2": per_schedule("tether-k2", "pending_sends"),
        "fwd_outputs_peak_tether": per_schedule("tether", "fwd_outputs"),
        "fwd_outputs_peak_tether_k2": per_schedule("tether-k2", "fwd_outputs"),
        "peak_activation_bytes_ratio": {
            s: med(vs_torch(s, "tether", "recv_bytes")) for s in SCHEDULES
        },
        "peak_rss_ratio": {s: med(vs_torch(s, "tether", "max_rss_mb")) for s in SCHEDULES},
        "step_time_ratio": per_schedule("tether"),
        "step_time_ratio_k2": per_schedule("tether-k2"),
        "step_time_ratio_edges": per_schedule("tether-edges"),
        "step_time_ratio_torch_vs_torch": per_schedule("torch"),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
