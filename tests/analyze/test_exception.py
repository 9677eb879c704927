"""What a rank died of, as one record: from the exception itself, from torchrun's error file (as
torch's own ``ErrorHandler`` writes it), and as read back from a dump that may hold anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.events.exception import describe, from_error_file, from_exception, read_record


def _raise_here(shards: dict[str, int]) -> int:
    return shards["shard_7"]


def _caught() -> KeyError:
    try:
        _raise_here({})
    except KeyError as exc:
        return exc
    raise AssertionError("no exception")


def test_a_record_holds_type_message_and_the_raising_line_innermost_first() -> None:
    record = from_exception(_caught())
    assert (record["type"], record["message"], record["source"]) == (
        "KeyError",
        "'shard_7'",
        "the rank",
    )
    innermost = record["frames"][0]
    assert (innermost["filename"], innermost["name"]) == (__file__, "_raise_here")
    assert record["frames"][1]["name"] == "_caught"
    assert describe(record) == "KeyError: 'shard_7'"


@pytest.mark.timeout(60)
def test_torchruns_error_file_reads_as_the_same_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        _raise_here({})
    except KeyError as exc:
        ErrorHandler().record_exception(exc)  # what @record writes, in torch's own format
        expected = from_exception(exc)
    record = from_error_file(path)
    assert record is not None
    assert record["source"] == "torchrun's error file"
    assert (record["type"], record["message"]) == (expected["type"], expected["message"])
    assert [(f["filename"], f["line"], f["name"]) for f in record["frames"]] == [
        (f["filename"], f["line"], f["name"]) for f in expected["frames"]
    ]


@pytest.mark.parametrize(
    "content",
    [
        "",
        "not json",
        "[1, 2]",
        json.dumps({"message": {"extraInfo": {}}}),
        json.dumps({"message": 3}),
        "[" * 100000,
    ],
)
def test_an_error_file_that_holds_no_exception_is_none(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    assert from_error_file(path) is None
    assert from_error_file(tmp_path / "absent.json") is None


def test_a_signal_message_has_no_exception_type(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "Signal 6 (SIGABRT) received by PID 12"}))
    record = from_error_file(path)
    assert record is not None and record["type"] == "" and record["frames"] == []
    assert describe(record) == "Signal 6 (SIGABRT) received by PID 12"


@pytest.mark.parametrize(
    "value",
    [None, 3, "x", {"type": 1, "message": "m", "frames": []}, {"type": "E", "message": "m"}],
)
def test_a_dump_holding_something_else_has_no_record(value: object) -> None:
    assert read_record(value) is None


def test_a_dumps_record_is_bounded_and_bad_frames_are_dropped() -> None:
    frames = [{"filename": "a.py", "line": 3, "name": "f"}, {"filename": 7}, "x"] * 100
    record = read_record(
        {"type": "E", "message": "m" * 10**6, "frames": frames, "source": "elsewhere"}
    )
    assert record is not None
    assert len(record["message"]) == 2000 and record["source"] == "the rank"
    assert record["frames"] and all(f["filename"] == "a.py" for f in record["frames"])
    assert len(record["frames"]) <= 64
