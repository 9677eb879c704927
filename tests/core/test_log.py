"""tether's log records and user-facing lines reach a shared stderr whole: two processes writing
to one pipe at once never cut each other's lines."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest

from tests._jobs import worker_env
from tether._log import get_logger, say

PREFIX = f"[rank ? on {socket.gethostname()}]"
"""Every record's: the rank (unknown before a group forms) and the host."""

LINES = 1000
WIDTH = 2000
"""Under PIPE_BUF (4096), where a pipe keeps each write whole."""

# Unbuffered, as training jobs often run (PYTHONUNBUFFERED=1): print() then writes its text and
# its newline apart, and another process's line can come between them.
WRITER = f"""
import sys
from tether._log import get_logger, say
tag = sys.argv[1]
log = get_logger("tether.test")
sys.stdin.read(1)  # both processes start writing together
for i in range({LINES}):
    log.warning("%s %04d %s", tag, i, tag * {WIDTH})
    say(f"{{tag}} say {{i:04d}} " + tag * {WIDTH})
"""


@pytest.mark.timeout(60)
def test_two_processes_lines_never_interleave_on_one_pipe() -> None:
    read, write = os.pipe()
    env = worker_env(PYTHONUNBUFFERED="1")
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-u", "-c", WRITER, tag],
                stdin=subprocess.PIPE,
                stderr=write,
                stdout=write,
                env=env,
            )
            for tag in ("A", "B")
        ]
    finally:
        os.close(write)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go")
        p.stdin.close()
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read, 65536), b"")))
    reader.start()
    for p in procs:
        assert p.wait(50) == 0
    reader.join(10)
    os.close(read)
    lines = b"".join(chunks).decode().splitlines()
    assert len(lines) == 2 * 2 * LINES
    for line in lines:
        tag = line.split("] ", 1)[1][0] if line.startswith("[rank") else line[0]
        body = line.rsplit(" ", 1)[1]
        assert set(body) == {tag} and len(body) == WIDTH, f"cut: {line[:60]}...{line[-60:]}"


def test_records_go_to_the_applications_handlers_once_it_has_some(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # pytest's capture handler is on the root logger, as an application's would be.
    get_logger("tether.test").warning("once")
    assert [r.getMessage() for r in caplog.records] == [f"{PREFIX} once"]
    assert capsys.readouterr().err == "", "not written a second time by tether's own handler"


def test_say_writes_to_a_stream_without_a_descriptor() -> None:
    out = io.StringIO()
    say("tether: one line", out)
    assert out.getvalue() == "tether: one line\n"


def test_without_handlers_warnings_reach_stderr_and_info_does_not(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log = get_logger("tether.test")
    log.info("quiet")
    log.warning("loud")
    assert capfd.readouterr().err == f"{PREFIX} loud\n"


@pytest.mark.parametrize("where", ["tether", "tether.test"])
def test_a_handler_on_tethers_own_loggers_takes_the_records_alone(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], where: str
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # none on the root logger
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger(where).addHandler(handler)
    try:
        get_logger("tether.test").warning("once")
    finally:
        logging.getLogger(where).removeHandler(handler)
    assert out.getvalue() == f"{PREFIX} once\n"
    assert capfd.readouterr().err == "", "not written a second time by tether's own handler"


def test_a_silenced_last_resort_silences_tether_too(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging, "lastResort", None)
    get_logger("tether.test").warning("hushed")
    assert capfd.readouterr().err == ""


def test_say_to_a_stream_nobody_reads_does_not_raise() -> None:
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as stream:  # writing to it fails with EPIPE
        say("tether: hang (...); aborting", stream)
        with pytest.raises(BrokenPipeError):
            os.write(write, b"x")
