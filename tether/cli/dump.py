"""``tether dump``: make every rank of a running job dump, now, into one new event.

The job is found through ``DUMP_DIR/.jobs/<job>.json``, which rank 0 writes when the job starts
(its store's address and world size) and removes when it exits cleanly; this command connects to
that store as a client, raises an alarm (reason "manual" unless told otherwise) and waits for
every rank's answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from tether._exceptions import ConfigError, StoreUnreachableError
from tether.config import load_config
from tether.events.layout import dump_root
from tether.job.alarm import DUMPED, AlarmBoard
from tether.job.client import StoreAddress, await_answers
from tether.job.jobfile import JOBS_DIR, ended_here, job_file, job_files

__all__ = ["JobFile", "find_job", "main"]

DEFAULT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class JobFile:
    """What rank 0 announced about its job in ``DUMP_DIR/.jobs/<job>.json``."""

    path: Path
    job_id: str
    store_host: str
    store_port: int
    world_size: int
    host: str
    pid: int
    started_ns: int
    store_etcd: str = ""
    store_prefix: str = ""
    """Where the job keeps its keys in etcd (``--store``), if it does."""

    @property
    def store(self) -> StoreAddress:
        return StoreAddress(self.store_host, self.store_port, self.store_etcd, self.store_prefix)

    @classmethod
    def read(cls, path: Path) -> JobFile:
        try:
            data = json.loads(path.read_text())
            return cls(
                path=path,
                job_id=str(data["job_id"]),
                store_host=str(data["store_host"]),
                store_port=int(data["store_port"]),
                world_size=int(data["world_size"]),
                host=str(data.get("host", "")),
                pid=int(data.get("pid", 0)),
                started_ns=int(data.get("started_ns", 0)),
                store_etcd=str(data.get("store_etcd", "")),
                store_prefix=str(data.get("store_prefix", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a readable job file ({exc}); delete it, or pass --job for "
                "another job"
            ) from exc

    def gone(self) -> bool:
        """Whether the job is known to have ended: its rank 0 ran on this host and is gone.
        (Elsewhere only the store can tell.)"""
        return ended_here(self.host, self.pid)


def find_job(dump_dir: Path, job: str | None) -> JobFile:
    """The job named ``job``, or the newest one not known to have ended."""
    if job is not None:
        path = job_file(dump_dir, job)
        if not path.is_file():
            raise ConfigError(f"no job {job!r} in {dump_dir}; {_listing(dump_dir)}")
        found = JobFile.read(path)
        if found.gone():
            raise StoreUnreachableError(_stale(found))
        return found
    candidates = [JobFile.read(p) for p in job_files(dump_dir)]
    if not candidates:
        raise ConfigError(
            f"no running job in {dump_dir}; pass the job's --dump-dir (its `tether run "
            "--dump-dir`, or TETHER_DUMP_DIR)"
        )
    running = [j for j in candidates if not j.gone()]
    if not running:
        if len(candidates) == 1:
            raise StoreUnreachableError(_stale(candidates[0]))
        raise StoreUnreachableError(
            f"the {len(candidates)} jobs there have ended without cleaning up (their job files "
            f"are stale): rm {dump_dir / JOBS_DIR}/*.json"
        )
    return max(running, key=lambda j: j.started_ns)


def _stale(job: JobFile) -> str:
    """One short line: what happened and what to do."""
    return f"job {job.job_id} has ended without cleaning up (its job file is stale): rm {job.path}"


def _listing(dump_dir: Path) -> str:
    """The jobs there, at most a few, in one short phrase."""
    names = [p.name.removesuffix(".json") for p in job_files(dump_dir)]
    if not names:
        return "there are no jobs there"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"jobs there: {shown}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether dump",
        description="Make every rank of a running job dump now, into one new event.",
    )
    parser.add_argument(
        "--dump-dir",
        default=None,
        help="the job's dump directory (default: $TETHER_DUMP_DIR or ./tether-dumps)",
    )
    parser.add_argument("--job", default=None, help="job id (default: the newest running job)")
    parser.add_argument("--reason", default="manual", help="event reason (default: manual)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="how long to wait for the ranks' dumps; a rank that looks stuck (a peer collected "
        f"its stacks) is waited for until then (default: {DEFAULT_TIMEOUT_S:g})",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.reason == "hang":  # the responders would abort the job (on_hang=abort)
        raise ConfigError(
            "--reason hang is the watchdog's and may abort the job; pick another reason"
        )
    config = load_config(dump_dir=Path(args.dump_dir) if args.dump_dir is not None else None)
    dump_dir = dump_root(config.dump_dir)
    job = find_job(dump_dir, args.job)
    try:
        store = job.store.connect()
    except StoreUnreachableError as exc:
        raise StoreUnreachableError(
            f"job {job.job_id}: {exc}; if it has ended, delete {job.path}"
        ) from exc
    alarm = AlarmBoard(store).raise_alarm(
        args.reason,
        origin="cli",
        detail=f"tether dump on {socket.gethostname()} (pid {os.getpid()})",
    )
    result = await_answers(store, alarm, list(range(job.world_size)), args.timeout)
    event_dir = dump_dir / alarm.event_id
    print(f"job {job.job_id}: event {event_dir}")
    for rank, what in sorted(result.answered.items()):
        print(f"  rank {rank}: {'dumped' if what == DUMPED else what}")
    if result.missing:
        missing = ", ".join(map(str, result.missing))
        print(
            f"tether dump: ranks {missing} did not answer within {args.timeout:g}s; their "
            "process may be stuck or gone (their launcher's log says which)",
            file=sys.stderr,
        )
        return 1
    return 0
