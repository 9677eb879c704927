"""Hangs in real gloo jobs: every live rank dumps into one event, the culprit's stack included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs import WORKERS, start
from tether.events.load import load_event
from tether.job.alarm import HANG_EXIT_CODE

pytestmark = pytest.mark.every_torch

FAULTS = WORKERS / "faults.py"


def line_of(marker: str) -> int:
    lines = FAULTS.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def events(dump_dir: Path, suffix: str) -> list[Path]:
    return sorted(p for p in dump_dir.iterdir() if p.is_dir() and p.name.endswith(suffix))


def hang_event(dump_dir: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    (event,) = events(dump_dir, "-hang")
    dumps, errors = load_event(event)
    assert not errors, errors
    return event, dumps


def main_thread(dump: dict[str, Any]) -> list[dict[str, Any]]:
    (thread,) = [t for t in dump["tether"]["stacks"] if t["thread_name"] == "MainThread"]
    return list(thread["frames"])


def in_flight(dump: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in dump["entries"] if e["state"] != "completed"]


@pytest.mark.timeout(120)
def test_sleeping_rank_every_rank_dumps_and_culprit_stack_shows_the_line(
    run_job: Any, tmp_path: Path
) -> None:
    job = run_job("faults.py", 3, "--fault", "sleep", "--culprit", "1", "--dump-at-start")
    assert job.returncodes == [HANG_EXIT_CODE] * 3, job.outputs
    event, dumps = hang_event(tmp_path / "dumps")
    assert sorted(dumps) == [0, 1, 2]
    for rank, dump in dumps.items():
        alarm = dump["tether"]["alarm"]
        assert alarm["reason"] == "hang" and alarm["event_id"] == event.name
        assert dump["tether"]["global_rank"] == rank
    # The healthy ranks are inside step 2's all_reduce (world seq 3); the culprit never issued it.
    for rank in (0, 2):
        (op,) = in_flight(dumps[rank])
        assert (op["profiling_name"], op["collective_seq_id"]) == ("gloo:all_reduce", 3)
        assert op["state"] == "started" and op["time_discovered_completed_ns"] is None
    assert in_flight(dumps[1]) == []
    culprit = main_thread(dumps[1])
    assert any(
        f["filename"].endswith("faults.py") and f["line"] == line_of("STUCK:sleep") for f in culprit
    )
    # The earlier event is still there, untouched.
    (start,) = events(tmp_path / "dumps", "-start")
    before, errors = load_event(start)
    assert not errors and sorted(before) == [0, 1, 2]
    assert all(d["tether"]["reason"] == "start" for d in before.values())
    said = f"every rank's dump is in {event}"
    assert all(said in text for text in job.outputs), job.outputs


@pytest.mark.timeout(120)
def test_rank_stuck_inside_a_collective_dumps_itself(run_job: Any, tmp_path: Path) -> None:
    job = run_job("faults.py", 3, "--fault", "inside", "--culprit", "1")
    # The culprit may see its peers leave before it aborts: any failure is right for it.
    assert job.returncodes[0] == job.returncodes[2] == HANG_EXIT_CODE, job.outputs
    assert job.returncodes[1] != 0
    _, dumps = hang_event(tmp_path / "dumps")
    assert sorted(dumps) == [0, 1, 2]
    (op,) = in_flight(dumps[1])
    assert op["profiling_name"] == "gloo:recv 1<-2" and op["is_p2p"]
    assert any(f["line"] == line_of("STUCK:inside") for f in op["frames"])
    assert any(f["line"] == line_of("STUCK:inside") for f in main_thread(dumps[1]))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_rank_holding_the_gil_leaves_its_stacks(store: Any, tmp_path: Path) -> None:
    procs = start(
        "faults.py", 3, "--fault", "gil", "--culprit", "1", "--gil-seconds", "600",
        port=store.port, dump_dir=tmp_path / "dumps", log_dir=tmp_path / "logs",
    )  # fmt: skip
    try:
        # The healthy ranks dump, collect the culprit's stacks and abort; the culprit cannot
        # run Python at all, so it is ended the way torchrun would end it.
        assert [procs[r].wait(100) for r in (0, 2)] == [HANG_EXIT_CODE] * 2
        assert procs[1].poll() is None, "the culprit is still stuck holding the GIL"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    event, dumps = hang_event(tmp_path / "dumps")
    assert {0, 2} <= set(dumps)
    stacks = (event / "stacks_1.txt").read_text()
    assert "did not answer hang alarm" in stacks
    assert f'faults.py", line {line_of("STUCK:gil")} in hold_the_gil' in stacks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hang_in_a_subgroup_while_other_groups_run(run_job: Any, tmp_path: Path) -> None:
    job = run_job("faults.py", 4, "--fault", "subgroup", "--culprit", "1")
    assert job.returncodes == [HANG_EXIT_CODE] * 4, job.outputs
    _, dumps = hang_event(tmp_path / "dumps")
    assert sorted(dumps) == [0, 1, 2, 3]
    (op,) = in_flight(dumps[0])
    assert op["process_group"][1] == "sub" and op["profiling_name"] == "gloo:all_reduce"
    for rank in (2, 3):
        pair_ops = [e for e in dumps[rank]["entries"] if e["process_group"][1] == "pair"]
        assert len(pair_ops) == 20 and all(e["state"] == "completed" for e in pair_ops)
        (stuck,) = in_flight(dumps[rank])
        assert stuck["process_group"][1] == "default_pg"
    assert any(f["line"] == line_of("STUCK:subgroup") for f in main_thread(dumps[1]))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_other_groups_traffic_cannot_evict_the_hung_operation(run_job: Any, tmp_path: Path) -> None:
    job = run_job("faults.py", 3, "--fault", "evict", "--culprit", "1", "--ring-size", "16")
    assert HANG_EXIT_CODE in job.returncodes and 0 not in job.returncodes, job.outputs
    _, dumps = hang_event(tmp_path / "dumps")
    for rank in (0, 2):
        entries = dumps[rank]["entries"]
        rest = [e for e in entries if e["process_group"][1] == "rest"]
        assert len(rest) >= 16, "the flood filled the ring"
        (hung,) = [e for e in entries if e["state"] != "completed"]
        assert (hung["process_group"][1], hung["collective_seq_id"]) == ("default_pg", 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_on_hang_dump_keeps_the_job_running(run_job: Any, tmp_path: Path) -> None:
    job = run_job("faults.py", 3, "--fault", "sleep", "--on-hang", "dump", "--sleep-seconds", "4")
    job.check()
    _, dumps = hang_event(tmp_path / "dumps")
    assert sorted(dumps) == [0, 1, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("issued", ["before", "after"])
def test_ranks_waiting_on_a_rank_that_crashed_raise_no_hang(
    run_job: Any, tmp_path: Path, issued: str
) -> None:
    # The culprit raises: its crash alarm makes every rank dump. Its process then takes longer
    # to go than the others' hang timeout: what they wait in is that crash, not a new hang, and
    # they do not abort as after a hang; also where they issued it after the crash's dumps (a
    # rank slow to reach it).
    linger = {"TETHER_EXIT_LINGER": "5"}  # as under tether run
    late = ["--after-crash"] if issued == "after" else []
    job = run_job("faults.py", 3, "--fault", "raise", "--culprit", "1", *late, env=linger)
    assert job.returncodes == [1, 1, 1], job.outputs
    dumps_dir = tmp_path / "dumps"
    assert events(dumps_dir, "-hang") == []
    (event,) = events(dumps_dir, "-crash")
    dumps, errors = load_event(event)
    assert not errors and sorted(dumps) == [0, 1, 2]
    assert dumps[1]["tether"]["exception"]["type"] == "ValueError"
    for rank in (0, 2):
        if issued == "before":
            (op,) = in_flight(dumps[rank])
            assert (op["profiling_name"], op["collective_seq_id"]) == ("gloo:all_reduce", 3)
        else:  # dumped before they issued it
            assert in_flight(dumps[rank]) == []
        assert f"waits on the crash of event {event.name}" in job.outputs[rank]
