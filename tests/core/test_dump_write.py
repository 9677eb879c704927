"""Writing dumps: atomic, never overwriting, and a clear error on a full disk."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import worker_env
from tether import ConfigError, DumpError
from tether.events.layout import check_event_id, new_event_id
from tether.recorder.writer import write_dump

pytestmark = pytest.mark.python_recorder

# 256 KiB of distinct strings (pickle would write a repeated one once).
BIG = {"version": "2.10", "entries": [{"blob": f"{i:04d}" * 1024} for i in range(64)]}


def test_event_ids_sort_by_time_and_name_the_reason() -> None:
    import datetime as dt

    a = new_event_id("Manual dump!", dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc))
    b = new_event_id("hang", dt.datetime(2026, 1, 2, 3, 4, 6, tzinfo=dt.timezone.utc))
    assert a == "20260102T030405.000006Z-manual_dump"
    assert a < b and b.endswith("-hang")


def test_an_existing_rank_file_is_never_replaced(tmp_path: Path) -> None:
    path = write_dump({"version": "2.10", "entries": []}, tmp_path / "ev", 0)
    before = path.read_bytes()
    with pytest.raises(DumpError, match="already exists"):
        write_dump(BIG, tmp_path / "ev", 0)
    assert path.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["rank_0"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "full"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_gives_a_clear_error_and_leaves_nothing(tiny_tmpfs: Path) -> None:
    with pytest.raises(DumpError, match=r"disk is full.*--dump-dir"):
        write_dump(BIG, tiny_tmpfs / "ev", 0)
    assert list((tiny_tmpfs / "ev").iterdir()) == []


def test_file_size_limit_behaves_like_a_full_disk(tmp_path: Path) -> None:
    # Needs no privileges: the kernel refuses writes past RLIMIT_FSIZE with EFBIG.
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from tether import DumpError
        from tether.recorder.writer import write_dump
        from tests.core.test_dump_write import BIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
        try:
            write_dump(BIG, Path({str(tmp_path / "ev")!r}), 3)
        except DumpError as exc:
            print("ERROR", exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=worker_env()
    )
    assert "ERROR could not write dump" in proc.stdout and "disk is full" in proc.stdout, (
        proc.stderr
    )
    assert list((tmp_path / "ev").iterdir()) == []


class Gate:
    """Pickled in the middle of a dump: holds its writer there, temporary file open, until the
    test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __reduce__(self) -> tuple[Any, ...]:
        self.entered.set()
        assert self.release.wait(10), "the test never let the writer go"
        return (str, ("gate",))


@pytest.mark.timeout(30)
def test_two_writers_of_one_file_do_not_break_each_other(tmp_path: Path) -> None:
    """Two answers of one alarm in one process (a responder left over from an earlier default
    group): the second must not truncate or delete the first's half-written file."""
    gate = Gate()
    first: dict[str, BaseException] = {}

    def slow_writer() -> None:
        try:
            write_dump({"version": "2.10", "entries": [], "gate": gate}, tmp_path / "ev", 0)
        except BaseException as exc:
            first["error"] = exc

    thread = threading.Thread(target=slow_writer)
    thread.start()
    try:
        assert gate.entered.wait(10)
        path = write_dump(BIG, tmp_path / "ev", 0)  # the other writer, while the first writes
    finally:
        gate.release.set()
        thread.join(10)
    assert not thread.is_alive()
    assert isinstance(first.get("error"), DumpError)
    assert "already exists" in str(first["error"]), first["error"]
    with open(path, "rb") as f:
        assert pickle.load(f) == BIG
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["rank_0"]


@pytest.mark.parametrize("event_id", ["../escaped", "/tmp/abs", ".jobs", "a/b", "..", "x" * 200])
def test_event_ids_that_leave_the_dump_dir_are_refused(event_id: str) -> None:
    with pytest.raises(ConfigError, match="plain file name"):
        check_event_id(event_id)


def test_event_ids_of_every_reason_are_plain_names() -> None:
    for reason in ("hang", "manual", "crash", "Manual dump!", "", "../.."):
        event_id = new_event_id(reason)
        assert check_event_id(event_id) == event_id
