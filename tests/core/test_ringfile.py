"""The ring file: a rank's record outlives its process, on both recorders, in one layout."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._jobs import worker_env
from tether.config import Config
from tether.events.ringfile import (
    RECORD_LAYOUT,
    RECORD_SIZE,
    RECORDS_AT,
    STATES,
    RingFile,
    fixed,
    read_ring,
    ring_file,
)
from tether.recorder.native import load
from tether.recorder.ops import OPS
from tether.recorder.recorder import Recorder

pytestmark = pytest.mark.python_recorder

RECORDERS = ["native", "python"]


def record(rid: int, **fields: object) -> tuple[object, ...]:
    base: dict[str, object] = dict(
        slot=0, state="completed", is_p2p=False, record_id=rid, seq=rid + 1, p2p_seq=0,
        op_id=rid + 1, thread_id=7, created=100 + rid, started=200 + rid, completed=300 + rid,
        name="gloo:all_reduce", inputs=[([4, 2], "Float")], outputs=None,
    )  # fmt: skip
    base.update(fields)
    b: Any = base
    return (
        STATES.index(b["state"]), b["is_p2p"], rid, b["slot"], b["seq"], b["p2p_seq"], b["op_id"],
        b["thread_id"], b["created"], b["started"], b["completed"],
        fixed(b["name"], b["inputs"], b["outputs"]),
    )  # fmt: skip


def new_file(tmp_path: Path, capacity: int = 8) -> RingFile:
    ring = RingFile(ring_file(tmp_path, "h", 42), capacity, host="h", pid=42)
    ring.identify(rank=3, world_size=4, job_id="job-1", torch_version="2.13.0")
    ring.add_group(0, uid=0, name="0", desc="default_pg", ranks="[0, 1, 2, 3]", group_rank=3,
                   timeout_ms=60_000)  # fmt: skip
    return ring


def test_the_record_layout_is_the_struct_the_reader_unpacks() -> None:
    """RECORD_LAYOUT (what the native core's layout is compared with at load) describes the
    record this module packs: its fields in order, apart, ending where the record's bytes do."""
    from tether.events.ringfile import _RECORD

    end = 0
    for name, at, size in RECORD_LAYOUT["fields"]:
        assert at >= end, name
        end = at + size
    assert end == _RECORD.size <= RECORD_SIZE == RECORD_LAYOUT["record_size"]
    assert [f[0] for f in RECORD_LAYOUT["fields"]][:2] == ["seq_word", "state"]


def test_records_read_back_as_a_dump(tmp_path: Path) -> None:
    ring = new_file(tmp_path)
    ring.write(*record(0))
    ring.write(*record(1, state="started", completed=0, inputs=[([8], "BFloat16")]))
    shapes = [([i, 1, 2, 3, 4], "Double") for i in range(6)]  # more than kept, deeper than kept
    ring.write(*record(2, name="gloo:all_gather", inputs=[([4], "Float")], outputs=shapes))
    ring.close(remove=False)
    data = read_ring(ring.path, how="a test")
    meta = data["tether"]
    assert (meta["global_rank"], meta["world_size"], meta["pid"], meta["host"]) == (3, 4, 42, "h")
    assert meta["recovered"] == {"after_death": True, "how": "a test"}
    assert data["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    assert data["pg_status"]["0"] == {
        "last_enqueued_collective": 3,
        "last_started_collective": 3,
        "last_completed_collective": 3,
    }
    first, second, third = data["entries"]
    assert first["output_sizes"] == first["input_sizes"] == [[4, 2]]
    assert (first["state"], first["duration_ms"], first["timeout_ms"]) == ("completed", 1e-4, 60000)
    assert (second["state"], second["input_dtypes"], second["retired"]) == (
        "started",
        ["BFloat16"],
        False,
    )
    assert third["output_sizes"] == [[i, 1, 2, 3] for i in range(4)]
    assert third["output_dtypes"] == ["Double"] * 4


def test_a_record_cut_short_by_a_death_is_passed_over(tmp_path: Path) -> None:
    ring = new_file(tmp_path)
    ring.write(*record(0))
    ring.write(*record(1))
    ring.close(remove=False)
    raw = bytearray(ring.path.read_bytes())
    at = RECORDS_AT + 1 * RECORD_SIZE
    (seq,) = struct.unpack_from("<I", raw, at)
    struct.pack_into("<I", raw, at, seq | 1)  # the writer died between its two stores
    ring.path.write_bytes(bytes(raw))
    assert [e["record_id"] for e in read_ring(ring.path, how="t")["entries"]] == [0]


def test_the_ring_wraps_and_keeps_the_newest(tmp_path: Path) -> None:
    ring = new_file(tmp_path, capacity=4)
    for rid in range(10):
        ring.write(*record(rid))
    assert [e["record_id"] for e in read_ring(ring.path, how="t")["entries"]] == [6, 7, 8, 9]


@pytest.mark.parametrize("content", [b"", b"not a ring file" * 100, b"TETHRNG1" + bytes(100)])
def test_anything_else_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "f"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a tether ring file"):
        read_ring(path, how="t")


SCRIPT = """
import json, os, signal, sys
from datetime import timedelta
import torch, torch.distributed as dist
import tether
from tether.runtime import current
tether.install(tether.Config(dump_dir=sys.argv[1], recorder=sys.argv[2], debug_port=None))
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
sub = dist.new_group([0], group_desc="pair")
for _ in range(3):
    dist.all_reduce(torch.ones(4))
dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2, dtype=torch.float32), group=sub)
rec = current()
print("RING " + json.dumps({"path": str(rec.ring_file.path), "native": rec.native}), flush=True)
if sys.argv[3] == "clean":
    dist.destroy_process_group()
    sys.exit(0)
# Each group's last operation is seen completed by the watchdog's next pass; do it now, and write
# the Python recorder's file as its pass would (the native core writes each step as it happens).
rec.reap()
rec.flush()
# Issued, and the process dies before any watchdog pass: both recorders wrote it while issuing.
dist.broadcast(torch.ones(3, dtype=torch.float64), 0, async_op=True)
os.kill(os.getpid(), getattr(signal, sys.argv[3]))
"""


def run(tmp_path: Path, recorder: str, end: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    if recorder == "native" and load()[0] is None:
        pytest.skip(f"the native core does not load here: {load()[1]}")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path), recorder, end],
        capture_output=True, text=True, timeout=60, env=worker_env(),
    )  # fmt: skip
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RING "))
    return proc, json.loads(line.removeprefix("RING "))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recorder", RECORDERS)
