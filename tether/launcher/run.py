"""``tether run [torchrun options] SCRIPT [script args]``.

The options are torchrun's own parser plus tether's; the job is started by torchrun itself
(``torch.distributed.run``), in this process. Each worker runs :mod:`tether.launcher.bootstrap`,
which turns recording on and then runs the user's script unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether._exceptions import ConfigError
from tether.config import FLAGS, Config, load_config, settings

if TYPE_CHECKING:
    from tether.launcher.agent import Session

__all__ = ["build_parser", "main", "prepare"]

BOOTSTRAP = "tether.launcher.bootstrap"
EXIT_LINGER_S = 5.0
"""The longest a worker that dies of an exception waits to dump into the crash's event (see
``Config.exit_linger``): its own alarm takes milliseconds; a peer's death, the launcher's monitor
interval."""


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tether run"
    parser.description = (
        "Launch a distributed job like torchrun, with tether recording every collective in "
        "every worker. All torchrun options are accepted."
    )
    group = parser.add_argument_group("tether")
    # Each option is a Config field's setting: its flag, help and choices are described there.
    defaults = Config()
    for field, setting in settings().items():
        if setting.flag is None:
            continue
        default = getattr(defaults, field)
        if isinstance(default, bool):  # a switch; its string spellings are the variable's
            group.add_argument(
                setting.flag,
                dest=field,
                action="store_true",
                default=None,
                help=_help(
                    f"{setting.help} (default: off, or ${setting.env}={setting.to_str(True)})"
                ),
            )
            continue
        group.add_argument(
            setting.flag,
            dest=field,
            default=None,  # not given: the variable, then the default (load_config's flags=)
            metavar=setting.metavar,
            choices=setting.choices,
            help=_help(f"{setting.help} (default: ${setting.env} or {setting.to_str(default)})"),
        )
    group.add_argument(
        "--no-tether",
        action="store_true",
        help="plain torchrun: no recording, no bootstrap (the rollback path)",
    )
    return parser


def _help(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


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
    defaults: dict[str, Any] = {"exit_linger": EXIT_LINGER_S}
    if (peer := _other_nodes(args)) is not None:
        # The cluster page on node 0 calls every rank's debug server: on several nodes each
        # listens on its node's address (which asks for the job's token), not on loopback.
        from tether.launcher.gather import local_address

        defaults["debug_host"] = local_address(peer)
    config = load_config(flags={field: getattr(args, field) for field in FLAGS}, defaults=defaults)
    dump_dir = config.check_dump_dir()
    args.dump_dir = str(dump_dir)
    env = config.to_env()
    env["TETHER_DUMP_DIR"] = str(dump_dir)  # absolute: workers may change directory
    os.environ.update(env)  # torchrun's workers inherit this process's environment
    args.tether_config = config
    kind = "--module" if args.module else "--script"
    args.training_script_args = [kind, args.training_script, "--", *args.training_script_args]
    args.training_script = BOOTSTRAP
    args.module = True
    return args


def _other_nodes(args: argparse.Namespace) -> str | None:
    """Node 0's address (the store's), where the job may span several nodes; else None."""
    nnodes = str(args.nnodes or "1")
    if args.standalone or nnodes.split(":")[-1] in ("", "1"):
        return None
    if args.rdzv_endpoint:
        return str(args.rdzv_endpoint).rsplit(":", 1)[0].strip("[]") or None
    return str(args.master_addr or "127.0.0.1")


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from tether._log import say
    from tether.events.exception import describe, from_error_file
    from tether.job.alarm import HANG_EXIT_CODE
    from tether.launcher.agent import Session, tether_agent
    from tether.launcher.teardown import describe_exit

    args = prepare(argv)
    session = Session()
    try:
        if args.no_tether:
            run(args)  # type: ignore[no-untyped-call]
        else:
            with tether_agent(Path(args.dump_dir), config=args.tether_config) as session:
                run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        if session.ended_by_abort or any(
            f.exitcode == HANG_EXIT_CODE for f in exc.failures.values()
        ):
            # tether aborted the job after a hang: EX_TEMPFAIL, for a wrapper that retries
            say(_last_line("aborted after a hang", session))
            return HANG_EXIT_CODE
        if session.elsewhere:
            say(_last_line(session.elsewhere, session))
            return 1
        if session.node_fault:
            say(_last_line(session.node_fault, session))
            return 1
        if session.stopped:
            say(_last_line(f"the elastic job stopped: {session.stopped}", session))
            return 1
        rank, failure = _first_failure(exc, session.raised)
        how = describe_exit(failure.exitcode)
        # torch's message is boilerplate unless the worker left an error file (@record, or
        # tether's bootstrap): then it is the exception, of which one line is said here.
        raised = from_error_file(failure.error_file)
        why = f": {describe(raised)}" if raised is not None else ""
        say(_last_line(f"rank {rank} failed ({how}){why}", session))
        return 1
    except SignalException as exc:  # the workers are stopped; exit as a killed process would
        say(_last_line(f"stopped by {exc.sigval.name}", session))
        return 128 + int(exc.sigval)
    return 0


def _first_failure(exc: Any, raised: Sequence[int] = ()) -> tuple[int, Any]:
    """The failure to name: a rank that died of its own exception and said so (``raised``);
    else the first of the others, passing over the workers torchrun's teardown stopped
    (SIGTERM) and, where another is left, those that died of a failed collective (the error a
    dead peer causes). Not torchrun's first alone: its times are whole seconds, ties going to
    the lowest rank, and a rank that waited on a dead peer may write its error file first."""
    from tether.events.exception import from_collective, from_error_file

    real = {r: f for r, f in exc.failures.items() if f.exitcode != -signal.SIGTERM}
    if own := [r for r in raised if r in real]:
        return own[0], real[own[0]]
    if not real:
        return exc.get_first_failure()  # type: ignore[no-any-return]
    causes = {
        r: f
        for r, f in real.items()
        if (record := from_error_file(f.error_file)) is None or not from_collective(record)
    }
    candidates = causes or real
    rank = min(candidates, key=lambda r: (candidates[r].timestamp, r))
    return rank, candidates[rank]


def _last_line(what: str, session: Session) -> str:
    """``tether run``'s last line: how the job ended, where its event is (on a job of several
    nodes, where it is whole: this node may hold only its part), what to run next."""
    event, whole = session.last_event(), session.last_whole()
    if event is None:
        return f"tether run: {what}"
    if whole is not None:
        host, _, path = whole.partition(": ")
        return (
            f"tether run: {what}; this node's part of the event in {event}; the whole event on "
            f"{host}: {path}; next, there: tether analyze {path}"
        )
    return f"tether run: {what}; event {event}; next: tether analyze {event}"
