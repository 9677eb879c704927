"""``tether demo --fault crash --elastic``: a job that loses a rank, goes on, and takes a
replacement back; it succeeds only if its losses are those of a fault-free run."""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tether.analyze import analyze, render
from tether.events.layout import elastic_timeline_file
from tether.launcher import run as launcher

__all__ = ["RELATIVE_TOLERANCE", "check", "elastic_demo"]

RELATIVE_TOLERANCE = 1e-5
"""How far a committed loss may be from the fault-free run's (the reductions' order differs)."""


def elastic_demo(args: argparse.Namespace) -> int:
    from tether.demo.elastic_job import GLOBAL_BATCH

    world = args.world_size
    if GLOBAL_BATCH % world or GLOBAL_BATCH % (world - 1):
        print(f"tether demo: --elastic needs a world of 2, 3 or 4 ranks (got {world})")
        return 2
    steps = max(args.steps, args.fault_step + 12)
    print(
        f"tether demo: {world} ranks on CPU (gloo) under `tether run --elastic`: DDP training on "
        f"a global batch of {GLOBAL_BATCH} re-sharded over the ranks alive; rank {args.culprit} "
        f"dies from SIGKILL at step {args.fault_step}",
        flush=True,
    )
    dump_dir = Path(args.dump_dir)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tether-demo-") as out:
        rc = launcher.main(
            [
                "--standalone",
                f"--nproc-per-node={world}",
                f"--dump-dir={dump_dir}",
                "--elastic",
                "-m",
                "tether.demo.elastic_job",
                f"--out={out}",
                f"--steps={steps}",
                f"--culprit={args.culprit}",
                f"--fault-step={args.fault_step}",
            ]
        )
        outputs = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    took = time.monotonic() - started
    print(f"\nthe job ended with exit {rc} in {took:.1f}s", flush=True)
    events = (
        sorted(
            (p for p in dump_dir.iterdir() if elastic_timeline_file(p).exists()),
            key=lambda p: p.name,
        )
        if dump_dir.is_dir()
        else []
    )
    if events:
        print(f"\n$ tether analyze {events[-1]}\n{render(analyze(events[-1]))}", flush=True)
    problems = check(outputs, world, [args.culprit], f"rank {args.culprit} died")
    if rc != 0:
        problems.insert(0, f"the job exited {rc}")
    if not events:
        problems.append("no event with the job's elastic timeline was written")
    if problems:
        print("\ntether demo: MISMATCH: " + "; ".join(problems), flush=True)
        return 1
    return 0


def check(outputs: list[dict[str, Any]], world: int, lost: list[int], what: str) -> list[str]:
    """Print the losses beside the fault-free run's; what is wrong, if anything. ``lost``: the
    ranks that died and must have been replaced; ``what``: how they died, for the last line."""
    from tether.demo.elastic_job import reference_losses

    final = [o for o in outputs if o["world_size"] == world]
    ranks = sorted(o["rank"] for o in final)
    if ranks != list(range(world)):
        return [f"the job ended with ranks {ranks}, not all {world}"]
    joined = [o for o in final if o["incarnation"] > 0]
    if sorted(o["rank"] for o in joined) != sorted(lost):
        return [f"the replacement of rank(s) {lost} did not finish in the job"]
    survivor = next(o for o in final if o["incarnation"] == 0)
    losses = {int(k): v for k, v in survivor["losses"].items()}
    fault_free = reference_losses(max(losses) + 1)
    problems = []
    if sorted(losses) != list(range(len(losses))):
        problems.append("a step is missing from the survivors' losses")
    print("\n step  world  loss (elastic)   loss (fault-free)  rel. diff (every step is compared)")
    sizes = _world_by_step(survivor, world)
    worst = 0.0
    shown = _steps_to_show(sizes)
    for step in sorted(losses):
        diff = abs(losses[step] - fault_free[step]) / abs(fault_free[step])
        worst = max(worst, diff)
        if step not in shown:
            if step - 1 in shown:
                print("  ...")
            continue
        print(
            f" {step:4d}  {sizes.get(step, world):5d}  {losses[step]:.12f}   "
            f"{fault_free[step]:.12f}     {diff:.1e}"
        )
    if worst > RELATIVE_TOLERANCE:
        problems.append(f"a loss differs from the fault-free run by {worst:.1e} (relative)")
    digests = {o["digest"] for o in final}
    if len(digests) != 1:
        problems.append(f"the replicas' parameters differ ({len(digests)} digests)")
    if not problems:
        came = min(min(map(int, o["losses"])) for o in joined)
        them = "its replacement was" if len(lost) == 1 else "their replacements were"
        print(
            f"\ntether demo: ok: {what}, {world - len(lost)} ranks went on, {them} healed and "
            f"joined at step {came}; "
            f"{len(losses)} committed losses match the fault-free run within {worst:.1e} "
            f"(limit {RELATIVE_TOLERANCE:g}), and all {world} replicas hold identical parameters",
            flush=True,
        )
    return problems


def _steps_to_show(sizes: dict[int, int]) -> set[int]:
    """The first and last steps, and two on each side of every change of world size."""
    steps = sorted(sizes)
    shown = {*steps[:2], *steps[-2:]}
    for a, b in itertools.pairwise(steps):
        if sizes[a] != sizes[b]:
            shown |= {a - 1, a, b, b + 1}
    return shown


def _world_by_step(output: dict[str, Any], world: int) -> dict[int, int]:
    """The world size each step ran with, from the survivor's regroups."""
    sizes: dict[int, int] = {}
    changes = sorted((h["step"], len(h["members"])) for h in output["history"])
    for step in map(int, output["losses"]):
        size = world
        for at, n in changes:
            if step >= at:
                size = n
        sizes[step] = size
    return sizes
