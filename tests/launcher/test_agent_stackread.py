"""Reading a process's stacks from outside (py-spy, /proc) and at its fatal signal, on real child
processes: what the agent of `tether run` writes into ``stacks_<rank>.txt``."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests._jobs import worker_env
from tether.events.stacks import StacksHeader, parse_header, stacks_file
from tether.job.alarm import AlarmBoard
from tether.job.client import StoreAddress
from tether.job.stacks import (
    agent_key,
    collect_signal_stacks,
    fatal_block,
    process_start_time,
)
from tether.launcher.stackread import (
    answering,
    find_py_spy,
    proc_state,
    py_spy_stacks,
    to_faulthandler,
)
from tether.launcher.stackwatch import READ_BY_LAUNCHER, StackWatch

pytestmark = pytest.mark.timeout(60)

# Holds the GIL in libc's sleep(), which returns early (the seconds left) on a handled signal.
STUCK = """
    import ctypes, sys, threading
    from pathlib import Path
    from tether.job.stacks import arm_stack_signal
    path = arm_stack_signal(Path(sys.argv[1]), "h")
    threading.Thread(target=threading.Event().wait, name="side-thread", daemon=True).start()
    print(path, flush=True)
    left = ctypes.PyDLL(None).sleep(int(sys.argv[2]))  # STUCK-HERE
    print(f"left {left}", flush=True)
