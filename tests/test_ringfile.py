"""The ring file: a rank's record outlives its process, on both recorders, in one layout."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._jobs import worker_env
from tether.events.ringfile import RECORD_SIZE, RECORDS_AT, RingFile, pack, read_ring, ring_file
from tether.recorder.native import load

RECORDERS = ["native", "python"]


def record(rid: int, **fields: object) -> tuple[object, ...]:
    base: dict[str, object] = dict(
        slot=0, state="completed", is_p2p=False, record_id=rid, seq=rid + 1, p2p_seq=0,
        op_id=rid + 1, thread_id=7, created=100 + rid, started=200 + rid, completed=300 + rid,
        name="gloo:all_reduce", inputs=[([4, 2], "Float")], outputs=None,
    )  # fmt: skip
    base.update(fields)
    return pack(**base)  # type: ignore[arg-type]


def new_file(tmp_path: Path, capacity: int = 8) -> RingFile:
    ring = RingFile(ring_file(tmp_path, "h", 42), capacity, host="h", pid=42)
    ring.identify(rank=3, world_size=4, job_id="job-1", torch_version="2.13.0")
    ring.add_group(0, uid=0, name="0", desc="default_pg", ranks="[0, 1, 2, 3]", group_rank=3,
                   timeout_ms=60_000)  # fmt: skip
    return ring


def test_records_read_back_as_a_dump(tmp_path: Path) -> None:
    ring = new_file(tmp_path)
    ring.write(record(0))
    ring.write(record(1, state="started", completed=0, inputs=[([8], "BFloat16")]))
    shapes = [([i, 1, 2, 3, 4], "Double") for i in range(6)]  # more than kept, deeper than kept
    ring.write(record(2, name="gloo:all_gather", inputs=[([4], "Float")], outputs=shapes))
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
    ring.write(record(0))
    ring.write(record(1))
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
        ring.write(record(rid))
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
# Each group's last operation is seen completed by the watchdog's next pass; do it now. The native
# core writes each step as it happens; the Python recorder's file is written by the watchdog's
# pass after it (50 ms): wait for that one.
rec.reap()
import time
deadline = time.monotonic() + 10
while not rec.native and (rec._flushed < 4 or rec.dirty) and time.monotonic() < deadline:
    time.sleep(0.01)
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
    assert names == [
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:all_reduce", "default_pg", "completed"),
        ("gloo:_all_gather_base", "pair", "completed"),
    ], names
    gather = data["entries"][-1]
    assert (gather["input_sizes"], gather["output_sizes"]) == ([[2]], [[2]])
    assert data["tether"]["global_rank"] == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recorder", RECORDERS)
def test_a_clean_exit_removes_the_ring_file(tmp_path: Path, recorder: str) -> None:
    proc, ring = run(tmp_path, recorder, "clean")
    assert proc.returncode == 0, proc.stderr
    assert not Path(ring["path"]).exists()
