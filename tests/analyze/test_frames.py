"""One frame filter for the recorder, `tether analyze` and `tether show`: the user's own line
first; frameworks before torch; the user frame kept past the recorder's depth limit."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from tests._fr_synth import Synth
from tests._jobs import result_of, worker_env
from tether.analyze.stacks import culprit_stack
from tether.cli.show import summarize
from tether.events.frames import (
    ELIDED,
    FRAMEWORK,
    LIBRARY,
    TETHER,
    USER,
    frame_kind,
    pick,
    stacks_text_main_thread,
)
from tether.events.load import load_dump
from tether.events.stacks import format_header
from tether.recorder import frames as recorder_frames

SITE = "/opt/venv/lib/python3.11/site-packages"


def fr(filename: str, line: int = 1, name: str = "f") -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


@pytest.mark.parametrize(
    ("filename", "kind"),
    [
        (subprocess.__file__, LIBRARY),  # this interpreter's standard library
        (threading.__file__, LIBRARY),
        (str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"), LIBRARY),
        ("/usr/lib/python3.12/subprocess.py", LIBRARY),  # another machine's
        ("/opt/conda/lib/python3.10/concurrent/futures/thread.py", LIBRARY),
        ("C:\\Python311\\Lib\\subprocess.py", LIBRARY),
        ("/home/x/Lib/train.py", USER),
        ("<frozen runpy>", LIBRARY),
        (f"{SITE}/torch/distributed/distributed_c10d.py", LIBRARY),
        (f"{SITE}/torch/_tensor.py", LIBRARY),
        ("/home/dev/pytorch/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", LIBRARY),
        (f"{SITE}/transformers/trainer.py", FRAMEWORK),
        (f"{SITE}/lightning/pytorch/loops/fit_loop.py", FRAMEWORK),
        ("/usr/lib/python3/dist-packages/accelerate/accelerator.py", FRAMEWORK),
        (f"{SITE}/deepspeed/runtime/engine.py", FRAMEWORK),
        (f"{SITE}/six.py", FRAMEWORK),
        (f"{SITE}/tether/runtime.py", TETHER),  # the excepthook, the exit linger
        (f"{SITE}/tether/watchdog/monitor.py", TETHER),
        ("/h/tether/recorder/frames.py", TETHER),
        (recorder_frames.__file__, TETHER),
        (f"{SITE}/tether/demo/job.py", USER),  # tether's demo job is the user's code
        (str(Path(recorder_frames.__file__).parents[1] / "demo" / "job.py"), USER),
        ("/home/x/tether/train.py", USER),  # a checkout named like the package keeps its frames
        ("/home/x/torch/train.py", USER),
        ("/src/train.py", USER),
        ("<string>", USER),  # python -c
    ],
)
def test_frame_kinds(filename: str, kind: int) -> None:
    assert frame_kind(filename) == kind


def test_a_rank_blocked_in_subprocess_run_is_shown_at_the_users_line() -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [
        fr(f"{stdlib}/selectors.py", 415, "select"),
        fr(f"{stdlib}/subprocess.py", 2004, "_communicate"),
        fr(f"{stdlib}/subprocess.py", 550, "run"),
        fr("/src/prep.py", 12, "tokenize"),
        fr("/src/train.py", 80, "main"),
    ]
    assert pick(frames) == frames[3]


def test_framework_frames_are_passed_over_for_the_users_and_beat_torchs() -> None:
    torch_frames = [
        fr(f"{SITE}/torch/distributed/c10d_logger.py", 81, "wrapper"),
        fr(f"{SITE}/torch/nn/parallel/distributed.py", 1600, "forward"),
    ]
    hf = [
        fr(f"{SITE}/accelerate/accelerator.py", 2100, "backward"),
        fr(f"{SITE}/transformers/trainer.py", 3500, "training_step"),
    ]
    user = fr("/work/finetune.py", 280, "main")
    assert pick([*torch_frames, *hf, user]) == user
    # No user frame (the script is a framework's entry point): the framework's innermost line.
    assert pick([*torch_frames, *hf, fr("<frozen runpy>", 88, "_run_code")]) == hf[0]
    # Only torch and tether: torch's, not tether's own.
    tether_frame = fr(f"{SITE}/tether/recorder/frames.py", 9, "python_stacks")
    assert pick([tether_frame, *torch_frames]) == torch_frames[0]
    assert pick([tether_frame]) == tether_frame
    assert pick([]) is None


def test_stacks_files_are_read_with_their_header_and_comments() -> None:
    # As the launcher's py-spy reader writes them: each thread's name in a comment above it.
    body = textwrap.dedent(
        """\
        # thread "loader": tid 12, state sleeping
        Thread 0x00007f0000000002 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 320 in wait
          File "/src/loader.py", line 5 in fetch

        # thread "MainThread": tid 11, state sleeping, in nanosleep
        # native: __GI___clock_nanosleep (libc.so.6)
        Thread 0x00007F0000000001 (most recent call first):
          File "/usr/lib/python3.11/subprocess.py", line 2004 in _communicate
          File "/src/train.py", line 77 in step
          File "/src/train.py", line 90 in run
        """
    )
    header = format_header({"rank": 3, "method": "py-spy", "when": "unresponsive",
                            "state": "sleeping", "syscall": "nanosleep"})  # fmt: skip
    frames, source = stacks_text_main_thread(header + body)
    assert pick(frames) == {"filename": "/src/train.py", "line": 77, "name": "step"}
    assert source == "py-spy (read from outside; the rank was sleeping in nanosleep)"

    stopped = format_header({"method": "py-spy", "state": "stopped"})
    assert stacks_text_main_thread(stopped + body)[1] == (
        "py-spy (read from outside; the rank was stopped)"
    )
    death = format_header({"method": "fatal-signal", "when": "death", "signal": "SIGABRT"})
    assert stacks_text_main_thread(death + body)[1] == "faulthandler at its death (SIGABRT)"
    peer = format_header({"method": "faulthandler", "when": "unresponsive"})
    assert stacks_text_main_thread(peer + body)[1] == "faulthandler (a peer signalled it)"

    # No header, no thread names (faulthandler): the main thread is the one running <module>.
    plain = textwrap.dedent(
        """\
        Thread 0x0000000000000002 (most recent call first):
          File "/src/worker.py", line 3 in loop
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
        Current thread 0x0000000000000001 (most recent call first):
          File "/src/train.py", line 12 in spin
          File "/src/train.py", line 30 in <module>
        """
    )
    frames, source = stacks_text_main_thread(plain)
    assert pick(frames) == {"filename": "/src/train.py", "line": 12, "name": "spin"}
    assert source == "faulthandler (a peer signalled it)"
    # A name in a comment inside a block counts as well, over the <module> rule.
    named = plain.replace(
        '(most recent call first):\n  File "/src/worker.py"',
        '(most recent call first):\n# thread MainThread\n  File "/src/worker.py"',
    )
    assert pick(stacks_text_main_thread(named)[0])["filename"] == "/src/worker.py"  # type: ignore[index]
    assert stacks_text_main_thread("# tether-stacks {}\n# nothing could be read\n") == ([], "")


def test_symbolize_keeps_the_frame_past_the_limit_with_what_was_elided() -> None:
    ns: dict[str, Any] = {}
    src = "def deep(n, fn):\n    return fn() if n == 0 else deep(n - 1, fn)\n"
    exec(compile(src, f"{SITE}/torch/distributed/_deep.py", "exec"), ns)

    def capture_here() -> Any:
        return recorder_frames.capture(4, skip=0)

    def user_code() -> Any:
        return ns["deep"](10, capture_here)  # LINE:user

    handle = user_code()
    (stack,) = recorder_frames.symbolize([handle], 4)
    # capture_here (user code, innermost), 3 torch frames, then the user frame past the limit.
    assert [f["name"] for f in stack] == ["capture_here", "deep", "deep", "deep", "user_code"]
    assert stack[-1][ELIDED] == 8 and ELIDED not in stack[-2]
    assert stack[-1]["line"] == _line_of(Path(__file__), "LINE:user")
    # The user frame right past the limit: kept, nothing elided.
    (edge,) = recorder_frames.symbolize([ns["deep"](2, capture_here)], 4)
    assert [f["name"] for f in edge][-2:] == [
        "deep",
        "test_symbolize_keeps_the_frame_past_the_limit_with_what_was_elided",
    ]
    assert edge[-1][ELIDED] == 0 and len(edge) == 5
    # A stack whose outermost kept frame is the user's is not walked on.
    (short,) = recorder_frames.symbolize([recorder_frames.capture(3, skip=0)], 3)
    assert len(short) == 3 and not any(ELIDED in f for f in short)


def test_a_remembered_walk_is_checked_against_the_stack_it_lands_on() -> None:
    ns: dict[str, Any] = {}
    src = "def deep(n, fn):\n    return fn() if n == 0 else deep(n - 1, fn)\n"
    exec(compile(src, f"{SITE}/torch/distributed/_deep2.py", "exec"), ns)

    def capture_here() -> Any:
        return recorder_frames.capture(4, skip=0)

    def near() -> Any:
        return ns["deep"](10, capture_here)

    def far() -> Any:
        return ns["deep"](14, capture_here)

    def names(handle: Any) -> list[tuple[str, int | None]]:
        (stack,) = recorder_frames.symbolize([handle], 4)
        return [(f["name"], f.get(ELIDED)) for f in stack]

    # The same call site past the limit (deep's recursion line), reached 8 and 12 frames below.
    assert names(near())[-1] == ("near", 8)
    assert names(near())[-1] == ("near", 8)  # as remembered
    assert names(far())[-1] == ("far", 12)  # the remembered walk lands elsewhere: walked again
    assert names(near())[-1] == ("near", 8)

    # A thread with no frame outside torch and the standard library: nothing kept past the
    # limit, the second time from memory, and the main thread's stack still walked in full.
    got: list[Any] = []

    def capture_kept() -> None:
        got.append(recorder_frames.capture(4, skip=0))

    for _ in range(2):
        t = threading.Thread(target=ns["deep"], args=(10, capture_kept), name="torch-only")
        t.start()
        t.join(10)
        assert not t.is_alive()
    assert [len(names(h)) for h in got] == [4, 4], [names(h) for h in got]
    assert names(near())[-1] == ("near", 8)


def _line_of(path: Path, marker: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


# A real recorded job of world size 1: an op issued 30 torch frames below the user's code, then
# a dump taken while the main thread is blocked in subprocess.run.
JOB = """
import json, os, subprocess, sys, threading
from datetime import timedelta
import torch, torch.distributed as dist
import tether

