"""`tether run` when a job ends badly, and `tether dump`: real torchrun jobs as subprocesses.

The worker (tests/workers/longjob.py) writes ``ready_<rank>`` once it runs, then waits for the
test's files (``die``, ``stop``): every step is synchronised on those files, never on sleeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tether
from tests._jobs import WORKERS, closed_port, new_store, worker_env
from tether.cli.main import main
from tether.config import ENV_VARS
from tether.job.alarm import AlarmBoard
from tether.job.client import StoreAddress, connect
from tether.job.nodes import span
from tether.launcher.run import _first_failure, prepare
from tether.launcher.teardown import Incident, JobView, dump_before_teardown

pytestmark = pytest.mark.python_recorder

READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 45.0


@dataclasses.dataclass
class Job:
    proc: subprocess.Popen[bytes]
    nproc: int
    sync: Path
    dumps: Path
    log: Path

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(list(self.sync.glob("ready_*"))) < self.nproc:
            assert self.proc.poll() is None, f"the job ended before it ran:\n{self.output()}"
            assert time.monotonic() < deadline, f"the job never ran:\n{self.output()}"
            time.sleep(0.05)

    def finish(self) -> int:
        try:
            return self.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tether run did not exit:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, reason: str) -> list[Path]:
        return sorted(p for p in self.dumps.iterdir() if p.name.endswith(f"-{reason}"))

    def kill(self) -> None:
        """Leave nothing behind, whatever the test did."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for ready in self.sync.glob("ready_*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(ready.read_text()), signal.SIGKILL)


StartJob = Callable[..., Job]
"""``start_job(nproc, *worker_args)``: a running `tether run` job of tests/workers/longjob.py."""


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[StartJob]:
    jobs: list[Job] = []

    def start(nproc: int, *worker_args: str, launcher_args: tuple[str, ...] = ()) -> Job:
        sync, dumps, log = tmp_path / "sync", tmp_path / "dumps", tmp_path / "launcher.log"
        sync.mkdir()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "tether.cli.main", "run", "--standalone",
                    f"--nproc-per-node={nproc}", f"--dump-dir={dumps}", *launcher_args,
                    str(WORKERS / "longjob.py"), "--sync", str(sync), *worker_args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=worker_env(),
            )  # fmt: skip
        job = Job(proc, nproc, sync, dumps, log)
        jobs.append(job)
        job.wait_ready()
        return job

    yield start
    for job in jobs:
        job.kill()


def load_event(event: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.removeprefix("rank_")): tether.load_dump(p) for p in event.glob("rank_*")}


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("rank_*")}


def check_crash_event(job: Job, dead: dict[int, str]) -> None:
    [event] = job.events("crash")
    dumps = load_event(event)
    survivors = sorted(set(range(job.nproc)) - set(dead))
    assert sorted(dumps) == list(range(job.nproc)), job.output()  # the dead too: recovered
    for rank in dead:
        meta = dumps.pop(rank)["tether"]
        assert (meta["global_rank"], meta["reason"], meta["event"]) == (rank, "crash", event.name)
        assert meta["recovered"]["after_death"] is True, meta
        assert f"rank {rank}'s record was recovered from its ring file" in job.output()
    for rank, data in dumps.items():
        meta = data["tether"]
        assert (meta["global_rank"], meta["reason"], meta["event"]) == (rank, "crash", event.name)
        assert meta["alarm"]["origin"] == "launcher"
        assert meta["alarm"]["dead_ranks"] == {str(r): how for r, how in dead.items()}
        assert data["entries"][-1]["profiling_name"] == "gloo:all_reduce"  # it was running
    [(rank, how)] = dead.items()
    line = f"tether run: rank {rank} died ({how}); {span(survivors)} "
    assert f"{line}dumped into {event}" in job.output()


@pytest.mark.timeout(90)
def error_file(path: Path, message: str, innermost: str) -> str:
    """torchrun's error file (as ``@record`` writes it) of an exception raised in ``innermost``."""
    stack = f'Traceback (most recent call last):\n  File "{innermost}", line 7, in f\n    f()\n'
    info = {"py_callstack": stack, "timestamp": "1700000000"}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return str(path)


def test_the_failure_named_is_the_cause_not_the_first_in_torchruns_order(tmp_path: Path) -> None:
    # torchrun's failure times are whole seconds, ties to the lowest rank: rank 0, which died
    # of the broken connection, would be named for rank 3, which raised.
    collective = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    broken = error_file(tmp_path / "0.json", "RuntimeError: Connection closed by peer", collective)
    own = error_file(tmp_path / "3.json", "KeyError: 'shard_2'", "/job/train.py")

    def failure(exitcode: int, error: str = "") -> Any:
        return SimpleNamespace(exitcode=exitcode, timestamp=1_700_000_000, error_file=error)

    failures = {0: failure(1, broken), 1: failure(-signal.SIGTERM), 2: failure(1, broken)}
    exc = SimpleNamespace(failures=failures | {3: failure(1, own)})
    assert _first_failure(exc) == (3, exc.failures[3])
    assert _first_failure(exc, raised=[2]) == (2, failures[2])  # it said so: its own alarm
    exc = SimpleNamespace(failures=failures)  # every one a failed collective: the first
    assert _first_failure(exc) == (0, failures[0])
    assert _first_failure(exc, raised=[1]) == (0, failures[0])  # stopped by the teardown


