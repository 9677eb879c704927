"""``tether demo``: a real multi-rank CPU job under tether, with a fault injected on one rank."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from tether.cli.show import summarize
from tether.demo.job import FAULTS
from tether.launcher import run as launcher
from tether.recorder.load import load_event, resolve_event

__all__ = ["main"]

EXPECTED_REASON = {"hang": "hang", "gil": "hang", "crash": "crash", "none": "exit"}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tether demo", description=__doc__)
    parser.add_argument("--world-size", type=int, default=4, help="ranks (at least 2)")
    parser.add_argument("--culprit", type=int, default=2, help="the rank that misbehaves")
    parser.add_argument("--fault", choices=FAULTS, default="hang", help="what it does")
    parser.add_argument("--fault-step", type=int, default=5, help="the training step it happens")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="seconds, see tether run")
    parser.add_argument("--dump-dir", default="tether-dumps", help="where dump events go")
    args = parser.parse_args(list(argv))
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if not 0 <= args.culprit < args.world_size:
        parser.error("--culprit must be a rank of the job")

    fault = "no fault" if args.fault == "none" else f"rank {args.culprit}: {args.fault}"
    print(
        f"tether demo: {args.world_size} ranks on CPU (gloo): DDP training, a subgroup all_reduce "
        f"and a send/recv pair every step; {fault} at step {args.fault_step}; "
        f"hang timeout {args.hang_timeout:g}s",
        flush=True,
    )
    dump_dir = Path(args.dump_dir)
    before = _events(dump_dir)
    started = time.monotonic()
    rc = launcher.main(
        [
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            f"--dump-dir={dump_dir}",
            f"--hang-timeout={args.hang_timeout}",
            "--dump-on-exit",
            "-m",
            "tether.demo.job",
            f"--steps={args.steps}",
            f"--fault={args.fault}",
            f"--culprit={args.culprit}",
            f"--fault-step={args.fault_step}",
        ]
    )
    new = sorted(set(_events(dump_dir)) - set(before))
    if not new:
        print(f"tether demo: the job ended (exit {rc}) and no rank dumped", flush=True)
        return 1
    event = resolve_event(dump_dir, new[-1])
    print(summarize(event), flush=True)
    dumps, _ = load_event(event)
    reason = next(iter(dumps.values()))["tether"]["reason"] if dumps else "?"
    print(
        f"\nthe job ended with exit {rc}; {len(dumps)} of {args.world_size} ranks dumped into "
        f"{event} ({reason}) in {time.monotonic() - started:.1f}s",
        flush=True,
    )
    print(
        "torch's analyzer reads it too: python -m torch.distributed.flight_recorder.fr_trace "
        f"{event} -p rank_",
        flush=True,
    )
    return 0 if reason == EXPECTED_REASON[args.fault] else 1


def _events(dump_dir: Path) -> list[str]:
    if not dump_dir.is_dir():
        return []
    return sorted(p.name for p in dump_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
