"""``tether``: the command line."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from tether import __version__
from tether._exceptions import TetherError

__all__ = ["main"]

USAGE = """usage: tether COMMAND [options]

commands:
  run    launch a job like torchrun, recording every collective in every worker
  demo   run a 4-rank CPU job under the recorder and show what each rank recorded
  show   print what each rank recorded in a dump event
  dump   make every rank of a running job dump now, into one new event
  analyze  say what went wrong in a dump event: verdict, culprit rank, collective, line

`tether COMMAND --help` describes each command's options."""


_COMMANDS = {
    "run": "tether.launcher.run",
    "demo": "tether.cli.demo",
    "show": "tether.cli.show",
    "dump": "tether.cli.dump",
    "analyze": "tether.cli.analyze",
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


if __name__ == "__main__":
    sys.exit(main())
