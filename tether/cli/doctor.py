"""``tether doctor``: what tether records with here, and why."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import tether
from tether.cli.main import plain_help

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tether doctor",
        description=plain_help(__doc__),
        epilog="Exit status: 0, or 1 with --require-native where the native core is not used.",
    )
    parser.add_argument(
        "--require-native",
        action="store_true",
        help="fail unless the native recording core records (for CI and images)",
    )
    args = parser.parse_args(argv)
    import torch

    kind, why = tether.recorder_status()
    python = platform.python_version()
    print(f"tether {tether.__version__}, torch {torch.__version__}, Python {python}")
    if kind == "native":
        print("recorder: native core (C++, no GIL on the issue path)")
    else:
        print(f"recorder: Python recorder, because {why}")
    if args.require_native and kind != "native":
        print("tether doctor: the native core is required (--require-native)", file=sys.stderr)
        return 1
    return 0