def test_sigkilled_rank_survivors_dump_before_teardown(
    start_job: StartJob, capsys: pytest.CaptureFixture[str]
) -> None:
    job = start_job(3, "--victim", "1", "--die", "sigkill")
    assert main(["dump", f"--dump-dir={job.dumps}"]) == 0, capsys.readouterr()
    earlier = snapshot(job.dumps)
    assert len(earlier) == 3
    (job.sync / "die").touch()
    assert job.finish() != 0
    check_crash_event(job, {1: "signal SIGKILL"})
    assert {k: v for k, v in snapshot(job.dumps).items() if k in earlier} == earlier


@pytest.mark.timeout(90)
def test_survivors_dying_of_the_broken_collective_still_dump(start_job: StartJob) -> None:
    # The victim's death breaks the survivors' all_reduce within milliseconds, long before the
    # launcher polls its workers (every 2 s here): they linger at exit until the crash alarm has
    # been answered.
    job = start_job(
        3, "--victim", "2", "--die", "sigkill", "--with-victim",
        launcher_args=("--monitor-interval=2",),
    )  # fmt: skip
    (job.sync / "die").touch()
    assert job.finish() != 0
    check_crash_event(job, {2: "signal SIGKILL"})
    # The all_reduce that broke is recorded as failed where gloo raised (the rank talking to the
    # victim), and as still in flight on a rank that waits for a peer lingering at exit.
    [event] = job.events("crash")
    failed = 0
    for data in load_event(event).values():
        if "recovered" in data["tether"]:
            continue  # the victim's own record: it died between two of its operations
        last = data["entries"][-1]
        assert last["state"] == "started", last
        error = data["tether"]["failed"].get(str(last["record_id"]))
        assert last["retired"] == (error is not None), (last, error)
        failed += error is not None and "Connection closed by peer" in error
    assert failed >= 1


@pytest.mark.timeout(60)
def test_exiting_rank_is_recorded_with_its_exit_code(start_job: StartJob) -> None:
    job = start_job(2, "--victim", "1", "--die", "exit3")
    (job.sync / "die").touch()
    assert job.finish() != 0
    check_crash_event(job, {1: "exit code 3"})


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_every_rank_dumps_first(start_job: StartJob) -> None:
    job = start_job(2)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    [event] = job.events("signal")
    dumps = load_event(event)
    assert sorted(dumps) == [0, 1], job.output()
    for data in dumps.values():
        assert data["tether"]["reason"] == "signal"
        assert "SIGTERM" in data["tether"]["alarm"]["detail"]
    assert f"ranks 0-1 dumped into {event}" in job.output()


