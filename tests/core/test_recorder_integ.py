"""The recorder in real gloo jobs: what a dump holds, event layout, formation, ring wrap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tether
from tests._jobs import WORKERS, launch, new_store
from tether.events.load import load_event
from tether.recorder.group import P2P_SEQ_BASE

pytestmark = [pytest.mark.every_torch, pytest.mark.python_recorder]

WORKER = WORKERS / "basic.py"


def results(job: Any) -> list[dict[str, Any]]:
    return list(job.results())


def line_of(marker: str) -> int:
    lines = WORKER.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"LINE:{marker}" in text)


@pytest.fixture(scope="module")
def ops_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 3-rank job shared by the tests that read its dumps."""
    store = new_store()
    dumps = tmp_path_factory.mktemp("ops") / "dumps"
    return results(launch("basic.py", 3, "--scenario", "ops", port=store.port, dump_dir=dumps))


@pytest.mark.timeout(120)
def test_every_rank_writes_into_one_event_per_dump(ops_job: list[dict[str, Any]]) -> None:
    firsts = {Path(r["first"]).parent for r in ops_job}
    seconds = {Path(r["second"]).parent for r in ops_job}
    assert len(firsts) == 1 and len(seconds) == 1
    (first,), (second,) = firsts, seconds
    assert first != second and first.name < second.name, "event ids sort by time"
    assert first.name.endswith("-manual")
    for event in (first, second):
        assert sorted(p.name for p in event.iterdir()) == [
            *(f"cols_{r}.npz" for r in range(3)),
            *(f"rank_{r}" for r in range(3)),
        ]
    before, _ = load_event(first)
    after, _ = load_event(second)
    # The second dump did not overwrite the first, and saw one more operation.
    assert len(after[0]["entries"]) == len(before[0]["entries"]) + 1


