"""fp32 gates and norms in a bf16 FSDP2 model: tether's per-parameter policy against bf16
everywhere and against the workaround used on torch 2.13 (gates and norms as fp32 groups).

Run from the repository root::

    python bench/fsdp_precision.py            # about 2-4 minutes on 2 cores
    python bench/fsdp_precision.py --quick    # one repetition, a few steps: a smoke run

One small MoE transformer (``bench/workers/fsdp_precision_job.py``: 4 blocks of attention and 4
dense-mixed experts computed in bf16, each with an RMSNorm, a LayerNorm and a router gate whose
code computes in the weight's dtype; a final RMSNorm and a head; 5.3 M parameters), world size 2
(gloo, CPU, one thread per rank, against a TCPStore this script hosts on a free port), sharded
three ways, all reducing gradients in fp32:

- **bf16**: torch's ``fully_shard`` per block and on the root, ``param_dtype=bfloat16``: gates and
  norms in bf16 too (what the other two exist to avoid);
- **override**: tether's ``fully_shard`` with ``param_dtype_override_fn=keep_original_dtype(model,
  lambda n: "gate" in n or "norm" in n)``: the same groups, gates and norms in fp32;
- **workaround**: torch's ``fully_shard``, each gate and norm first sharded alone with
  ``MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32)``, then the blocks and the root
  in bf16: 13 more groups, so more all-gathers and reduce-scatters.

Each configuration runs ``--reps`` times in fresh processes, interleaved (the order rotates from
one repetition to the next). Per run: the median step time (forward, backward, AdamW step) over
``--steps`` timed steps after ``--warmup`` (a step's time is the slower rank's); all-gathers and
reduce-scatters per timed step, counted by wrapping ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (torch's ``patch_all_gather``/``patch_reduce_scatter``); peak
memory as the peak bytes held by torch's CPU allocator during a step above the step's start
(the profiler's allocation events; the median of 3 untimed steps, the larger rank's), the
CPU-side ``max_memory_allocated`` (the RSS high-water mark barely moves after warm-up: glibc keeps
freed memory resident), with the peak RSS beside it as a coarse cross-check. Figures are median
[min-max] over repetitions; step-time ratios are taken within each repetition first.

override and workaround apply the same casts, so their first-step losses must be identical; this
script checks it (and bf16's, for contrast). Goal: override within 5 % of bf16's step time, at
least as fast as the workaround, one all-gather per group. The last line of output is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from _common import REPO, run_ranks, spread

WORKER = REPO / "bench" / "workers" / "fsdp_precision_job.py"
WORLD = 2
CONFIGS = ("bf16", "override", "workaround")
JOB_TIMEOUT_S = 300
GOAL_VS_BF16 = 1.05


def run_job(config: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both ranks of one configuration, in fresh processes; each rank's RESULT."""
    extra = [
        f"--config={config}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--mem-steps={args.mem_steps}",
    ]
    return run_ranks(WORKER, WORLD, extra, label=f"fsdp-{config}", timeout=JOB_TIMEOUT_S)


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: its median step (the slower rank's time at each step), the rest per rank."""
    steps = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
    first = ranks[0]
    return {
        "step_s": statistics.median(steps),
        "groups": first["groups"],
        "per_step": first["per_step"],
        "peak_alloc_mib": max(r["peak_alloc_mib"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "loss0": [r["loss0"] for r in ranks],
        "loss_last": [r["loss_last"] for r in ranks],
    }


def max_abs_diff(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]], key: str) -> float:
    """Largest difference of a per-rank loss between two configurations, over repetitions."""
    return max(
        abs(x - y)
        for a, b in zip(runs_a, runs_b, strict=True)
        for x, y in zip(a[key], b[key], strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repetition, 2+6 steps")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.warmup, args.steps, args.mem_steps = 1, 2, 6, 1
    if min(args.reps, args.steps, args.mem_steps) < 1:
        parser.error("--reps, --steps and --mem-steps must be at least 1")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for rep in range(args.reps):
        order = CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]
        for config in order:
            runs[config].append(summarize(run_job(config, args)))
            r = runs[config][-1]
            print(
                f"rep {rep} {config}: step {r['step_s'] * 1e3:.1f} ms, "
                f"{r['per_step']['all_gather']:g} all-gathers/step, "
                f"peak alloc {r['peak_alloc_mib']:.1f} MiB, loss0 {r['loss0']}",
                flush=True,
            )

    def ratios(a: str, b: str) -> list[float]:  # within each repetition, then over them
        return [x["step_s"] / y["step_s"] for x, y in zip(runs[a], runs[b], strict=True)]

    def col(config: str, key: str) -> list[float]:
        return [float(r[key]) for r in runs[config]]

    def per_step(config: str, key: str) -> float:
        return float(statistics.median(r["per_step"].get(key, 0.0) for r in runs[config]))

    def dtypes(config: str) -> str:
        kinds = sorted(k for k in runs[config][0]["per_step"] if k.startswith("all_gather_"))
        kinds = [k for k in kinds if k != "all_gather_bytes"]
        return ", ".join(f"{per_step(config, k):g} {k.removeprefix('all_gather_')}" for k in kinds)

    print(
        f"\nmedian [min-max] of {args.reps} run(s) per configuration, {args.steps} timed steps each"
    )
    print(
        "\n| | groups | step (ms) | step / bf16 | all-gathers per step | reduce-scatters per step "
        "| all-gathered MiB per step | peak alloc in a step (MiB) | peak RSS (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for config in CONFIGS:
        step_ms = [1e3 * s for s in col(config, "step_s")]
        print(
            f"| {config} | {runs[config][0]['groups']} | {spread(step_ms, '{:.1f}')} "
            f"| {spread(ratios(config, 'bf16'))} "
            f"| {per_step(config, 'all_gather'):g} ({dtypes(config)}) "
            f"| {per_step(config, 'reduce_scatter'):g} "
            f"| {per_step(config, 'all_gather_bytes') / (1 << 20):.2f} "
            f"| {spread(col(config, 'peak_alloc_mib'), '{:.1f}')} "
            f"| {spread(col(config, 'peak_rss_mib'), '{:.0f}')} |"
        )
    vs_bf16, vs_workaround = ratios("override", "bf16"), ratios("override", "workaround")
    print(
        f"\noverride / bf16 step time: {spread(vs_bf16)} (goal <= {GOAL_VS_BF16}); "
        f"override / workaround: {spread(vs_workaround)} (goal <= 1)"
    )
    same_casts = max_abs_diff(runs["override"], runs["workaround"], "loss0")
    last = max_abs_diff(runs["override"], runs["workaround"], "loss_last")
    other = max_abs_diff(runs["override"], runs["bf16"], "loss0")
    print(
        f"first-step loss, override vs workaround (same casts): max |diff| {same_casts:.3g} "
        f"over ranks and repetitions ({'identical' if same_casts == 0 else 'DIFFERENT'}); "
        f"after the last timed step: {last:.3g}; override vs bf16 (gates and norms in bf16): "
        f"{other:.3g}; rank 0's first-step losses: "
        + ", ".join(f"{c} {runs[c][0]['loss0'][0]:.7f}" for c in CONFIGS)
    )
    groups = {c: runs[c][0]["groups"] for c in CONFIGS}
    allgathers = {c: per_step(c, "all_gather") for c in CONFIGS}
    # One all-gather per group and pass: the root keeps its parameters from forward to backward.
    one_per_group = allgathers["override"] == 2 * groups["override"] - 1 == allgathers["bf16"]

    def median(config: str, key: str, scale: float = 1.0) -> float:
        return round(scale * float(statistics.median(col(config, key))), 2)

    print(
        json.dumps(
            {
                "override_vs_bf16_step_ratio": round(statistics.median(vs_bf16), 4),
                "override_vs_workaround_step_ratio": round(statistics.median(vs_workaround), 4),
                "override_vs_bf16_step_ratio_per_rep": [round(r, 4) for r in vs_bf16],
                "override_vs_workaround_step_ratio_per_rep": [round(r, 4) for r in vs_workaround],
                "step_ms": {c: median(c, "step_s", 1e3) for c in CONFIGS},
                "groups": groups,
                "allgathers_per_step": allgathers,
                "reducescatters_per_step": {c: per_step(c, "reduce_scatter") for c in CONFIGS},
                "peak_alloc_mib": {c: median(c, "peak_alloc_mib") for c in CONFIGS},
                "peak_rss_mib": {c: median(c, "peak_rss_mib") for c in CONFIGS},
                "first_step_loss_override_vs_workaround_abs_diff": same_casts,
                "first_step_loss_identical": same_casts == 0,
                "last_step_loss_override_vs_workaround_abs_diff": last,
                "first_step_loss_override_vs_bf16_abs_diff": other,
                "goal_within_5pct_of_bf16": statistics.median(vs_bf16) <= GOAL_VS_BF16,
                "goal_not_slower_than_workaround": statistics.median(vs_workaround) <= 1.0,
                "goal_one_allgather_per_group": one_per_group,
                "reps": args.reps,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