@pytest.mark.timeout(90)
def test_tether_dump_makes_every_rank_dump_into_a_new_event(
    start_job: StartJob, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = start_job(2)
    events = []
    for _ in range(2):
        assert main(["dump", f"--dump-dir={job.dumps}"]) == 0
        out = capsys.readouterr().out
        assert "rank 0: dumped" in out and "rank 1: dumped" in out, out
        [event] = [e for e in job.events("manual") if e not in events]
        assert str(event) in out
        assert sorted(load_event(event)) == [0, 1]
        events.append(event)
    first = snapshot(events[0])
    (job.sync / "stop").touch()
    assert job.finish() == 0, job.output()
    assert snapshot(events[0]) == first

    # The job has ended cleanly: rank 0 removed its job file.
    assert list((job.dumps / ".jobs").iterdir()) == []
    assert main(["dump", f"--dump-dir={job.dumps}"]) == 2
    assert "no running job in" in capsys.readouterr().err

    # A job whose rank 0 died without cleaning up (this host, a pid that is gone): one short
    # line, at once, saying what to do.
    stale = job.dumps / ".jobs" / "dead.json"
    stale.write_text(
        json.dumps({"job_id": "dead", "store_host": "127.0.0.1", "store_port": closed_port(),
                    "world_size": 2, "host": socket.gethostname(), "pid": job.proc.pid,
                    "started_ns": 1})
    )  # fmt: skip
    started = time.monotonic()
    assert main(["dump", f"--dump-dir={job.dumps}"]) == 2
    assert time.monotonic() - started < 5
    (err,) = capsys.readouterr().err.splitlines()
    assert err == (
        f"tether dump: error: job dead has ended without cleaning up (its job file is stale): "
        f"rm {stale}"
    )
    stale.unlink()

    # A job on another host whose store is gone: refused at once, not retried until a timeout.
    (job.dumps / ".jobs" / "elsewhere.json").write_text(
        json.dumps({"job_id": "elsewhere", "store_host": "127.0.0.1", "store_port": closed_port(),
                    "world_size": 2, "host": "another-host", "pid": 1, "started_ns": 1})
    )  # fmt: skip
    started = time.monotonic()
    assert main(["dump", f"--dump-dir={job.dumps}", "--job=elsewhere"]) == 2
    assert time.monotonic() - started < 5
    assert "nothing answers at the job's store address" in capsys.readouterr().err

    assert main(["dump", f"--dump-dir={tmp_path / 'nothing'}"]) == 2
    assert "no running job in" in capsys.readouterr().err


# -- the launcher's side, against a real store in this process ------------------------------------
def answer_as(port: int, rank: int) -> threading.Thread:
    """A stand-in for another node's rank: its responder dumps when the first alarm comes."""

    def answer() -> None:
        board = AlarmBoard(connect("127.0.0.1", port))
        alarm = board.wait(1, timeout=10)
        assert alarm is not None
        board.mark_done(alarm.epoch, rank, "dump")

    thread = threading.Thread(target=answer, name=f"fake-rank-{rank}", daemon=True)
    thread.start()
    return thread


def test_launcher_waits_only_for_live_ranks_and_names_the_silent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = new_store()
    board = AlarmBoard(store)
    board.publish_proc(0, {"host": "other", "pid": 10})  # another node's: answers
    board.publish_proc(2, {"host": "here", "pid": 99})  # a previous attempt's pid: not waited for
    board.publish_proc(3, {"host": "other", "pid": 30})  # another node's: never answers
    answering = answer_as(store.port, 0)
    job = JobView(StoreAddress("127.0.0.1", store.port), world_size=4, local_pids={1: 11, 2: 22})
    incident = Incident("crash", "1 worker(s) failed", {1: "signal SIGKILL"})
    line = dump_before_teardown(job, incident, dump_dir=tmp_path, grace=3.0, alive=lambda _: True)
    answering.join(5)
    alarm = board.get(1)
    assert alarm is not None
    assert (alarm.reason, alarm.origin, alarm.dead_ranks) == (
        "crash",
        "launcher",
        {"1": "signal SIGKILL"},
    )
    assert line == (
        "tether run: rank 1 died (signal SIGKILL); rank 0 dumped on its own node "
        f"(event {tmp_path / alarm.event_id}); rank 3 did not answer within 3s"
    )
    assert line in capsys.readouterr().err


def test_launcher_stops_waiting_for_a_rank_that_exits(tmp_path: Path) -> None:
    store = new_store()
    board = AlarmBoard(store)
    board.publish_proc(0, {"host": "other", "pid": 10})
    board.publish_proc(2, {"host": "here", "pid": 22})  # exits instead of answering
    answering = answer_as(store.port, 0)
    exits_at = time.monotonic() + 0.5
    job = JobView(StoreAddress("127.0.0.1", store.port), world_size=3, local_pids={1: 11, 2: 22})
    started = time.monotonic()
    line = dump_before_teardown(
        job,
        Incident("crash", "1 worker(s) failed", {1: "exit code 1"}),
        dump_dir=tmp_path,
        grace=30.0,
        alive=lambda pid: time.monotonic() < exits_at,
    )
    assert time.monotonic() - started < 5  # not the 30 s grace
    answering.join(5)
    assert line.endswith("; rank 2 exited before dumping"), line
    assert board.done(1, 3) == {0: "dump", 2: "exited before answering"}


def test_launcher_goes_on_when_the_store_is_gone(tmp_path: Path) -> None:
    job = JobView(StoreAddress("127.0.0.1", closed_port()), world_size=2, local_pids={0: 1})
    started = time.monotonic()
    line = dump_before_teardown(
        job, Incident("signal", "the launcher received SIGTERM"), dump_dir=tmp_path
    )
    assert time.monotonic() - started < 5
    assert "could not be asked to dump: nothing answers at the job's store address" in line


def test_run_passes_watchdog_flags_to_the_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)  # prepare() sets them; undone after the test
    prepare([
        f"--dump-dir={tmp_path}", "--hang-timeout=7.5", "--on-hang=dump",
        "--debug-host=0.0.0.0", "--debug-port=off", "--standalone", "x.py",
    ])  # fmt: skip
    assert {
        v: os.environ[v]
        for v in ENV_VARS
        if v.startswith(("TETHER_HANG", "TETHER_ON", "TETHER_DEBUG"))
    } == {
        "TETHER_HANG_TIMEOUT": "7.5",
        "TETHER_ON_HANG": "dump",
        "TETHER_DEBUG_HOST": "0.0.0.0",
        "TETHER_DEBUG_PORT": "off",
    }
    prepare([f"--dump-dir={tmp_path}", "--debug-port=4321", "--standalone", "x.py"])
    assert os.environ["TETHER_DEBUG_PORT"] == "4321"
    assert main(["run", "--debug-port=http", "--standalone", "x.py"]) == 2
    assert "--debug-port must be a port number" in capsys.readouterr().err
    assert main(["run", "--hang-timeout=0", "--standalone", "x.py"]) == 2
    assert "hang_timeout must be a finite, positive number" in capsys.readouterr().err
