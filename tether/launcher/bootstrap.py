"""Worker entry point used by ``tether run``: turn recording on, then run the user's program.

python -m tether.launcher.bootstrap (--script PATH | --module NAME) -- [program args]
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from tether.runtime import install, note_failed_exit

__all__ = ["main"]


def main(argv: Sequence[str]) -> None:
    argv = list(argv)
    if len(argv) < 3 or argv[0] not in ("--script", "--module") or argv[2] != "--":
        raise SystemExit(
            "usage: python -m tether.launcher.bootstrap (--script PATH | --module NAME) -- ARGS"
        )
    kind, target, program_args = argv[0], argv[1], argv[3:]
    install()
    try:
        _run(kind, target, program_args)
    except SystemExit as exc:  # sys.exit(1) fails the rank, like an uncaught exception
        note_failed_exit(exc)
        raise


def _run(kind: str, target: str, program_args: list[str]) -> None:
    if kind == "--module":
        sys.argv = [target, *program_args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # As `python script.py` would: the script's directory comes first on sys.path.
        sys.argv = [target, *program_args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