@pytest.mark.timeout(120)
def test_dump_holds_real_torch_schema_fields(ops_job: list[dict[str, Any]]) -> None:
    dumps, errors = load_event(Path(ops_job[0]["first"]).parent)
    assert not errors
    d0 = dumps[0]
    assert d0["version"] == "2.10"
    assert d0["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}
    pair = next(c for c in d0["pg_config"].values() if c["desc"] == "pair")
    assert pair["ranks"] == "[0, 1]"

    names = [e["profiling_name"] for e in d0["entries"]]
    assert names == [
        "gloo:all_reduce",
        "gloo:broadcast",
        "gloo:_all_gather_base",
        "gloo:_reduce_scatter_base",
        "gloo:all_reduce",
        "gloo:send 0->1",
        "gloo:barrier",
    ]
    ag = d0["entries"][2]
    assert ag["input_sizes"] == [[4]] and ag["output_sizes"] == [[12]]
    assert ag["input_dtypes"] == ["Float"]
    pair_op = d0["entries"][4]
    assert pair_op["process_group"][1] == "pair" and pair_op["input_dtypes"] == ["Double"]
    for e in d0["entries"]:
        assert e["state"] == "completed"
        assert e["time_created_ns"] <= e["time_discovered_started_ns"]
        assert e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"]
        assert e["duration_ms"] is not None and e["duration_ms"] >= 0
        assert e["retired"] is True
    # The call site is the worker's own line, not tether's frames.
    top = d0["entries"][0]["frames"]
    site = next(f for f in top if f["filename"].endswith("basic.py"))
    assert site["line"] == line_of("all_reduce")
    assert not any("/tether/recorder/" in f["filename"] for f in top)

    # p2p: recorded on both sides with the peer, matching counts.
    recv = next(e for e in dumps[1]["entries"] if e["is_p2p"])
    assert recv["profiling_name"] == "gloo:recv 1<-0" and recv["p2p_seq_id"] == P2P_SEQ_BASE + 1
    assert not any(e["is_p2p"] for e in dumps[2]["entries"])

    # The same collective has the same sequence number on every rank.
    def world_seq(d: dict[str, Any]) -> list[tuple[int, str]]:
        return [
            (e["collective_seq_id"], e["profiling_name"])
            for e in d["entries"]
            if e["process_group"][0] == "0" and not e["is_p2p"]
        ]

    assert world_seq(dumps[0]) == world_seq(dumps[1]) == world_seq(dumps[2])
    assert [s for s, _ in world_seq(dumps[0])] == [1, 2, 3, 4, 5]
    assert d0["pg_status"]["0"] == {
        "last_enqueued_collective": 5,
        "last_started_collective": 5,
        "last_completed_collective": 5,
    }

    meta = d0["tether"]
    assert meta["global_rank"] == 0 and meta["world_size"] == 3
    assert meta["reason"] == "manual" and meta["backends"] == ["gloo"]
    assert {"host", "pid", "job_id", "torch_version", "clock_offset_ns"} <= meta.keys()
    assert dumps[1]["tether"]["global_rank"] == 1


@pytest.mark.timeout(120)
def test_torch_analyzer_reads_our_event(ops_job: list[dict[str, Any]]) -> None:
    event = Path(ops_job[0]["first"]).parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(event),
            "-p",
            "rank_",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "Error type" not in out


@pytest.mark.timeout(120)
def test_ring_keeps_the_newest_entries(run_job: Any) -> None:
    (r0, _) = results(run_job("basic.py", 2, "--scenario", "wrap", "--ring-size", "16"))
    data = tether.load_dump(r0["dump"])
    entries = data["entries"]
    assert len(entries) == 16
    ids = [e["record_id"] for e in entries]
    assert ids == list(range(ids[0], ids[0] + 16))
    assert entries[-1]["collective_seq_id"] == 50
    assert data["tether"]["ring_size"] == 16


@pytest.mark.timeout(120)
def test_an_operation_in_flight_never_leaves_the_ring_before_it_completes(run_job: Any) -> None:
    (_, r1) = results(run_job("basic.py", 2, "--scenario", "pinned", "--ring-size", "16"))
    first, second = r1["dumps"]
    # 40 all_reduces later the receive is far older than the ring's window, yet in the dump.
    assert first["recvs"] and first["recvs"][0] != "completed", first
    window = first["ids"][-1] + 1 - 16
    assert first["ids"][0] < window and first["ids"][1:] == list(range(window, window + 16))
    assert first["dropped"] == window - 1, first
    # Completed, it goes; the ring's bound holds, and the dump counts what it dropped.
    assert second["recvs"] == [] and len(second["ids"]) == 16, second
    assert second["dropped"] == second["ids"][0], second


@pytest.mark.timeout(120)
def test_a_recv_from_any_source_says_who_sent(run_job: Any) -> None:
    """torch asks a recv's work for ``_source_rank()`` and ``_get_op_type()``: answered as plain
    torch answers, on either recorder."""
    r0, _ = results(run_job("basic.py", 2, "--scenario", "anysource"))
    assert (r0["src"], r0["source_rank"], r0["op"]) == (1, 1, r0["recvanysource"]), r0
    assert [op for op in r0["ops"] if "recv" in op] == ["gloo:recv 0<--1"] * 2, r0["ops"]


@pytest.mark.timeout(120)
def test_monitored_barrier_is_recorded(run_job: Any) -> None:
    """A synchronous operation with no work: started as called, completed when it returned."""
    for result in results(run_job("basic.py", 2, "--scenario", "monitored")):
        assert result["ops"] == [["gloo:monitored_barrier", 1, "completed"],
                                 ["gloo:monitored_barrier", 2, "completed"]], result  # fmt: skip


@pytest.mark.timeout(120)
def test_missing_rank_is_named_when_the_group_is_created(run_job: Any) -> None:
    r0, r1, r2 = results(run_job("basic.py", 3, "--scenario", "formation"))
    assert r2 == {"skipped": True}
    for r in (r0, r1):
        assert r["missing"] == [2]
        assert "rank(s) [2] never arrived" in r["error"]
