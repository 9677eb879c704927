"""`tether analyze` on synthetic events in torch's schema: each verdict with its culprit."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests._fr_synth import MS, Synth
from tests.core.test_layers import imports_of
from tether.analyze import analyze, render
from tether.cli.show import summarize


def _steps(job: Synth, n: int = 5, group: str | None = None) -> None:
    for _ in range(n):
        job.collective("all_reduce", group=group)


def test_hang_names_the_rank_that_never_joined_not_rank_0(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[0])
    d = analyze(job.write(tmp_path / "ev"))
    assert d.verdict == "hang"
    assert d.culprit_ranks == [0]
    assert d.process_group is not None and d.process_group.ranks == [0, 1, 2, 3]
    assert (d.collective_seq_id, d.op) == (6, "all_reduce")
    assert d.culprit_stacks[0] == "/src/train.py:40 in train_step"  # main thread, user code
    text = render(d)
    assert "HANG: culprit rank(s) 0" in text and "train.py:40" in text


def test_user_code_in_a_directory_named_tether_is_the_culprits_line(tmp_path: Path) -> None:
    # Only tether's own machinery is passed over, by package path; a checkout in ~/tether keeps
    # its frames, and so does tether's demo job.
    job = Synth(2)
    _steps(job)
    job.collective("all_reduce", skip=[1])
    job.stacks[1] = [
        {
            "thread_id": 1,
            "thread_name": "MainThread",
            "daemon": False,
            "frames": [
                {"name": "python_stacks", "filename": "/h/tether/recorder/frames.py", "line": 9},
                {
                    "name": "wait",
                    "filename": "/v/site-packages/torch/distributed/c10d.py",
                    "line": 1,
                },
                {"name": "train_step", "filename": "/home/x/tether/train.py", "line": 12},
                {"name": "<module>", "filename": "<frozen runpy>", "line": 88},
            ],
        }
    ]
    d = analyze(job.write(tmp_path / "ev"))
    assert d.culprit_ranks == [1]
    assert d.culprit_stacks[1] == "/home/x/tether/train.py:12 in train_step"


def test_hang_in_a_subgroup_cascading_through_the_world_group(tmp_path: Path) -> None:
    job = Synth(4)
    sub = job.group("1", "tp", [2, 3])
    for _ in range(3):
        job.collective("all_reduce")
        job.collective("all_reduce", group=sub)
    job.collective("all_reduce", group=sub, skip=[3])  # rank 2 waits for 3 in the subgroup
    job.collective("all_reduce", skip=[2, 3])  # 0 and 1 wait in the world group
    d = analyze(job.write(tmp_path / "ev"))
    assert d.verdict == "hang"
    assert d.culprit_ranks == [3]
    assert d.process_group is not None and d.process_group.name == "1"
    assert d.collective_seq_id == 4
    assert any("transitively" in e for e in d.evidence)


def test_desync_by_size_names_the_minority(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", sizes_by_rank={2: [[8]]}, incomplete=[0, 1, 2, 3])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("desync", [2], 6)
    assert d.sizes == {"input": [[4]], "output": [[4]]}
    assert any("in size" in e for e in d.evidence)


def test_a_desync_culprit_that_ran_on_is_shown_at_its_mismatched_call(tmp_path: Path) -> None:
    # Rank 2 issued the odd all_reduce and went on: its main thread is in its next step's
    # backward pass (its own code), which is not where the mismatch is.
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", sizes_by_rank={2: [[8]]}, incomplete=[0, 1, 2, 3])
    job.stacks[2] = [
        {"thread_id": 1, "thread_name": "MainThread", "daemon": False, "frames": [
            {"name": "backward", "filename": "/src/train.py", "line": 54},
            {"name": "<module>", "filename": "/src/train.py", "line": 100},
        ]},
    ]  # fmt: skip
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("desync", [2])
    # The call site the recorder kept with that all_reduce (innermost frame: line 10*0 + rank).
    assert d.culprit_stacks[2] == "/src/model/train_0.py:2 in fn0"
    assert "/src/train.py:54" not in render(d)


def test_desync_by_op_and_by_dtype(tmp_path: Path) -> None:
    job = Synth(5)
    _steps(job, 2)
    job.collective("all_reduce", op_by_rank={0: "broadcast"}, incomplete=range(5))
    d = analyze(job.write(tmp_path / "op"))
    assert (d.verdict, d.culprit_ranks, d.op) == ("desync", [0], "all_reduce")
    assert any("in op" in e for e in d.evidence)
    job = Synth(3)
    _steps(job, 2)
    job.collective("all_reduce", dtype_by_rank={1: "BFloat16"}, incomplete=range(3))
    d = analyze(job.write(tmp_path / "dtype"))
    assert (d.verdict, d.culprit_ranks) == ("desync", [1])
    assert any("in dtype" in e for e in d.evidence)


def test_op_aware_sizes_are_not_a_desync(tmp_path: Path) -> None:
    """[n, *shape] and [n * numel] are the same all_gather buffer."""
    job = Synth(2)
    job.collective("_all_gather_base", sizes=[[4]], out_sizes=[[2, 4]], sizes_by_rank={1: [[4]]})
    job.ranks[1].entries[-1]["output_sizes"] = [[8]]
    job.ranks[1].entries[-1]["profiling_name"] = "gloo:all_gather_into_tensor"
    d = analyze(job.write(tmp_path / "ev"))
    assert d.verdict == "healthy", d.evidence


def test_two_rank_tie_names_both_sides(tmp_path: Path) -> None:
    job = Synth(2)
    job.collective("all_reduce", sizes_by_rank={1: [[8]]}, incomplete=[0, 1])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("desync", [0, 1])
    assert any("no majority" in e for e in d.evidence)


def test_crash_recorded_dead_with_last_progress(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 7)
    job.collective("all_reduce", skip=[1])
    for r in (0, 2, 3):
        job.extra[r] = {"alarm": {"reason": "crash", "dead_ranks": {"1": "signal SIGKILL"}}}
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 2, 3]))
    assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("crash", [1], [1])
    assert d.dead_ranks == {1: "signal SIGKILL"}
    assert "all_reduce seq 7" in d.per_rank[1]
    assert d.collective_seq_id == 8


def test_a_collective_broken_by_the_dead_rank_is_not_its_progress(tmp_path: Path) -> None:
    # Survivors' all_reduce #8 failed when rank 1 died: the backend raised, tether recorded it
    # as failed (state "started", retired) and it must not count as completed by rank 1's peers.
    job = Synth(4)
    _steps(job, 7)
    job.collective("all_reduce", skip=[1], incomplete=())
    for r in (0, 2, 3):
        last = job.ranks[r].entries[-1]
        last.update(state="started", retired=True, time_discovered_completed_ns=None)
        job.extra[r] = {
            "alarm": {"reason": "crash", "dead_ranks": {"1": "signal SIGKILL"}},
            "failed": {str(last["record_id"]): "RuntimeError: Connection closed by peer"},
        }
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 2, 3]))
    assert (d.verdict, d.culprit_ranks) == ("crash", [1])
    assert "all_reduce seq 7" in d.per_rank[1]
    assert any("Connection closed by peer" in line for line in d.evidence), d.evidence


def test_missing_dump_without_stacks_is_a_crash_and_with_stacks_a_hang(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    d = analyze(ev)
    assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("crash", [2], [2])
    (ev / "stacks_2.txt").write_text(
        "# rank 2 did not answer\nThread 0x00007f01 (most recent call first):\n"
        '  File "/src/ext.py", line 7 in spin\n  File "/src/train.py", line 99 in <module>\n'
    )
    d = analyze(ev)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2])
    assert d.culprit_stacks[2] == "/src/ext.py:7 in spin"


def test_straggler_with_clock_offsets(tmp_path: Path) -> None:
    # Rank 3's clock runs 2 s behind; only the offset makes its times comparable.
    job = Synth(4, clock_offsets_ns={3: 2_000_000_000, 1: -500_000_000})
    for _ in range(20):
        job.collective("all_reduce", lag_ns={2: 40 * MS})
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("straggler", [2])
    assert 39.0 < d.stragglers[0].mean_lag_ms < 41.0
    assert d.to_json()["stragglers"][0]["rank"] == 2


@pytest.mark.parametrize(("lag_ms", "named"), [(20, False), (1500, True)])
def test_a_straggler_beside_a_hang_is_named_only_when_late_enough_to_matter(
    tmp_path: Path, lag_ms: int, named: bool
) -> None:
    job = Synth(3)
    for _ in range(20):
        job.collective("all_reduce", lag_ns={0: lag_ms * MS})
    job.collective("all_reduce", skip=[2])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("hang", [2])
    assert [s.rank for s in d.stragglers] == ([0] if named else [])
    assert ("straggler rank 0" in render(d)) is named


def test_unmatched_send_named_by_pair(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 2)
    job.p2p(1, 3)
    job.p2p(2, 0, post_recv=False)  # rank 0 never posts the receive
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.op) == ("hang", [0], "send")
    assert [(u.src, u.dst, u.sends, u.recvs) for u in d.unmatched_p2p] == [(2, 0, 1, 0)]


def test_rank_waiting_in_p2p_while_the_rest_wait_in_a_collective(tmp_path: Path) -> None:
    # hang-inside: rank 1 waits for a send from 2 that 2 never posts; 0 and 2 wait in the
    # all_reduce 1 never issued. The culprit is 1 alone, not the cycle {1, 2}.
    job = Synth(3)
    _steps(job, 3)
    job.p2p(2, 1, post_send=False)
    job.collective("all_reduce", skip=[1])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.op, d.collective_seq_id) == ("hang", [1], "all_reduce", 4)
    assert any("rank 1 waits in recv 1<-2 for a send rank 2 never posted" in e for e in d.evidence)
    assert not any("different groups" in e for e in d.evidence)


def test_extra_send_while_the_rest_wait_in_a_collective(tmp_path: Path) -> None:
    # p2p-unmatched: rank 0 sends to 1 twice, 1 receives once; 1 and 2 wait in an all_reduce.
    job = Synth(3)
    _steps(job, 3)
    job.p2p(0, 1)
    job.p2p(0, 1, post_recv=False)
    job.collective("all_reduce", skip=[0])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.op) == ("hang", [0], "all_reduce")
    assert [(u.src, u.dst, u.sends, u.recvs) for u in d.unmatched_p2p] == [(0, 1, 1, 0)]


def test_symmetric_deadlock_across_groups_names_both(tmp_path: Path) -> None:
    job = Synth(2)
    a = job.group("1", "a", [0, 1])
    b = job.group("2", "b", [0, 1])
    _steps(job, 2)
    job.collective("all_reduce", group=a, skip=[1])
    job.collective("all_reduce", group=b, skip=[0])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("hang", [0, 1])
    assert any("different groups" in e for e in d.evidence)


def test_healthy_says_so(tmp_path: Path) -> None:
    job = Synth(4)
    sub = job.group("1", "dp", [0, 2])
    _steps(job, 10)
    _steps(job, 3, group=sub)
    job.p2p(0, 1)
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("healthy", [], [])
    assert "HEALTHY" in render(d)


def test_ring_wrap_around_compares_the_common_window(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 30)
    job.collective("all_reduce", skip=[1])
    job.ring_size = 10
    for r in (0, 2):  # these ranks' rings wrapped further (other work filled them)
        job.ranks[r].entries = job.ranks[r].entries[-4:]
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("hang", [1])
    assert any("wrap-around" in e for e in d.evidence)


def test_torch_gloo_native_quirks(tmp_path: Path) -> None:
    job = Synth(3, flavor="gloo")
    sub = job.group("1", "", [0, 1])
    _steps(job)
    job.collective("all_reduce", group=sub)
    job.collective("all_reduce", skip=[1])
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks) == ("hang", [1])
    assert any("gloo recorder" in e for e in d.evidence)


def test_torchcomms_json_with_recorder_wide_seq_and_other_prefix(tmp_path: Path) -> None:
    job = Synth(4, flavor="torchcomms", backend="ncclx")
    sub = job.group("tp0", "tp", [0, 1, 2, 3])
    for _ in range(3):
        job.collective("all_reduce")
        job.collective("all_gather", group=sub, sizes=[[2]], out_sizes=[[8]])
    job.collective("all_reduce", sizes_by_rank={3: [[5]]}, incomplete=range(4))
    d = analyze(job.write(tmp_path / "ev", prefix="torchcomm_fr_trace_", fmt="json"))
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("desync", [3], 4)


def test_many_ranks(tmp_path: Path) -> None:
    job = Synth(1024, frames_depth=0)
    _steps(job, 3)
    job.collective("all_reduce", skip=[777])
    d = analyze(job.write(tmp_path / "ev"), jobs=1)
    assert (d.verdict, d.culprit_ranks) == ("hang", [777])
    assert len(json.dumps(d.to_json())) < 20_000  # a summary, not a list of 1023 waiters


def _forming(op: str, missing: list[int] | None) -> dict[str, Any]:
    return {"forming": {
        "op": op, "group": "5", "group_desc": "dp", "ranks": [0, 1, 2, 3], "missing": missing,
        "rank": 0, "since_ns": 1, "waited_s": 3.2,
    }}  # fmt: skip


@pytest.mark.parametrize("looked", [True, False])
def test_ranks_waiting_in_a_groups_creation_name_the_member_that_never_arrived(
    tmp_path: Path, looked: bool
) -> None:
    job = Synth(4)
    _steps(job)
    # Ranks 0, 1 and 3 wait in new_group; rank 2 is elsewhere (its own code, in its dump).
    for r in (0, 1, 3):
        job.extra[r] = _forming("new_group", [2] if looked and r == 0 else None)
    d = analyze(job.write(tmp_path / "ev"))
    assert (d.verdict, d.culprit_ranks, d.op) == ("hang", [2], "new_group")
    assert d.process_group is not None and (d.process_group.name, d.process_group.desc) == (
        "5",
        "dp",
    )
    assert "rank(s) 0-1, 3 waited 3.2s in new_group of group 5" in d.evidence[0]
    assert d.per_rank[2] == "never arrived at new_group: it was elsewhere"
    assert d.culprit_stacks[2] == "/src/train.py:42 in train_step"
    # tether show says it too, for each rank that waits.
    shown = summarize(tmp_path / "ev")
    who = "rank(s) [2]" if looked else "members"
    assert shown.count(f"waits in new_group of group 5 (dp) for {who} that never") == (
        1 if looked else 3
    )


def test_a_creation_record_that_is_not_one_is_ignored(tmp_path: Path) -> None:
    job = Synth(2)
    _steps(job)
    job.extra[0] = {"forming": {"op": "new_group", "group": "5", "ranks": ["x"], "missing": 7}}
    job.extra[1] = {"forming": ["new_group"]}
    d = analyze(job.write(tmp_path / "ev"))
    assert d.verdict == "healthy", d.evidence


@pytest.mark.parametrize("module", ["nodes", "crash", "desync", "hang"])
def test_a_verdict_module_returns_its_finding_and_builds_no_diagnosis(module: str) -> None:
    # The engine alone decides between findings and builds the one Diagnosis (docs/architecture.md).
    path = Path(importlib.import_module(f"tether.analyze.{module}").__file__ or "")
    source = path.read_text()
    imported = imports_of(source, f"tether.analyze.{module}", is_package=False)
    assert not imported & {"tether.analyze.report", "tether.analyze.engine"}, imported
    tree = ast.parse(source)
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "Diagnosis" not in called and "Finding" in called, module
