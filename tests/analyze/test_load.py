"""Dumps are loaded as plain data only: hostile, corrupt and truncated files are refused."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether import UnsafeDumpError, load_dump
from tether.events.load import loads_dump, resolve_event

GOOD = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [{"a": (1, 2.0, None)}]}


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch PWNED",))


def test_plain_pickle_and_json_load(tmp_path: Path) -> None:
    p = tmp_path / "rank_0"
    p.write_bytes(pickle.dumps(GOOD))
    assert load_dump(p) == GOOD
    j = tmp_path / "rank_1"
    j.write_text(json.dumps({**GOOD, "entries": []}))
    assert load_dump(j)["entries"] == []


def test_pickle_that_would_run_code_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "rank_0"
    p.write_bytes(pickle.dumps({**GOOD, "entries": [_Exploit()]}))
    with pytest.raises(UnsafeDumpError, match=r"refusing to load posix\.system"):
        load_dump(p)
    assert not (tmp_path / "PWNED").exists()


def test_truncated_dump_is_refused_with_the_file_named(tmp_path: Path) -> None:
    raw = pickle.dumps(GOOD)
    p = tmp_path / "rank_3"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(UnsafeDumpError, match=r"rank_3: not a readable dump.*truncated or corrupt"):
        load_dump(p)


def test_non_dump_data_is_refused() -> None:
    with pytest.raises(UnsafeDumpError, match="not a flight-recorder dump"):
        loads_dump(pickle.dumps([1, 2, 3]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_escape_as_another_error(raw: bytes) -> None:
    try:
        data = loads_dump(raw)
    except UnsafeDumpError:
        return
    assert "entries" in data


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=255))
def test_corrupted_byte_in_a_real_dump_is_handled(pos: int, value: int) -> None:
    raw = bytearray(pickle.dumps(GOOD, protocol=4))
    raw[pos % len(raw)] = value
    try:
        data = loads_dump(bytes(raw))
    except UnsafeDumpError:
        return
    assert isinstance(data, dict)


def test_resolve_event_picks_newest_and_names_missing(tmp_path: Path) -> None:
    for name in ("20260101T000000.000000Z-a", "20260102T000000.000000Z-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank_0").write_bytes(pickle.dumps(GOOD))
    assert resolve_event(tmp_path).name.endswith("-b")
    assert resolve_event(tmp_path, "20260101T000000.000000Z-a").name.endswith("-a")
    with pytest.raises(UnsafeDumpError, match="no event 'nope'"):
        resolve_event(tmp_path, "nope")
    with pytest.raises(UnsafeDumpError, match="holds no dump event"):
        (tmp_path / "empty").mkdir()
        resolve_event(tmp_path / "empty")


def test_ring_files_are_never_read_as_ranks(tmp_path: Path) -> None:
    """``<host>-<pid>`` looks like ``<prefix><rank>``: a dump directory holding only processes'
    ring files (and tether's other bookkeeping) holds no event, and the ring directory itself
    is refused with what to analyze instead."""
    from tether._exceptions import AnalysisError
    from tether.analyze import analyze

    for sub in (".rings", ".stacks"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "node7-24655").write_bytes(pickle.dumps(GOOD))
    with pytest.raises(AnalysisError, match="holds no dump event"):
        analyze(tmp_path)
    with pytest.raises(AnalysisError, match=r"ring files, not dumps: .* analyze that event"):
        analyze(tmp_path / ".rings")
