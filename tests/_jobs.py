"""Real multi-process jobs over a real TCPStore on port 0, for the integration tests."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

WORKERS = Path(__file__).parent / "workers"
RECORDER_VAR = "TETHER_RECORDER"
"""Which recorder the workers use (native or python): kept in their environment."""
REPO = Path(__file__).parent.parent
T = TypeVar("T")


@dataclasses.dataclass
class JobResult:
    returncodes: list[int]
    outputs: list[str]

    def check(self) -> None:
        for rank, (rc, out) in enumerate(zip(self.returncodes, self.outputs, strict=True)):
            assert rc == 0, f"rank {rank} exited {rc}:\n{out}"

    def results(self) -> list[dict[str, Any]]:
        """Each rank's ``RESULT <json>`` line, once every rank exited 0."""
        self.check()
        return [result_of(out) for out in self.outputs]


def result_of(output: str) -> dict[str, Any]:
    """The ``RESULT <json>`` line a worker printed."""
    line = next(x for x in output.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def script_result(script: str, timeout: float, **env: str) -> dict[str, Any]:
    """Run ``script`` in an interpreter of its own (tether patches torch in the process it is
    installed in; a process group is the process's own), which must succeed; what it printed as
    its ``RESULT``."""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
        env=worker_env(**env),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return result_of(proc.stdout)


def native_expected() -> bool:
    """Whether the workers record with the native core: it loads here, and is not turned off."""
    from tether.recorder.native import load

    return os.environ.get(RECORDER_VAR, "auto") != "python" and load()[0] is not None


def worker_env(**extra: str) -> dict[str, str]:
    # TETHER_RECORDER stays: make test runs the recorder's tests on both recorders.
    env = {k: v for k, v in os.environ.items() if k == RECORDER_VAR or not k.startswith("TETHER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launch(
    script: str,
    world_size: int,
    *args: str,
    port: int,
    dump_dir: Path,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> JobResult:
    """Run ``tests/workers/<script>`` as ``world_size`` processes and wait for all of them; each
    gets ``--rank R --world-size N --port P --dump-dir D`` followed by ``args``."""
    log_dir = Path(tempfile.mkdtemp(prefix="tether-test-logs-"))
    procs = start(script, world_size, *args, port=port, dump_dir=dump_dir, log_dir=log_dir, env=env)
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    outputs = [(log_dir / f"rank_{r}.log").read_text(errors="replace") for r in range(world_size)]
    return JobResult([p.returncode for p in procs], outputs)


def end(procs: Iterable[subprocess.Popen[Any]]) -> None:
    """Kill what is still running of ``procs``, reap them, close the pipes the test read."""
    for p in procs:
        p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def leftovers(dumps: Path) -> list[Path]:
    """What a job left in its dump directory beside its events: ring files, job and targets
    files, empty stacks files (a stacks file with anything in it is evidence, and stays)."""
    from tether.events.ringfile import RINGS_DIR
    from tether.job.jobfile import JOBS_DIR
    from tether.job.stacks import STACKS_DIR

    found = [p for sub in (RINGS_DIR, JOBS_DIR) for p in sorted((dumps / sub).glob("*"))]
    return found + [p for p in sorted((dumps / STACKS_DIR).glob("*")) if p.stat().st_size == 0]


def tether_cli(*args: str, results: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``tether <args>`` in a fresh interpreter, as a user runs it (2 minutes at most)."""
    env = worker_env(RESULT_DIR=str(results)) if results else worker_env()
    return subprocess.run(
        [sys.executable, "-m", "tether.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def until(condition: Callable[[], T], what: str | Callable[[], str], timeout: float = 60.0) -> T:
    """Poll ``condition`` (every 0.05 s at most) until it holds, and return what it returned
    then; after ``timeout``, fail saying ``what`` (a callable: made only then, a job's whole log
    say) never happened."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what} (after {timeout:g}s)")
        time.sleep(0.05)
    return got


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound for a moment, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_store() -> dist.TCPStore:
    """A TCPStore server on an ephemeral port, hosted by the test process."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def start(
    script: str,
    world_size: int,
    *args: str,
    port: int,
    dump_dir: Path,
    log_dir: Path,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Like :func:`launch`, without waiting: rank R writes its output to ``log_dir/rank_R.log``.
    The caller ends the processes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        with open(log_dir / f"rank_{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKERS / script),
                        *("--rank", str(rank), "--world-size", str(world_size)),
                        *("--port", str(port), "--dump-dir", str(dump_dir)),
                        *args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=worker_env(**(env or {})),
                )
            )
    return procs
