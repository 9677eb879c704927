"""The job link and responder when things go wrong: a dump that cannot be written, a stuck peer
whose stack file vanishes, a stale peer entry, a store that is gone or stuck, a default group
formed again. Real TCPStores, real processes, real files; no sleeps for synchronisation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests._jobs import end, worker_env
from tether.events.stacks import parse_header
from tether.job.alarm import DUMP_FAILED, HANG_EXIT_CODE, AlarmBoard
from tether.job.stacks import agent_key, collect_signal_stacks, process_start_time
from tether.watchdog.responder import Responder

pytestmark = [pytest.mark.timeout(90), pytest.mark.every_torch]

HOST = "test-host"


def python(script: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=worker_env(),
        text=True,
        **popen,
    )


def ready(proc: subprocess.Popen[str]) -> str:
    """The line a child prints once it is set up (read with the test's timeout)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited with {proc.wait(10)} before it was ready"
    return line.strip()


@contextlib.contextmanager
def child(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = python(script, *args, stdout=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# A peer of the same host that never answers alarms; argv[1] says how its stack file behaves.
PEER = """
    import os, signal, sys, time
    from pathlib import Path
    from tether.job.stacks import STACK_SIGNAL, arm_stack_signal
    directory, mode = Path(sys.argv[2]), sys.argv[1]
    if mode == "armed":  # faulthandler writes its stacks, as in every tether rank
        path = arm_stack_signal(directory, "peer")
    elif mode == "vanishing":  # the stack file is removed when the signal comes
        path = directory / "peer.txt"
        path.write_text("")
        signal.signal(STACK_SIGNAL, lambda *_: path.unlink())
    else:  # "unrelated": a process that knows nothing of the signal (its default kills it)
        path = directory / "none.txt"
    print(path, flush=True)
    time.sleep(300)
"""


def publish_peer(
    board: AlarmBoard, rank: int, proc: subprocess.Popen[str], path: str, **info: Any
) -> None:
    own = {"host": HOST, "pid": proc.pid, "stack_file": path}
    board.publish_proc(rank, own | {"start_time": process_start_time(proc.pid)} | info)


# -- defect: a failed dump or rescue cancelled the abort -----------------------------------------
# A rank whose main thread hangs; its responder answers alarms and aborts (on_hang=abort).
HUNG_RANK = """
    import sys, threading
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    import tether.watchdog.responder as responder
    from tether.recorder.writer import write_dump
    from tether.job.alarm import AlarmBoard
    port, world_size, dump_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    responder.ABORT_GRACE_S = 1.0  # the stuck peer never says it is done
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    board = AlarmBoard(store)
    board.publish_proc(0, {"host": "test-host", "pid": 0, "stack_file": "/nonexistent"})
    r = responder.Responder(
        board, rank=0, world_size=world_size, host="test-host",
        dump=lambda alarm: write_dump({"entries": []}, dump_dir / alarm.event_id, 0),
        event_dir=lambda event_id: dump_dir / event_id,
        abort_on=lambda alarm: True,
    )
    r.start()
    print("ready", flush=True)
    threading.Event().wait(120)  # the hung main thread
"""


@pytest.mark.slow
def test_a_failed_dump_and_rescue_still_abort(store: dist.TCPStore, tmp_path: Path) -> None:
    # The dump directory lies below a regular file: every write into it fails (even for root).
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "dumps"
    board = AlarmBoard(store)
    with child(PEER, "armed", str(tmp_path)) as peer:
        publish_peer(board, 1, peer, ready(peer))
        with child(HUNG_RANK, str(store.port), "2", str(unwritable)) as rank:
            assert ready(rank) == "ready"
            board.raise_alarm("hang", origin="rank 1", event_id="ev-hang")
            # Its dump fails, then writing the stuck peer's stacks fails: it aborts all the same.
            assert rank.wait(45) == HANG_EXIT_CODE
    done = board.done(1, 2)
    assert done[0].startswith(f"{DUMP_FAILED}: ") and "ot a directory" in done[0], done


# -- defect: a main thread exiting mid-abort cut the late rank's dump short ----------------------
# Its responder aborts on the alarm and waits for rank 1's part; meanwhile the main thread reaches
# the interpreter's exit (a late rank caught up and the script ended), where tether's exit hook
# calls exit_if_aborting().
EXITING_RANK = """
    import sys, threading
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    import tether.watchdog.responder as responder
    from tether.recorder.writer import write_dump
    from tether.job.alarm import AlarmBoard
    port, dump_dir = int(sys.argv[1]), Path(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    r = responder.Responder(
        AlarmBoard(store), rank=0, world_size=2, host="test-host",
        dump=lambda alarm: write_dump({"entries": []}, dump_dir / alarm.event_id, 0),
        event_dir=lambda event_id: dump_dir / event_id,
        abort_on=lambda alarm: True,
    )
    r.start()
    print("ready", flush=True)
    for _ in range(3000):  # bounded: the alarm comes within the test's timeout
        if r.aborting is not None:
            break
        threading.Event().wait(0.01)
    print("main thread exiting", flush=True)
    r.exit_if_aborting()
"""


@contextlib.contextmanager
def exiting_rank(
    script: str, store: dist.TCPStore, tmp_path: Path
) -> Iterator[subprocess.Popen[str]]:
    """Rank 0 of ``script`` (store port, dump dir), its stderr in ``tmp_path/stderr.log``."""
    with open(tmp_path / "stderr.log", "w") as err:
        rank = python(script, str(store.port), str(tmp_path / "dumps"),
                      stdout=subprocess.PIPE, stderr=err)  # fmt: skip
    try:
        yield rank
    finally:
        rank.kill()
        rank.wait(10)
        if rank.stdout is not None:
            rank.stdout.close()


def test_a_main_thread_exiting_mid_abort_waits_for_the_others_parts(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    board = AlarmBoard(store)
    with exiting_rank(EXITING_RANK, store, tmp_path) as rank:
        assert ready(rank) == "ready"
        board.raise_alarm("hang", origin="rank 1", event_id="ev-hang")
        assert ready(rank) == "main thread exiting"
        # Rank 1 (the late rank) dumps, then leaves: only now may rank 0 go.
        board.mark_done(1, 1, "dump")
        board.mark_done(1, 1, "leaving", phase="leaving")
        assert rank.wait(45) == HANG_EXIT_CODE
    said = (tmp_path / "stderr.log").read_text()
    assert board.done(1, 2) == {0: "dump", 1: "dump"}
    # Without the wait it left at once, before it had read anyone's part.
    assert "every rank's dump is in" in said and "answers are unknown" not in said, said


# -- defect: a main thread exiting while its responder still dumped finalized torch under it ------
# (a late rank caught up, its script ended, the interpreter tore down torch's C++ objects while
# the responder thread was writing the dump: "terminate called without an active exception").
EXITING_WHILE_DUMPING = """
    import sys, threading
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    import tether.watchdog.responder as responder
    from tether.recorder.writer import write_dump
    from tether.job.alarm import AlarmBoard
    port, dump_dir = int(sys.argv[1]), Path(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dumping = threading.Event()

    def slow_dump(alarm):
        dumping.set()
        store.wait(["test/dump-may-finish"], timedelta(seconds=40))
        return write_dump({"entries": []}, dump_dir / alarm.event_id, 0)

    r = responder.Responder(
        AlarmBoard(store), rank=0, world_size=2, host="test-host", dump=slow_dump,
        event_dir=lambda event_id: dump_dir / event_id, abort_on=lambda alarm: True,
    )
    r.start()
    print("ready", flush=True)
    assert dumping.wait(40)
    print("main thread exiting", flush=True)
    r.exit_if_aborting()
    print("exit_if_aborting returned", flush=True)
"""


def test_a_main_thread_exiting_while_its_responder_dumps_waits_for_the_answer(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    board = AlarmBoard(store)
    with exiting_rank(EXITING_WHILE_DUMPING, store, tmp_path) as rank:
        assert ready(rank) == "ready"
        board.raise_alarm("hang", origin="rank 1", event_id="ev-hang")
        assert ready(rank) == "main thread exiting"
        board.mark_done(1, 1, "dump")
        board.mark_done(1, 1, "leaving", phase="leaving")
        store.set("test/dump-may-finish", "1")
        # Without the wait exit_if_aborting returned at once (no abort decided yet): exit 0.
        assert rank.wait(45) == HANG_EXIT_CODE
        assert rank.stdout is not None and "exit_if_aborting returned" not in rank.stdout.read()
    assert (tmp_path / "dumps" / "ev-hang" / "rank_0").is_file()


# ... and one whose alarm came while the main thread held the GIL (a late rank in a C call): the
# responder had not even taken the alarm up when the script ended.
EXITING_BEFORE_THE_ANSWER = """
    import ctypes, sys
    from datetime import timedelta
    from pathlib import Path
    import torch.distributed as dist
    import tether.watchdog.responder as responder
    from tether.recorder.writer import write_dump
    from tether.job.alarm import AlarmBoard
    port, dump_dir = int(sys.argv[1]), Path(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    r = responder.Responder(
        AlarmBoard(store), rank=0, world_size=2, host="test-host",
        dump=lambda alarm: write_dump({"entries": []}, dump_dir / alarm.event_id, 0),
        event_dir=lambda event_id: dump_dir / event_id, abort_on=lambda alarm: True,
    )
    r.start()
    print("ready", flush=True)
    store.wait(["tether/alarm/1"], timedelta(seconds=40))
    ctypes.PyDLL(None).usleep(300_000)  # holds the GIL: the responder cannot take the alarm up
    r.exit_if_aborting()
    print("exit_if_aborting returned", flush=True)
"""


def test_a_main_thread_exiting_before_its_responder_took_the_alarm_up_waits_for_it(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    board = AlarmBoard(store)
    board.mark_done(1, 1, "dump")
    board.mark_done(1, 1, "leaving", phase="leaving")
    with exiting_rank(EXITING_BEFORE_THE_ANSWER, store, tmp_path) as rank:
        assert ready(rank) == "ready"
        board.raise_alarm("hang", origin="rank 1", event_id="ev-hang")
        assert rank.wait(45) == HANG_EXIT_CODE
        assert rank.stdout is not None and "exit_if_aborting returned" not in rank.stdout.read()
    assert (tmp_path / "dumps" / "ev-hang" / "rank_0").is_file()


@pytest.mark.slow
def test_a_stack_file_that_vanishes_does_not_stop_the_abort(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    board = AlarmBoard(store)
    with child(PEER, "vanishing", str(tmp_path)) as peer:
        publish_peer(board, 1, peer, ready(peer))
        with child(HUNG_RANK, str(store.port), "2", str(tmp_path / "dumps")) as rank:
            assert ready(rank) == "ready"
            board.raise_alarm("hang", origin="rank 1", event_id="ev-hang")
            assert rank.wait(45) == HANG_EXIT_CODE
    assert (tmp_path / "dumps" / "ev-hang" / "rank_0").is_file()
    assert board.done(1, 2) == {0: "dump"}


def test_collecting_from_a_vanishing_stack_file_gives_nothing(tmp_path: Path) -> None:
    with child(PEER, "vanishing", str(tmp_path)) as peer:
        path = Path(ready(peer))
        assert collect_signal_stacks(peer.pid, path, timeout=5.0) is None
        assert peer.poll() is None


# -- defect: stale tether/proc entries could have an unrelated process signalled ----------------
def rescuer(store: dist.TCPStore, tmp_path: Path, *, attempt: int = 0) -> Responder:
    board = AlarmBoard(store)
    me = {"host": HOST, "pid": os.getpid(), "stack_file": "/nonexistent", "attempt": attempt}
    board.publish_proc(0, me)
    return Responder(
        board,
        rank=0,
        world_size=2,
        host=HOST,
        dump=lambda alarm: tmp_path / alarm.event_id,
        event_dir=lambda event_id: tmp_path / event_id,
        abort_on=lambda alarm: False,
        attempt=attempt,
    )


def answer_a_manual_alarm(board: AlarmBoard, responder: Responder) -> None:
    """Raise a manual alarm and let ``responder`` (rank 0, the rescuer) answer it."""
    responder.start()
    try:
        board.raise_alarm("manual", origin="cli", event_id="ev-manual")
        assert responder.wait_answered(0, timeout=30)
    finally:
        responder.close()


@pytest.mark.parametrize("stale", ["pid reused", "earlier attempt"])
def test_a_stale_entry_is_never_signalled(store: dist.TCPStore, tmp_path: Path, stale: str) -> None:
    board = AlarmBoard(store)
    with child(PEER, "unrelated", str(tmp_path)) as unrelated:
        path = ready(unrelated)
        (tmp_path / "none.txt").write_text("")
        started = process_start_time(unrelated.pid)
        assert started is not None
        if stale == "pid reused":  # an entry of a process that had this pid before
            publish_peer(board, 1, unrelated, path, start_time=started - 1)
            responder = rescuer(store, tmp_path)
        else:  # the entry is that process's own, left by torchrun's previous attempt
            publish_peer(board, 1, unrelated, path, attempt=0)
            responder = rescuer(store, tmp_path, attempt=1)
        answer_a_manual_alarm(board, responder)
        assert unrelated.poll() is None, f"signalled: exit {unrelated.returncode}"
    assert not (tmp_path / "ev-manual" / "stacks_1.txt").exists()


def test_a_live_peer_of_this_attempt_is_still_rescued(store: dist.TCPStore, tmp_path: Path) -> None:
    board = AlarmBoard(store)
    with child(PEER, "armed", str(tmp_path)) as peer:
        publish_peer(board, 1, peer, ready(peer), attempt=2)
        answer_a_manual_alarm(board, rescuer(store, tmp_path, attempt=2))
        assert peer.poll() is None
    text = (tmp_path / "ev-manual" / "stacks_1.txt").read_text()
    assert "did not answer manual alarm" in text
    header = parse_header(text)  # no agent here: the fallback, and it says so
    assert header is not None and (header.get("method"), header.get("when")) == (
        "faulthandler",
        "unresponsive",
    )


def test_no_peer_is_signalled_where_the_launchers_agent_reads_stacks(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    # tether run's agent reads this host's silent ranks from outside (py-spy): a signal would
    # interrupt the system call the peer is stuck in, so the responder leaves it alone.
    board = AlarmBoard(store)
    store.set(agent_key(HOST), json.dumps({"pid": 1, "tool": "py-spy"}))
    with child(PEER, "armed", str(tmp_path)) as peer:
        path = Path(ready(peer))
        publish_peer(board, 1, peer, str(path))
        answer_a_manual_alarm(board, rescuer(store, tmp_path))
        assert peer.poll() is None
    assert path.stat().st_size == 0, path.read_text()
    assert not (tmp_path / "ev-manual" / "stacks_1.txt").exists()


# -- defect: the responder's blocking waits held the shared store connection --------------------
def test_the_responders_waits_leave_the_shared_connection_free(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    board = AlarmBoard(store)  # shared: the watchdog and the main thread raise alarms on it
    # A same-host peer that never answers: the responder waits for it (RESCUE_AFTER_S).
    board.publish_proc(1, {"host": HOST, "pid": 1, "stack_file": "/nonexistent"})
    responder = rescuer(store, tmp_path)
    responder.start()
    observer = store.clone()
    try:
        board.raise_alarm("manual", origin="cli", event_id="ev-manual")
        observer.wait(["tether/alarm/1/done/0"], timedelta(seconds=20))
        slowest = 0.0
        while responder.answered == 0:  # the responder is waiting for its peer meanwhile
            start = time.monotonic()
            board.get(1)
            slowest = max(slowest, time.monotonic() - start)
            assert slowest < 1.0, f"a store call on the shared connection took {slowest:.1f}s"
    finally:
        responder.close()


# -- defect: a hang was lost when the store could not be reached ---------------------------------
STORE = """
    import time
    from datetime import timedelta
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    print(s.port, flush=True)
    time.sleep(300)
"""

# Once both ranks have formed the group, rank 0 loses the store (argv[4]: "stop" or "kill" the
# store's process), then hangs in an all_reduce that rank 1 never joins.
LOST_STORE_RANK = """
    import os, signal, sys, threading
    from datetime import timedelta
    import torch, torch.distributed as dist
    import tether
    port, rank, dump_dir, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    tether.init_process_group("gloo", store=store, rank=rank, world_size=2, dump_dir=dump_dir,
                              hang_timeout=1.0, on_hang="abort", debug_port="off",
                              timeout=timedelta(seconds=120))
    if rank == 1:
        store.set("test/rank1-ready", "1")
        threading.Event().wait(120)
    store.wait(["test/rank1-ready"])
    os.kill(int(sys.argv[5]), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    print("ready", flush=True)
    dist.all_reduce(torch.ones(4))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_hang_without_a_store_dumps_locally_and_aborts(tmp_path: Path, how: str) -> None:
    dumps = tmp_path / "dumps"
    with child(STORE) as server, contextlib.ExitStack() as stack:
        port = ready(server)
        ranks = []
        for r in (0, 1):
            log = stack.enter_context(open(tmp_path / f"rank_{r}.log", "w"))
            args = (port, str(r), str(dumps), how, str(server.pid))
            ranks.append(python(LOST_STORE_RANK, *args, stdout=subprocess.PIPE, stderr=log))
        try:
            assert ready(ranks[0]) == "ready", (tmp_path / "rank_0.log").read_text()
            assert ranks[0].wait(45) == HANG_EXIT_CODE, (tmp_path / "rank_0.log").read_text()
            assert ranks[1].poll() is None
        finally:
            end(ranks)
            server.send_signal(signal.SIGCONT)
    (event,) = [p for p in dumps.iterdir() if p.name.endswith("-hang")]
    assert sorted(p.name for p in event.iterdir()) == ["cols_0.npz", "rank_0"]
    log = (tmp_path / "rank_0.log").read_text()
    assert "could not raise the hang alarm through the job's store" in log, log
    assert f"dump in {event}; aborting" in log


# -- defect: a default group formed again leaked a responder and a debug server ------------------
REINIT = """
    import json, sys, threading
    from datetime import timedelta
    import torch.distributed as dist
    import tether
    from tether.runtime import active, link
    port, dump_dir, debug_port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=30))
    options = dict(store=store, rank=0, world_size=1, dump_dir=dump_dir, debug_port=debug_port)
    for _ in range(3):
        tether.init_process_group("gloo", **options)
        dist.destroy_process_group()
    tether.init_process_group("gloo", **options)
    m = link()
    alarm = m.request_dump("manual")
    answered = m.responder.wait_answered(0, 20)
    for t in threading.enumerate():  # the replaced responders end once their wait returns
        if t.name == "tether-alarms" and t is not m.responder._thread:
            t.join(5)
    names = [t.name for t in threading.enumerate()]
    print(json.dumps({
        "answered": answered,
        "event": alarm.event_id,
        "port": active().server.port if active().server else None,
        "alarm_threads": names.count("tether-alarms"),
        "server_threads": names.count("tether-debug-server"),
    }), flush=True)
"""


def test_a_default_group_formed_again_replaces_responder_and_server(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    with socket.socket() as probe:  # a fixed --debug-port: one that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        debug_port = probe.getsockname()[1]
    dumps = tmp_path / "dumps"
    proc = python(
        REINIT, str(store.port), str(dumps), str(debug_port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["answered"] and got["port"] == debug_port, err
    assert (got["alarm_threads"], got["server_threads"]) == (1, 1), got
    assert sorted(p.name for p in (dumps / got["event"]).iterdir()) == ["cols_0.npz", "rank_0"]
    assert "could not" not in err, err
