"""``tether clean``: remove what jobs that ended left in a dump directory.

``tether run`` removes its workers' files however the job ends; a job started otherwise
(``torchrun``, ``tether.init_process_group``) that was killed leaves them: each process's ring
file (``.rings/``, 1.5 MB by default), its stacks file while empty (``.stacks/``), rank 0's job
and targets files (``.jobs/``). A file is removed only where its process is known to have ended:
it ran on this host and is gone. Event directories, and a stacks file with anything in it (a
fatal signal's stacks), are never touched.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from tether.cli.dump import JobFile
from tether.cli.main import plain_help
from tether.config import load_config
from tether.events.layout import dump_root
from tether.events.ringfile import RINGS_DIR
from tether.job.jobfile import JOBS_DIR, TARGETS_SUFFIX, ended_here, job_files, targets_file
from tether.job.stacks import STACKS_DIR

__all__ = ["Leftover", "leftovers", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class Leftover:
    path: Path
    why: str
    """Whose it was: "ring file of pid 123, ended"."""


def leftovers(dump_dir: Path) -> list[Leftover]:
    """The files in ``dump_dir`` whose process (or job) has ended on this host."""
    root = dump_root(dump_dir)
    return sorted([*_rings_and_stacks(root), *_jobs(root)], key=lambda f: str(f.path))


def _rings_and_stacks(root: Path) -> Iterator[Leftover]:
    for directory, suffix, what in ((RINGS_DIR, "", "ring file"), (STACKS_DIR, ".txt", "stacks")):
        for path in _files(root / directory):
            host, _, pid = path.name.removesuffix(suffix).rpartition("-")
            if not pid.isdigit() or not ended_here(host, int(pid)):
                continue
            if what == "stacks" and path.stat().st_size > 0:
                continue  # a fatal signal's stacks: evidence
            yield Leftover(path, f"{what} of pid {pid}, which has ended")


def _jobs(root: Path) -> Iterator[Leftover]:
    known = set()
    for path in job_files(root):
        try:
            job = JobFile.read(path)
        except Exception:  # unreadable: not ours to judge
            continue
        known.add(job.job_id)
        if job.gone():
            why = f"job {job.job_id}, whose rank 0 (pid {job.pid}) has ended"
            yield Leftover(path, why)
            target = targets_file(root, job.job_id)
            if target.is_file():
                yield Leftover(target, why)
    for path in _files(root / JOBS_DIR):
        job_id = path.name.removesuffix(TARGETS_SUFFIX)
        if path.name.endswith(TARGETS_SUFFIX) and job_id not in known:
            yield Leftover(path, f"targets of job {job_id}, which has no job file")


def _files(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_file()]
    except OSError:  # no such directory: nothing left there
        return []


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tether clean",
        description=plain_help(__doc__),
        epilog="Exit status: 0, or 1 where a file could not be removed.",
    )
    parser.add_argument(
        "dump_dir",
        nargs="?",
        type=Path,
        help="the dump directory (default: TETHER_DUMP_DIR, else the configured default)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    args = parser.parse_args(argv)
    dump_dir = args.dump_dir if args.dump_dir is not None else load_config().dump_dir
    found = leftovers(dump_dir)
    failed = 0
    size = 0
    for leftover in found:
        try:
            bytes_ = leftover.path.stat().st_size
            if not args.dry_run:
                leftover.path.unlink()
        except FileNotFoundError:  # its owner, or another clean, was first
            continue
        except OSError as exc:
            failed += 1
            print(f"could not remove {leftover.path}: {exc}")
            continue
        size += bytes_
        print(f"{'would remove' if args.dry_run else 'removed'} {leftover.path} ({leftover.why})")
    verb = "would free" if args.dry_run else "freed"
    print(
        f"tether clean: {len(found) - failed} file(s) in {dump_root(dump_dir)}, {verb} "
        f"{size / 1e6:.1f} MB"
    )
    return 1 if failed else 0