"""


@contextlib.contextmanager
def child(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=worker_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited with {proc.wait(10)} before it was ready"
    return line.strip()


def wait_in_syscall(pid: int, names: tuple[str, ...]) -> None:
    """Until the main thread is blocked in one of ``names`` (the kernel says; no guessing)."""
    deadline = time.monotonic() + 20
    while proc_state(pid).syscall not in names:
        assert time.monotonic() < deadline, proc_state(pid)
        time.sleep(0.01)


SLEEPS = ("nanosleep", "clock_nanosleep")


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_py_spy_reads_a_gil_holding_rank_without_waking_it(tmp_path: Path) -> None:
    py_spy = find_py_spy()
    assert py_spy is not None
    with child(STUCK, str(tmp_path), "3") as proc:
        first_line(proc)
        wait_in_syscall(proc.pid, SLEEPS)
        text = py_spy_stacks(proc.pid, py_spy)
        assert text.index('# thread "MainThread"') < text.index('# thread "side-thread"')
        main = text.split('# thread "side-thread"')[0]
        assert "holds the GIL" in main and "state sleeping, in " in main
        assert "#   native: pc in libc" in main  # the C library sleep() is in
        assert 'File "<string>", line 8 in <module>' in main  # the STUCK-HERE line
        assert "Thread 0x" in main and "(most recent call first):" in main
        # The sleep ran to its end: nothing interrupted it.
        assert first_line(proc) == "left 0"


def test_the_signal_fallback_interrupts_what_the_rank_was_doing(tmp_path: Path) -> None:
    # Why py-spy is preferred: faulthandler's signal ends libc's sleep early.
    with child(STUCK, str(tmp_path), "30") as proc:
        path = Path(first_line(proc))
        wait_in_syscall(proc.pid, SLEEPS)
        text = collect_signal_stacks(proc.pid, path, timeout=10.0)
        assert text is not None and 'File "<string>", line 8 in <module>' in text
        left = first_line(proc)
        assert left.startswith("left ") and int(left.split()[1]) > 0, left


def test_a_stopped_process_reads_as_stopped() -> None:
    with child("import time; print('up', flush=True); time.sleep(60)") as proc:
        first_line(proc)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while proc_state(proc.pid).state != "stopped":
            assert time.monotonic() < deadline, proc_state(proc.pid)
            time.sleep(0.01)
        proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(("how", "error"), [
    ("ctypes.string_at(0)", "Segmentation fault"),
    ("os.abort()", "Aborted"),
])  # fmt: skip
def test_a_fatal_signal_leaves_its_stacks_in_the_stack_file(
    tmp_path: Path, how: str, error: str
) -> None:
    script = f"""
        import ctypes, os, sys
        from pathlib import Path
        from tether.job.stacks import arm_stack_signal
        print(arm_stack_signal(Path(sys.argv[1]), "h"), flush=True)
        def user_code():
            {how}  # DIES-HERE
        user_code()
    """
    with child(script, str(tmp_path)) as proc:
        path = Path(first_line(proc))
        assert proc.wait(30) < 0
    block = fatal_block(path)
    assert block is not None and block.startswith(f"Fatal Python error: {error}"), block
    assert 'File "<string>", line 7 in user_code' in block


def test_no_fatal_block_in_a_file_of_signal_stacks_only(tmp_path: Path) -> None:
    path = tmp_path / "h-1.txt"
    path.write_text('Thread 0x01 (most recent call first):\n  File "a.py", line 1 in f\n')
    assert fatal_block(path) is None
    assert fatal_block(tmp_path / "missing.txt") is None


def test_py_spy_threads_in_faulthandlers_format() -> None:
    # Thread ids no process can have (past the kernel's pid_max): what /proc tells of a real
    # one (a kernel thread of pid 100, on some machines) is not part of the format.
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 100
    threads = [
        {"thread_id": 2, "os_thread_id": pid + 2, "thread_name": "worker", "frames": []},
        {
            "thread_id": 1,
            "os_thread_id": pid,
            "thread_name": "MainThread",
            "owns_gil": True,
            "frames": [
                {"name": "step", "filename": "/job/train.py", "line": 7},
                {"name": "<module>", "filename": "/job/train.py", "line": 30},
            ],
        },
    ]
    text = to_faulthandler(pid, threads)
    blocks = text.split("\n\n")
    assert blocks[0].splitlines()[1:] == [
        "Thread 0x0000000000000001 (most recent call first):",
        '  File "/job/train.py", line 7 in step',
        '  File "/job/train.py", line 30 in <module>',
    ]
    assert (
        blocks[0].startswith(f'# thread "MainThread": tid {pid}, ') and "holds the GIL" in blocks[0]
    )
    assert blocks[1].startswith(f'# thread "worker": tid {pid + 2}, ')


# -- the agent's watch, against a real store, for a silent "rank" that is a child process --------
def watch_a_silent_rank(
    store: dist.TCPStore, tmp_path: Path, py_spy: str, proc: subprocess.Popen[str]
) -> tuple[StacksHeader, str, str]:
    """Raise an alarm that ``proc`` (rank 1, running STUCK) cannot answer; return its stacks
    file's header and text, and its done key."""
    board = AlarmBoard(store)
    path = first_line(proc)
    wait_in_syscall(proc.pid, SLEEPS)
    board.publish_proc(1, {"host": "h", "pid": proc.pid, "stack_file": path,
                           "start_time": process_start_time(proc.pid)})  # fmt: skip
    watch = StackWatch(
        StoreAddress("127.0.0.1", store.port), world_size=2, dump_dir=tmp_path, host="h",
        local=lambda: {1: proc.pid}, alive=lambda pid: proc.poll() is None, py_spy=py_spy,
    )  # fmt: skip
    watch.start()
    try:
        assert store.check([agent_key("h")])  # the responders on host h leave rank 1 alone
        board.raise_alarm("manual", origin="cli", event_id="ev-manual")
        store.wait(["tether/alarm/1/done/1"], timedelta(seconds=30))
    finally:
        watch.close()
    text = stacks_file(tmp_path / "ev-manual", 1).read_text()
    header = parse_header(text)
    assert header is not None, text
    return header, text, store.get("tether/alarm/1/done/1").decode()


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_the_watch_reads_a_silent_rank_with_py_spy_and_answers_for_it(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    py_spy = find_py_spy()
    assert py_spy is not None
    with child(STUCK, str(tmp_path / "stacks"), "30") as proc:
        header, text, done = watch_a_silent_rank(store, tmp_path, py_spy, proc)
        assert proc.poll() is None and proc_state(proc.pid).syscall in SLEEPS  # still stuck
    assert (header.get("method"), header.get("when"), header.get("rank")) == (
        "py-spy",
        "unresponsive",
        1,
    )
    assert header.get("syscall") in SLEEPS and header.get("state") == "sleeping", header
    assert 'File "<string>", line 8 in <module>' in text
    assert done.startswith(READ_BY_LAUNCHER + " (py-spy; sleeping)"), done


def test_without_py_spy_the_watch_signals_the_rank_itself_and_says_so(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    with child(STUCK, str(tmp_path / "stacks"), "30") as proc:
        header, text, done = watch_a_silent_rank(store, tmp_path, "/nonexistent/py-spy", proc)
    assert (header.get("method"), header.get("when")) == ("faulthandler", "unresponsive")
    assert "py-spy did not run" in header.get("note", ""), header
    assert 'File "<string>", line 8 in <module>' in text
    assert done.startswith(READ_BY_LAUNCHER + " (faulthandler;"), done


def test_a_rank_whose_responder_is_answering_is_slow_not_stuck() -> None:
    responder = "/site/tether/watchdog/responder.py"

    def thread(*frames: tuple[str, str]) -> dict[str, object]:
        return {"frames": [{"name": n, "filename": f, "line": 1} for n, f in frames]}

    waiting = thread(("AlarmBoard.wait", "/site/tether/job/alarm.py"),
                     ("Responder._run", responder))  # fmt: skip
    dumping = thread(("write_dump", "/site/tether/recorder/writer.py"),
                     ("Responder.answer", responder), ("Responder._run", responder))  # fmt: skip
    user = thread(("answer", "/job/train.py"))  # the user's own function of that name
    assert answering([user, dumping])
    assert not answering([user, waiting])