@pytest.mark.parametrize("death", ["SIGKILL", "SIGABRT"])
def test_a_killed_process_leaves_its_record(tmp_path: Path, recorder: str, death: str) -> None:
    proc, ring = run(tmp_path, recorder, death)
    assert proc.returncode == -getattr(signal, death), proc.stderr
    assert ring["native"] is (recorder == "native")
    data = read_ring(Path(ring["path"]), how="t")
    names = [(e["profiling_name"], e["process_group"][1], e["state"]) for e in data["entries"]]
    assert names[:-1] == [
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:_all_gather_base", "pair", "completed"),
    ], names
    last = data["entries"][-1]
    assert (last["profiling_name"], last["input_sizes"], last["input_dtypes"]) == (
        "gloo:broadcast",
        [[3]],
        ["Double"],
    ), last
    gather = data["entries"][-2]
    assert (gather["input_sizes"], gather["output_sizes"]) == ([[2]], [[2]])
    assert data["tether"]["global_rank"] == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recorder", RECORDERS)
def test_a_clean_exit_removes_the_ring_file(tmp_path: Path, recorder: str) -> None:
    proc, ring = run(tmp_path, recorder, "clean")
    assert proc.returncode == 0, proc.stderr
    assert not Path(ring["path"]).exists()


def _python_recorder(tmp_path: Path, ring_size: int) -> tuple[Recorder, Any]:
    recorder = Recorder(Config(ring_size=ring_size), ring_path=tmp_path / "ring")
    group = recorder.add_group(name="0", desc="default_pg", ranks=[0], group_rank=0,
                               backends={"cpu": "gloo"}, timeout_ms=1000)  # fmt: skip
    return recorder, group


class _DoneWork:
    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        return torch.futures.Future()


def _issue(group: Any, n: int) -> None:
    group.issued(group.begin(OPS["broadcast"], ([torch.ones(n)], None)), _DoneWork())


def _records(recorder: Recorder) -> list[tuple[int, list[list[int]], str]]:
    data = read_ring(recorder.ring_file.path, how="t")  # type: ignore[union-attr]
    return [(e["record_id"], e["input_sizes"], e["state"]) for e in data["entries"]]


