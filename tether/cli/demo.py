"""``tether demo``: a real multi-rank CPU job under the recorder, then what each rank recorded."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from tether.cli.show import summarize
from tether.launcher import run as launcher
from tether.recorder.load import resolve_event

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tether demo", description=__doc__)
    parser.add_argument("--world-size", type=int, default=4, help="ranks (at least 2)")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--dump-dir", default="tether-dumps", help="where the dump event goes")
    args = parser.parse_args(list(argv))
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")

    print(
        f"tether demo: {args.world_size} ranks on CPU (gloo), {args.steps} DDP steps, "
        "a subgroup all_reduce and a send/recv pair, recorded by `tether run`"
    )
    started = time.monotonic()
    rc = launcher.main(
        [
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            f"--dump-dir={args.dump_dir}",
            "--dump-on-exit",
            "-m",
            "tether.demo.job",
            f"--steps={args.steps}",
        ]
    )
    if rc != 0:
        return rc
    event = resolve_event(Path(args.dump_dir))
    print(summarize(event))
    print(f"\nevery rank dumped into {event} in {time.monotonic() - started:.1f}s")
    print(
        f"torch's analyzer reads it too: python -m torch.distributed.flight_recorder.fr_trace "
        f"{event} -p rank_"
    )
    return 0
