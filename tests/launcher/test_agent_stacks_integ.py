"""`tether run` on ranks that cannot answer an alarm: stacks read from outside by the launcher's
agent (py-spy, the rank undisturbed), stacks at a fatal signal, a frozen rank ended at once, and
nothing of the job left running after an abort. Real 2- and 3-rank jobs of
tests/workers/agent_faults.py; each step waits on the job's files or its exit, never a sleep."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._jobs import WORKERS, worker_env
from tether.events.stacks import StacksHeader, parse_header, stacks_file
from tether.job.alarm import HANG_EXIT_CODE

SCRIPT = WORKERS / "agent_faults.py"
EXIT_TIMEOUT_S = 60.0
LAUNCHER = (
    "--standalone", "--hang-timeout=2", "--debug-port=off", "--monitor-interval=0.2",
)  # fmt: skip


def line_of(marker: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"# {marker}" in text)


class Job:
    def __init__(
        self, tmp_path: Path, nproc: int, fault: str, *extra: str, launcher: tuple[str, ...] = ()
    ) -> None:
        self.sync, self.dumps, self.log = tmp_path / "sync", tmp_path / "dumps", tmp_path / "log"
        self.sync.mkdir()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "tether.cli.main", "run", *LAUNCHER, *launcher,
                    f"--nproc-per-node={nproc}", f"--dump-dir={self.dumps}", str(SCRIPT),
                    "--sync", str(self.sync), "--fault", fault, "--culprit", "1", *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=worker_env(),
            )  # fmt: skip

    def finish(self) -> int:
        try:
            return self.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tether run did not exit:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def last_line(self) -> str:
        return self.output().rstrip("\n").rsplit("\n", 1)[-1]

    def event(self, reason: str) -> Path:
        events = [p for p in self.dumps.iterdir() if p.name.endswith(f"-{reason}")]
        assert len(events) == 1, (events, self.output())
        return events[0]

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.sync.glob("ready_*")]

    def kill(self) -> None:
        """Leave nothing behind, whatever the test did."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[list[Job]]:
    jobs: list[Job] = []
    yield jobs
    for j in jobs:
        j.kill()


def start(
    jobs: list[Job],
    tmp_path: Path,
    nproc: int,
    fault: str,
    *extra: str,
    launcher: tuple[str, ...] = (),
) -> Job:
    jobs.append(Job(tmp_path, nproc, fault, *extra, launcher=launcher))
    return jobs[-1]


def stacks_of(event: Path, rank: int) -> tuple[StacksHeader, str]:
    text = stacks_file(event, rank).read_text()
    header = parse_header(text)
    assert header is not None, text
    return header, text