# Stand-in for FSDP2's backward: code whose file is torch's, 30 frames deep, issuing the op.
SRC = "import torch.distributed as dist\\n" + (
    "def deep(n, t):\\n    return dist.all_reduce(t) if n == 0 else deep(n - 1, t)\\n"
)
ns = {}
exec(compile(SRC, "/v/site-packages/torch/distributed/fsdp/_deep.py", "exec"), ns)


def step():
    ns["deep"](30, torch.ones(2))  # LINE:step


def dump_once_the_child_runs(fifo, stdin_w):
    try:
        with open(fifo) as f:  # opens once the child opens it: the main thread is in run()
            f.read(1)
        out["dump"] = str(tether.dump(reason="manual"))
    finally:
        os.close(stdin_w)  # the child reads its stdin to the end, then exits


def wait_for_child(fifo):
    r, w = os.pipe()
    dumper = threading.Thread(target=dump_once_the_child_runs, args=(fifo, w), name="dumper")
    dumper.start()
    child = "import sys; open(sys.argv[1], 'w').write('x'); sys.stdin.read()"
    subprocess.run([sys.executable, "-c", child, fifo], stdin=r, timeout=60)  # LINE:run
    os.close(r)
    dumper.join(60)


out = {}
dump_dir = sys.argv[1]
store = dist.TCPStore(
    "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
)
tether.init_process_group("gloo", store=store, rank=0, world_size=1, dump_dir=dump_dir)
step()
os.makedirs(dump_dir, exist_ok=True)
fifo = os.path.join(dump_dir, "started.fifo")
os.mkfifo(fifo)
wait_for_child(fifo)
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def deep_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the job's script, its event directory)."""
    tmp = tmp_path_factory.mktemp("deep")
    script = tmp / "train.py"
    script.write_text(JOB)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp / "dumps")],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(TETHER_STACK_DEPTH="16"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return script, Path(result_of(proc.stdout)["dump"]).parent


@pytest.mark.timeout(150)
def test_an_op_30_torch_frames_below_the_user_keeps_the_users_line(
    deep_job: tuple[Path, Path],
) -> None:
    script, event = deep_job
    data = load_dump(event / "rank_0")
    (op,) = [e for e in data["entries"] if e["profiling_name"] == "gloo:all_reduce"]
    frames = op["frames"]
    assert len(frames) == 17, frames  # the 16 of TETHER_STACK_DEPTH, and the user's past them
    assert all(frame_kind(f["filename"]) == LIBRARY for f in frames[:16])
    user = frames[-1]
    assert (user["filename"], user["line"], user["name"]) == (
        str(script),
        _line_of(script, "LINE:step"),
        "step",
    )
    assert user[ELIDED] > 0 and not any(ELIDED in f for f in frames[:-1])
    # show lists the op at the user's line
    assert f"train.py:{_line_of(script, 'LINE:step')} (step)" in summarize(event)


@pytest.mark.timeout(150)
def test_show_and_analyze_name_the_same_line_of_a_rank_in_subprocess_run(
    deep_job: tuple[Path, Path],
) -> None:
    script, event = deep_job
    run_line = _line_of(script, "LINE:run")
    where, traceback, source = culprit_stack(event, 0, str(event / "rank_0"))
    assert where == f"{script}:{run_line} in wait_for_child", traceback
    assert source == "MainThread"
    assert any("subprocess.py" in line for line in traceback)  # the frames are all still there
    text = summarize(event)
    assert f"main thread at train.py:{run_line} (wait_for_child)" in text, text


def test_a_main_thread_only_in_tethers_exit_linger_gives_its_last_operations_line(
    tmp_path: Path,
) -> None:
    job = Synth(2)
    job.collective("all_reduce")
    job.collective("all_reduce", skip=[1])
    lingering = [
        fr(f"{sysconfig.get_paths()['stdlib']}/threading.py", 324, "wait"),
        fr(f"{SITE}/tether/watchdog/responder.py", 200, "wait_answered"),
        fr(f"{SITE}/tether/watchdog/monitor.py", 131, "linger"),
        fr(f"{SITE}/tether/runtime.py", 222, "_at_exit"),
    ]
    job.stacks[1] = [{"thread_id": 1, "thread_name": "MainThread", "daemon": False,
                      "frames": lingering}]  # fmt: skip
    event = job.write(tmp_path / "ev")
    where, _, source = culprit_stack(event, 1, str(event / "rank_1"))
    assert where == "/src/model/train_0.py:1 in fn0"
    assert source.startswith("call site of its last operation; its main thread was at ")
    assert "threading.py:324 in wait" in source
    text = summarize(event)
    assert "last operation issued at train_0.py:1 (fn0)" in text, text
    assert "main thread at" not in text.split("rank 1", 1)[1], text


def test_show_and_analyze_agree_on_a_rank_known_only_by_its_stacks_file(tmp_path: Path) -> None:
    job = Synth(2)
    job.collective("all_reduce")
    job.collective("all_reduce", skip=[1])
    event = job.write(tmp_path / "ev", ranks=[0])
    header = format_header({"rank": 1, "method": "fatal-signal", "when": "death",
                            "signal": "SIGABRT"})  # fmt: skip
    (event / "stacks_1.txt").write_text(
        header
        + "Current thread 0x0000000000000001 (most recent call first):\n"
        + f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 2800 in all_reduce\n'
        + '  File "/src/train.py", line 12 in spin\n'
        + '  File "/src/train.py", line 30 in <module>\n'
    )
    where, _, source = culprit_stack(event, 1, None)
    assert (where, source) == (
        "/src/train.py:12 in spin",
        "faulthandler at its death (SIGABRT)",
    )
    text = summarize(event)
    assert (
        "rank 1  no dump; stacks by faulthandler at its death (SIGABRT)\n"
        "  main thread at train.py:12 (spin)"
    ) in text, text
