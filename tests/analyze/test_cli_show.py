"""The command line's manners: plain ``--help`` text, and a quiet exit when stdout's reader goes
away (``tether analyze ... | head``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests._fr_synth import Synth
from tests._jobs import worker_env
from tether.cli.main import EXIT_READER_GONE, main, plain_help

RST = re.compile(r"``|:[a-z]+:`")
COMMANDS = ["run", "demo", "show", "dump", "analyze"]


def test_plain_help_takes_out_inline_markup() -> None:
    doc = "``tether show PATH``: see :func:`tether.dump`, :class:`~tether.Config`, :mod:`x <y>`."
    assert plain_help(doc) == "tether show PATH: see tether.dump, tether.Config, x."


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_is_plain_text(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"tether {command}" in text
    if command == "run":  # torchrun's own options' help is torch's text, some of it RST
        text = text.split("\noptions:", 1)[0] + text.split("\ntether:", 1)[1]
    assert not RST.search(text), text


@pytest.fixture(scope="module")
def hang_event(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = Synth(4)
    for _ in range(5):
        job.collective("all_reduce")
    job.collective("all_reduce", skip=[2])
    return job.write(tmp_path_factory.mktemp("ev") / "ev")


def run_with_stdout_closed(*args: str) -> subprocess.CompletedProcess[str]:
    """``tether ARGS`` writing into a pipe whose reader is already gone: its first write fails
    (EPIPE), as ``| head`` makes it fail once head has its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli.main", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=worker_env(),
        )
    finally:
        os.close(write_end)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["analyze", "{event}"], EXIT_READER_GONE),
        (["analyze", "{event}", "--json"], EXIT_READER_GONE),
        (["show", "{event}"], EXIT_READER_GONE),
        (["--version"], EXIT_READER_GONE),
        (["--help"], EXIT_READER_GONE),
        # demo's first line is flushed before it launches anything: it stops there.
        (["demo", "--dump-dir", "{tmp}"], EXIT_READER_GONE),
        # argparse passes over a failed write of its own messages, and exits as it would.
        (["analyze", "--help"], 0),
    ],
)
def test_a_reader_that_went_away_ends_the_command_quietly(
    args: list[str], status: int, hang_event: Path, tmp_path: Path
) -> None:
    argv = [a.format(event=hang_event, tmp=tmp_path / "dumps") for a in args]
    proc = run_with_stdout_closed(*argv)
    assert proc.returncode == status, proc.stderr
    assert proc.stderr == "", proc.stderr  # no traceback, no "Exception ignored"
    assert not (tmp_path / "dumps").exists()  # demo ran no job


@pytest.mark.timeout(120)
def test_analyze_piped_into_head_prints_its_first_line_and_nothing_on_stderr(
    hang_event: Path,
) -> None:
    argv = [sys.executable, "-m", "tether.cli.main", "analyze", str(hang_event)]
    whole = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=worker_env())
    assert whole.returncode == 0 and whole.stdout.count("\n") > 1, whole.stdout + whole.stderr
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {shlex.join(argv)} | head -1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
    )
    assert proc.stdout == whole.stdout.splitlines(keepends=True)[0]
    assert proc.stderr == "", proc.stderr
    # Whether head left before tether's last write is a race; either way, no error but EPIPE's.
    assert proc.returncode in (0, EXIT_READER_GONE)
