"""``tether run [torchrun options] SCRIPT [script args]``.

The options are torchrun's own parser plus tether's; the job is started by torchrun itself
(``torch.distributed.run``), in this process. Each worker runs :mod:`tether.launcher.bootstrap`,
which turns recording on and then runs the user's script unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tether._exceptions import ConfigError
from tether.config import load_config

__all__ = ["build_parser", "main", "prepare"]

BOOTSTRAP = "tether.launcher.bootstrap"


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tether run"
    parser.description = (
        "Launch a distributed job like torchrun, with tether recording every collective in "
        "every worker. All torchrun options are accepted."
    )
    group = parser.add_argument_group("tether")
    group.add_argument(
        "--dump-dir",
        default=None,
        help="directory receiving one sub-directory per dump event "
        "(default: $TETHER_DUMP_DIR or ./tether-dumps)",
    )
    group.add_argument(
        "--ring-size",
        type=int,
        default=None,
        help="operations kept per process, oldest dropped first "
        "(default: $TETHER_RING_SIZE or 2000)",
    )
    group.add_argument(
        "--dump-on-exit",
        action="store_true",
        default=None,
        help="every worker dumps when it exits normally (event reason 'exit')",
    )
    group.add_argument(
        "--no-tether",
        action="store_true",
        help="plain torchrun: no recording, no bootstrap (the rollback path)",
    )
    return parser


def prepare(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` and rewrite it into torchrun's arguments; sets the workers' environment."""
    args = build_parser().parse_args(list(argv))
    if args.no_tether:
        return args
    if args.no_python:
        raise ConfigError(
            "--no-python runs a program that is not Python, which tether cannot record; "
            "drop --no-python, or add --no-tether to launch without recording"
        )
    config = load_config(
        dump_dir=Path(args.dump_dir) if args.dump_dir is not None else None,
        ring_size=args.ring_size,
        dump_on_exit=args.dump_on_exit,
    )
    dump_dir = config.check_dump_dir()
    env = config.to_env()
    env["TETHER_DUMP_DIR"] = str(dump_dir)  # absolute: workers may change directory
    os.environ.update(env)  # torchrun's workers inherit this process's environment
    kind = "--module" if args.module else "--script"
    args.training_script_args = [kind, args.training_script, "--", *args.training_script_args]
    args.training_script = BOOTSTRAP
    args.module = True
    return args


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = prepare(argv)
    try:
        run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"tether run: rank {rank} failed: {failure.message or failure}", file=sys.stderr)
        return 1
    return 0