def check_hang_abort(job: Job, silent: int) -> Path:
    """The job was aborted after a hang (exit 75) in which rank ``silent`` never answered: the
    others dumped, it did not, and the last line names the event and the next command."""
    assert job.finish() == HANG_EXIT_CODE, job.output()
    event = job.event("hang")
    assert sorted(p.name for p in event.glob("rank_*")) == ["rank_0", "rank_2"], job.output()
    assert job.last_line() == (
        f"tether run: aborted after a hang; event {event}; next: tether analyze {event}"
    )
    # Killed by tether as soon as the others had left, not by torch after its 30 s grace.
    assert f"rank {silent} did not answer the hang alarm (" in job.output()
    assert "killed it (SIGKILL)" in job.output()
    assert "Unable to shutdown process" not in job.output()
    return event


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_stuck_in_c_holding_the_gil_is_read_by_py_spy_and_stays_stuck(
    job: list[Job], tmp_path: Path
) -> None:
    j = start(job, tmp_path, 3, "gil")
    event = check_hang_abort(j, 1)
    header, text = stacks_of(event, 1)
    assert (header.get("method"), header.get("when"), header.get("rank")) == (
        "py-spy",
        "unresponsive",
        1,
    )
    assert header.get("syscall") in ("nanosleep", "clock_nanosleep"), header
    assert f'agent_faults.py", line {line_of("STUCK:gil")} in misbehave' in text
    assert '# thread "MainThread"' in text and "holds the GIL" in text
    # Undisturbed: libc's sleep returns early on a handled signal, and the rank would then have
    # joined the all_reduce, answered the alarm and dumped. It was still in the sleep when
    # tether killed it.
    assert "rank 1 did not answer the hang alarm (sleeping); killed it (SIGKILL)" in j.output()
    assert "faulthandler" not in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_on_hang_dump_prints_the_event_and_who_answered(job: list[Job], tmp_path: Path) -> None:
    # The job goes on after the dumps (the culprit still stuck): the line is the user's only
    # sign of the event. Then the launcher is stopped, and ends the stuck rank itself.
    j = start(job, tmp_path, 3, "gil", launcher=("--on-hang=dump",))
    prefix = "tether run: hang alarm from"
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while not (lines := [x for x in j.output().splitlines() if x.startswith(prefix)]):
        assert j.proc.poll() is None and time.monotonic() < deadline, j.output()
        time.sleep(0.1)
    event = j.event("hang")
    syscall = stacks_of(event, 1)[0].get("syscall")
    assert lines[0].endswith(
        f": 2 of 3 ranks dumped into {event}; rank 1 did not answer (sleeping in {syscall}): "
        "stacks read by py-spy"
    ), lines
    j.proc.send_signal(signal.SIGTERM)
    assert j.finish() == 128 + signal.SIGTERM, j.output()
    assert "rank 1 did not answer the signal alarm (sleeping); killed it (SIGKILL)" in j.output()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stopped_rank_ends_the_job_at_once_with_its_state(job: list[Job], tmp_path: Path) -> None:
    j = start(job, tmp_path, 3, "stop")
    event = check_hang_abort(j, 1)
    header, text = stacks_of(event, 1)
    assert (header.get("method"), header.get("state")) == ("py-spy", "stopped"), header
    assert f'agent_faults.py", line {line_of("STUCK:stop")} in misbehave' in text
    out = j.output()
    assert "rank 1 did not answer the hang alarm (stopped); killed it (SIGKILL)" in out
    # Every line counts who dumped: the agent's, and each aborting rank's.
    assert "tether run: hang alarm from rank " in out
    assert f"2 of 3 ranks dumped into {event}; rank 1 did not answer (stopped" in out
    assert "stacks read by py-spy" in out
    for rank in (0, 2):
        [line] = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] tether: hang")]
        assert f"2 of 3 ranks dumped into {event}; rank 1 did not dump: stacks read by" in line
    assert "every rank's dump is in" not in out


@pytest.mark.timeout(120)
def test_rank_dying_of_a_fatal_signal_leaves_its_stacks_in_the_crash_event(
    job: list[Job], tmp_path: Path
) -> None:
    # SIGABRT, as gloo's terminate() ends a rank; SIGSEGV writes the same way (see
    # tests/launcher/test_agent_stackread.py), and the fault corpus has a job of each.
    fault, name, error = "abort", "SIGABRT", "Aborted"
    j = start(job, tmp_path, 2, fault)
    assert j.finish() == 1, j.output()
    event = j.event("crash")
    assert (event / "rank_0").exists(), j.output()
    header, text = stacks_of(event, 1)
    assert (header.get("method"), header.get("when"), header.get("signal")) == (
        "fatal-signal",
        "death",
        name,
    )
    assert header.get("event") == event.name and header.get("rank") == 1
    body = text.split("\n", 1)[1]
    assert body.startswith(f"Fatal Python error: {error}"), body
    assert f'agent_faults.py", line {line_of(f"STUCK:{fault}")} in misbehave' in body
    assert f"rank 1's stacks at its {name} are in {event}" in j.output()
    assert j.last_line() == (
        f"tether run: rank 1 failed (signal {name}); event {event}; next: tether analyze {event}"
    )


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.timeout(120)
def test_after_an_abort_a_ranks_child_process_is_gone(job: list[Job], tmp_path: Path) -> None:
    j = start(job, tmp_path, 3, "subprocess")
    try:
        assert j.finish() == HANG_EXIT_CODE, j.output()
        child = int((j.sync / "child").read_text())
        # The launcher killed the worker's process group after the teardown; the kernel may take
        # a moment to deliver the signal and let the child go.
        deadline = time.monotonic() + 5
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), f"rank 1's child {child} outlived the job"
        event = j.event("hang")
        # The rank blocked in subprocess.run released the GIL: it answered and dumped itself.
        assert sorted(p.name for p in event.glob("rank_*")) == ["rank_0", "rank_1", "rank_2"]
        assert j.last_line().endswith(f"next: tether analyze {event}")
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int((j.sync / "child").read_text()), signal.SIGKILL)
