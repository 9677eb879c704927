"""A job leaves nothing behind in DUMP_DIR: on a clean exit rank 0 removes the job file and the
Prometheus targets file, every process its stacks file; after a failure `tether run` removes them
and the ring files once the job is over (a real `tether run`)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import WORKERS, end, launch, leftovers, tether_cli, worker_env


def run_cleanup_job(tmp_path: Path, *, nproc: int, **env: str) -> subprocess.CompletedProcess[str]:
    """tests/workers/cleanup.py under a real `tether run`, dumping into ``tmp_path/dumps``."""
    return subprocess.run(
        [sys.executable, "-m", "tether.cli.main", "run", "--standalone",
         f"--nproc-per-node={nproc}", f"--dump-dir={tmp_path / 'dumps'}",
         str(WORKERS / "cleanup.py")],
        capture_output=True, text=True, timeout=120,
        env=worker_env(RESULT_DIR=str(tmp_path), **env),
    )  # fmt: skip


@pytest.mark.timeout(150)
def test_a_clean_exit_leaves_no_job_targets_or_stacks_files(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    proc = run_cleanup_job(tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((tmp_path / "files.json").read_text())
    # While it ran: the job file, the targets file with both ranks, one stacks file per rank.
    (job,) = [name for name in seen["jobs"] if not name.endswith(".targets.json")]
    assert seen["jobs"] == sorted([job, job.replace(".json", ".targets.json")])
    ((group,),) = seen["targets"]
    assert len(group["targets"]) == 2 and group["labels"]["tether_job_id"] == job[: -len(".json")]
    assert len(seen["stacks"]) == 2
    left = sorted(str(p.relative_to(dumps)) for p in dumps.rglob("*") if p.is_file())
    assert left == [], proc.stderr


@pytest.mark.timeout(90)
def test_a_crash_after_the_cleanup_still_shows_its_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "crash_at_shutdown.py")],
        capture_output=True, text=True, timeout=60,
        env=worker_env(TETHER_DUMP_DIR=str(tmp_path), TETHER_DEBUG_PORT="off"),
    )  # fmt: skip
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    # The empty stacks file is gone, and faulthandler wrote to stderr, not into the removed file.
    assert list(tmp_path.rglob("*.txt")) == []
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr


@pytest.mark.timeout(150)
def test_a_failed_sys_exit_is_a_crash_and_the_job_leaves_nothing_behind(tmp_path: Path) -> None:
    # sys.exit(1) never reaches the excepthook: the bootstrap tells tether the exit failed, so
    # the rank keeps its files for its peers; tether run removes them once the job is over.
    dumps = tmp_path / "dumps"
    proc = run_cleanup_job(tmp_path, nproc=1, EXIT_CODE="1")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "rank 0 died (exit code 1)" in proc.stderr, proc.stderr
    assert [p.name for p in dumps.iterdir() if p.is_dir() and p.name.endswith("-crash")]
    assert leftovers(dumps) == [], (leftovers(dumps), proc.stderr)


@pytest.mark.timeout(150)
def test_ranks_end_cleanly_when_the_rank_hosting_the_store_ends_first(tmp_path: Path) -> None:
    """A rank's own threads never sit in the store while its interpreter finalizes: the store's
    host (rank 0) leaving then aborted the process ("terminate called without an active
    exception"), in every run of this job before the responder stopped blocking there."""
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = launch("store_host_exits.py", 4, port=port, dump_dir=tmp_path / "dumps")
    job.check()
    for rank, out in enumerate(job.outputs):
        assert f"rank {rank} done" in out and "terminate called" not in out, out


# Two ranks of a job started without tether run, which their user then kills (SIGKILL).
KILLED_RANK = """
import sys, threading
from datetime import timedelta
import torch, torch.distributed as dist
import tether
port, rank = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
tether.init_process_group("gloo", store=store, rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
print("ready", flush=True)
threading.Event().wait(120)
"""


@pytest.mark.timeout(120)
def test_tether_clean_removes_what_killed_processes_left_and_nothing_else(
    store: Any, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    env = worker_env(TETHER_DUMP_DIR=str(dumps), TETHER_DEBUG_PORT="off")
    command = [sys.executable, "-c", KILLED_RANK, str(store.port)]
    ranks = [
        subprocess.Popen([*command, str(r)], stdout=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        running = leftovers(dumps)  # a ring file and a stacks file each, and rank 0's job file
        assert len(running) == 5, running
        listed = tether_cli("clean", str(dumps), "--dry-run")
        assert listed.returncode == 0 and "0 file(s)" in listed.stdout, listed.stdout
    finally:
        end(ranks)
    event = dumps / "20261205T000000.000000Z-manual"  # events and evidence stay
    event.mkdir()
    (event / "rank_0").write_text("{}")
    evidence = dumps / ".stacks" / f"{socket.gethostname()}-{ranks[0].pid}.txt"
    evidence.write_text("Fatal Python error: Segmentation fault\n")
    cleaned = tether_cli("clean", str(dumps))
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert leftovers(dumps) == [], (leftovers(dumps), cleaned.stdout)
    assert f"{len(running) - 1} file(s)" in cleaned.stdout, cleaned.stdout
    assert evidence.is_file() and (event / "rank_0").is_file()