def test_python_recorder_writes_each_record_as_it_is_issued(tmp_path: Path) -> None:
    recorder, group = _python_recorder(tmp_path, ring_size=4)
    for n in range(1, 4):
        _issue(group, n)
    # No flush yet: every record is there, as issued; the third still in flight.
    assert _records(recorder) == [(0, [[1]], "scheduled"), (1, [[2]], "scheduled"),
                                  (2, [[3]], "scheduled")]  # fmt: skip
    recorder.reap()
    recorder.flush()
    assert [state for *_, state in _records(recorder)] == ["completed"] * 3
    for n in range(4, 10):  # records 3..8: the ring wraps, its 4 slots hold 5..8
        _issue(group, n)
    recorder.reap()
    recorder.flush()
    assert _records(recorder) == [(5, [[6]], "completed"), (6, [[7]], "completed"),
                                  (7, [[8]], "completed"), (8, [[9]], "completed")]  # fmt: skip


class _LateWork(_DoneWork):
    done = False

    def is_completed(self) -> bool:
        return self.done


def test_a_late_completion_of_an_evicted_record_is_not_written(tmp_path: Path) -> None:
    """An irecv posted early completes after the ring went round: its slot is a newer
    record's, which must stay."""
    recorder, group = _python_recorder(tmp_path, ring_size=4)
    other = recorder.add_group(name="1", desc="other", ranks=[0], group_rank=0,
                               backends={"cpu": "gloo"}, timeout_ms=1000)  # fmt: skip
    late = _LateWork()
    early = group.begin(OPS["recv"], ([torch.ones(1)], 1, 0))
    group.issued(early, late)
    for n in range(2, 6):  # records 1..4, on another group: record 0's slot is record 4's
        _issue(other, n)
    recorder.reap()
    recorder.flush()
    late.done = True
    recorder.reap()  # record 0 completes now, and is queued for the file
    assert early.state == "completed" and recorder.dirty and early in recorder.dirty
    recorder.flush()
    assert _records(recorder) == [(1, [[2]], "completed"), (2, [[3]], "completed"),
                                  (3, [[4]], "completed"), (4, [[5]], "completed")]  # fmt: skip


def test_a_completion_written_over_a_newer_record_is_mended(tmp_path: Path) -> None:
    """The watchdog checks that an entry still owns its slot, and an issuing thread reuses the
    slot before the watchdog's store lands: the newer record must be what the file keeps."""
    recorder, group = _python_recorder(tmp_path, ring_size=2)
    _issue(group, 1)
    _issue(group, 2)
    recorder.reap()
    write = recorder._file_write
    assert write is not None
    calls = 0

    def switch_first(*fields: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the thread switch, at the worst moment: record 2 takes record 0's
            # slot, and its backend call never returns (it aborts the process, say): the flush
            # is the last writer of that slot.
            recorder._file_write = write
            group.begin(OPS["broadcast"], ([torch.ones(3)], None))
            recorder._file_write = switch_first
        write(*fields)

    recorder._file_write = switch_first
    recorder.flush()
    assert [(rid, sizes) for rid, sizes, _ in _records(recorder)] == [(1, [[2]]), (2, [[3]])]


def test_a_full_disk_leaves_no_ring_file_and_recording_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    recorder, group = _python_recorder(tmp_path, ring_size=4)
    assert recorder.ring_file is None and not (tmp_path / "ring").exists()
    assert "no ring file" in caplog.text and "No space left" in caplog.text
    _issue(group, 1)
    recorder.reap()
    recorder.flush()
    assert [e.state for e in recorder.entries()] == ["completed"]


def test_a_late_write_of_an_older_record_leaves_the_newer(tmp_path: Path) -> None:
    """One thread adds a record to a one-slot ring and is switched out before writing it; another
    adds and writes a newer one there; the first thread's write lands last."""
    recorder, group = _python_recorder(tmp_path, ring_size=1)
    older = group.begin(OPS["broadcast"], ([torch.ones(1)], None))
    group.begin(OPS["broadcast"], ([torch.ones(2)], None))
    assert older is not None
    recorder.save(older)  # the first thread's write, late
    assert [(rid, sizes) for rid, sizes, _ in _records(recorder)] == [(1, [[2]])]
