"""Worker entry point used by ``tether run``: turn recording on, then run the user's program.

python -m tether.launcher.bootstrap (--script PATH | --module NAME) -- [program args]
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tether.events.layout import write_atomic
from tether.runtime import install, note_exception, note_failed_exit

__all__ = ["main"]


def main(argv: Sequence[str]) -> None:
    argv = list(argv)
    if len(argv) < 3 or argv[0] not in ("--script", "--module") or argv[2] != "--":
        raise SystemExit(
            "usage: python -m tether.launcher.bootstrap (--script PATH | --module NAME) -- ARGS"
        )
    kind, target, program_args = argv[0], argv[1], argv[3:]
    if kind == "--script" and not os.path.isfile(target):
        # One line per rank, as `python missing.py` (and so torchrun) says it: not a traceback
        # through this bootstrap. One write: the ranks share the terminal, unbuffered (-u), and
        # SystemExit's message and its newline are two writes, which two ranks interleaved.
        sys.stderr.write(f"{sys.executable}: can't open file {target!r}: no such file\n")
        raise SystemExit(1)
    install()
    try:
        _run(kind, target, program_args)
    except SystemExit as exc:  # sys.exit(1) fails the rank, like an uncaught exception
        note_failed_exit(exc)
        raise
    except Exception as exc:
        note_exception(exc)  # first: a peer's alarm may ask for this rank's dump any moment
        _record_for_torchrun(exc)
        # The traceback as `python script.py` prints it: from the program's first frame, not
        # through this bootstrap and runpy (8 frames of no use to its reader). The status is
        # an uncaught exception's.
        shown = exc.with_traceback(_in_the_program(exc.__traceback__))  # what the hook prints
        sys.excepthook(type(shown), shown, shown.__traceback__)
        raise SystemExit(1) from None


def _in_the_program(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame that is neither this module's nor runpy's (all of it where
    the exception is this bootstrap's own)."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    first = tb
    while first is not None and (
        first.tb_frame.f_code.co_filename in ours
        or os.path.abspath(first.tb_frame.f_code.co_filename) in ours
    ):
        first = first.tb_next
    return first if first is not None else tb


def _record_for_torchrun(exc: Exception) -> None:
    """Write torchrun's error file, as ``@record`` on the script's main would: torchrun's
    failure summary then shows the exception, and the launcher reads it for a rank that could
    not dump. A file the script's own ``@record`` wrote is left as it is."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    # What torch's ErrorHandler.record_exception writes, but in one step: the launcher reads the
    # file as soon as this process exits, and a process stopped mid-write (the teardown's
    # SIGTERM) would leave torch a file it cannot parse, which ends the launcher itself.
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    # Failing, torchrun's summary loses the message; the rank's own dump keeps it.
    with contextlib.suppress(OSError):
        write_atomic(Path(path), json.dumps(data))


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
