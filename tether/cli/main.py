"""``tether``: the command line."""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence

from tether import __version__
from tether._exceptions import TetherError

__all__ = ["EXIT_READER_GONE", "main", "plain_help"]

EXIT_READER_GONE = 141
"""Exit status when stdout's reader went away (``tether analyze ... | head``): 128 + SIGPIPE,
what a shell reports for ``cat`` or ``grep`` in the same place, so ``set -o pipefail`` sees a
cut-off output as it would for any other tool, and no retry wrapper mistakes it for a verdict
(0) or unusable input (2)."""

USAGE = """usage: tether COMMAND [options]

commands:
  run    launch a job like torchrun, recording every collective in every worker
  demo   run a 4-rank CPU job under the recorder and show what each rank recorded
  show   print what each rank recorded in a dump event
  dump   make every rank of a running job dump now, into one new event
  analyze  say what went wrong in a dump event: verdict, culprit rank, collective, line
  doctor   say which recorder records here (the native core or the Python one), and why
  clean    remove what jobs that ended left in a dump directory (ring, stacks, job files)

`tether COMMAND --help` describes each command's options."""


_COMMANDS = {
    "run": "tether.launcher.run",
    "demo": "tether.cli.demo",
    "show": "tether.cli.show",
    "dump": "tether.cli.dump",
    "analyze": "tether.cli.analyze",
    "doctor": "tether.cli.doctor",
    "clean": "tether.cli.clean",
}


def _command(name: str) -> Callable[[Sequence[str]], int] | None:
    """The command's ``main``, importing only its module (``tether analyze`` reads dumps
    without importing torch; the others need it)."""
    where = _COMMANDS.get(name)
    if where is None:
        return None
    entry: Callable[[Sequence[str]], int] = importlib.import_module(where).main
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # Inside the try: a pipe's output is written here, not at exit where Python would
            # print its own "Exception ignored ... BrokenPipeError".
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_READER_GONE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"tether {__version__}")
        return 0
    command = _command(argv[0])
    if command is None:
        print(f"tether: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return command(argv[1:])
    except TetherError as exc:
        print(f"tether {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null: what is still buffered, and anything printed while the
    interpreter exits, goes nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (an in-process caller's StringIO)
        pass


_ROLE = re.compile(r":[a-z]+:`~?([^`<]+?)(?:\s*<[^>]*>)?`")


def plain_help(doc: str | None) -> str:
    """A docstring as ``--help`` text: reStructuredText's inline markup (double backticks,
    ``:func:`` roles) taken out, which argparse would print as it is."""
    text = _ROLE.sub(r"\1", doc or "")
    return text.replace("``", "").strip()


if __name__ == "__main__":
    sys.exit(main())
