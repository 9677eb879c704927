"""`tether analyze`'s verdicts where the evidence is partial or indirect: cascades ending in a
rank without a dump, roots stuck inside an operation, groups the ring dropped, coalesced
collectives, unreadable and absent dumps, ties."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._fr_synth import MS, Synth
from tether.analyze import analyze, findings, render
from tether.events.stacks import format_header


def _steps(job: Synth, n: int = 3, group: str | None = None) -> None:
    for _ in range(n):
        job.collective("all_reduce", group=group)


# -- a rank without a dump at the end of a chain of waits (crash, not a deadlock) -------------
def test_cascade_ending_in_a_rank_without_a_dump_is_its_crash(tmp_path: Path) -> None:
    # 2 waits for 3 in pair23; 0 and 1 wait for 2 (and 3) in the world group; 3 left nothing.
    job = Synth(4)
    sub = job.group("1", "pair23", [2, 3])
    for _ in range(3):
        job.collective("all_reduce")
        job.collective("all_reduce", group=sub)
    job.collective("all_reduce", group=sub, skip=[3])
    job.collective("all_reduce", skip=[2, 3])
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1, 2]), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash", [3]), d.evidence
    assert d.process_group is not None and d.process_group.desc == "pair23"
    assert d.collective_seq_id == 4
    assert not any("deadlock" in e for e in d.evidence)


def test_pipeline_ending_in_a_rank_without_a_dump_is_its_crash(tmp_path: Path) -> None:
    # 2 waits for a send from 3, 1 for one from 2, 0 for one from 1; 3 left nothing.
    job = Synth(4)
    _steps(job)
    job.p2p(3, 2, post_send=False)
    job.p2p(2, 1, post_send=False)
    job.p2p(1, 0, post_send=False)
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1, 2]), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.op) == ("crash", [3], "recv"), d.evidence
    assert d.collective_seq_id is None  # p2p: no group sequence number


# -- a root that waits for nobody: stuck inside an operation everyone issued -----------------
def test_a_root_stuck_inside_an_operation_is_the_culprit_not_a_deadlock(tmp_path: Path) -> None:
    # 1 and 3 are stuck inside x13 #1 (both issued it); 2 waits for 3 in pair23; 0 and 1 in the
    # world group. No cycle: 3 is the root, 2 only waits on it.
    job = Synth(4)
    sub = job.group("1", "pair23", [2, 3])
    x = job.group("2", "x13", [1, 3])
    for _ in range(3):
        job.collective("all_reduce")
        job.collective("all_reduce", group=sub)
    job.collective("all_reduce", group=x, incomplete=[1, 3])
    job.collective("all_reduce", group=sub, skip=[3])
    job.collective("all_reduce", skip=[2, 3], incomplete=[0, 1])
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [3]), d.evidence
    assert d.process_group is not None and d.process_group.desc == "pair23"
    assert not any("deadlock" in e for e in d.evidence)
    assert any("rank 3 waits on no one: it is stuck inside" in e for e in d.evidence)
    assert d.per_rank[3].startswith("stuck inside all_reduce seq 1 of group 2 (x13)")


def test_gloo_inferred_subgroup_is_where_the_idle_root_is_missing(tmp_path: Path) -> None:
    # torch's gloo recorder writes no membership: group 1 ([1, 2]) is known only from rank 1,
    # stuck inside it; rank 2 never issued it; 0 waits in the world group.
    job = Synth(3, flavor="gloo")
    sub = job.group("1", "", [1, 2])
    _steps(job)
    job.collective("all_reduce", group=sub, skip=[2])
    job.collective("all_reduce", skip=[1, 2])
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence
    assert d.process_group is not None and d.process_group.name == "1"
    assert d.collective_seq_id == 1


# -- pg_status of a group the ring dropped ---------------------------------------------------
def test_pg_status_of_a_group_the_ring_dropped_counts(tmp_path: Path) -> None:
    # 0 and 1 both issued dp01 #1 and are stuck in it; 1 went on in tp12 until its ring held
    # nothing else. Its pg_status still says it enqueued dp01 #1: it is not missing from it.
    job = Synth(3)
    a = job.group("1", "dp01", [0, 1])
    b = job.group("2", "tp12", [1, 2])
    _steps(job)
    job.collective("all_reduce", group=a, incomplete=[0, 1])
    _steps(job, 20, group=b)
    job.ring_size = 10
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert d.verdict == "hang" and d.culprit_ranks == [], d.evidence
    assert d.process_group is not None and d.process_group.desc == "dp01"
    assert any("no rank is missing from it" in e for e in d.evidence)


# -- coalesced collectives: several entries under one seq -----------------------------------
def _coalesced(job: Synth) -> Synth:
    """Every collective recorded twice under its seq, as torch records a coalescing group."""
    for st in job.ranks:
        out = []
        for e in st.entries:
            twin = copy.deepcopy(e)
            twin["input_sizes"] = twin["output_sizes"] = [[16]]
            out += [e, twin]
        for k, e in enumerate(out):
            e["record_id"] = k
        st.entries = out
    return job


def test_coalesced_ring_wrapped_mid_seq_is_not_a_desync(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job, 12)
    job = _coalesced(job)
    job.ranks[0].entries = job.ranks[0].entries[5:]  # starts at the second op of seq 3
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert d.verdict == "healthy", d.evidence


def test_coalesced_desync_in_a_later_op_of_the_seq(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job, 6)
    job = _coalesced(job)
    job.ranks[2].entries[7]["input_sizes"] = [[32]]  # seq 4's second op
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("desync", [2], 4), d.evidence
    assert d.sizes == {"input": [[16]], "output": [[16]]}


def test_coalesced_straggler(tmp_path: Path) -> None:
    job = Synth(3)
    for _ in range(12):
        job.collective("all_reduce", lag_ns={2: 40 * MS})
    d = analyze(_coalesced(job).write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("straggler", [2]), d.evidence
    assert d.stragglers[0].collectives == 12  # one per seq, not per entry


# -- unreadable and absent dumps -------------------------------------------------------------
def test_an_unreadable_dump_with_a_suffix_is_not_a_silent_death(tmp_path: Path) -> None:
    # rank_2.pkl was written (rank 2 was alive to dump) but cannot be read: others wait for it.
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    (ev / "rank_2.pkl").write_bytes(b"\x80\x04garbage")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("hang", [2], [2]), d.evidence


def test_an_unreadable_dump_and_nothing_else_is_inconclusive(tmp_path: Path) -> None:
    for name in ("rank_2", "rank_2.pkl"):
        job = Synth(3)
        _steps(job, 5)
        ev = job.write(tmp_path / name, ranks=[0, 1])
        (ev / name).write_bytes(b"\x80\x04garbage")
        d = analyze(ev, jobs=0)
        assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("inconclusive", [], [2]), name


def test_absent_dumps_without_evidence_are_inconclusive(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 6)
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1]), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.missing_dumps) == ("inconclusive", [], [2, 3])
    assert any("rank(s) 2-3 left no usable dump and nothing says why" in e for e in d.evidence)
    assert render(d).splitlines()[1] == "INCONCLUSIVE: no usable dump from rank(s) 2-3"


def test_absent_dump_with_an_alarm_is_a_crash(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 6)
    for r in (0, 1, 3):
        job.extra[r] = {"alarm": {"reason": "crash", "dead_ranks": {"2": "exit code 1"}}}
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1, 3]), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash", [2])


# -- a tie reports no side as the reference --------------------------------------------------
def test_a_tie_reports_both_sides_whichever_holds_rank_0(tmp_path: Path) -> None:
    got = []
    for big in ([0, 1], [2, 3]):
        job = Synth(4)
        _steps(job)
        job.collective("all_reduce", sizes_by_rank={r: [[8]] for r in big}, incomplete=range(4))
        d = analyze(job.write(tmp_path / str(big[0])), jobs=0)
        assert (d.verdict, d.culprit_ranks) == ("desync", [0, 1, 2, 3])
        assert sorted(d.per_rank) == [0, 1, 2, 3]
        got.append((d.sizes, d.dtypes, d.op))
    assert got[0] == got[1] == (None, None, "all_reduce")


# == deaths, aborts, the alarm's time and frozen ranks (the fault corpus's hard cases) =========
ABORT = "signal SIGABRT"
RESET = "RuntimeError: [gloo] Connection reset by peer"
S = 1_000_000_000


def _stacks_file(ev: Path, rank: int, body: str = "", **header: object) -> None:
    head = format_header({"rank": rank, "host": "host0", "pid": 1000 + rank, **header})  # type: ignore[typeddict-item]
    (ev / f"stacks_{rank}.txt").write_text(
        head
        + (
            body
            or "Thread 0x00007f01 (most recent call first):\n"
            '  File "/src/ext.py", line 7 in spin\n  File "/src/train.py", line 99 in <module>\n'
        )
    )


# -- 1. a desync that makes the backend kill a rank ---------------------------------------------
@pytest.mark.parametrize(
    ("world", "odd", "victim", "kw"),
    [
        (4, 2, 3, {"sizes_by_rank": {2: [[16]]}}),
        (5, 0, 1, {"sizes_by_rank": {0: [[32]]}}),
        (4, 1, 2, {"dtype_by_rank": {1: "Double"}}),
        (6, 4, 5, {"dtype_by_rank": {4: "Long"}, "sizes_by_rank": {4: [[4]]}}),
    ],
)
def test_a_backend_abort_over_a_mismatch_is_a_desync_with_the_aborted_rank_a_consequence(
    tmp_path: Path, world: int, odd: int, victim: int, kw: dict[str, object]
) -> None:
    job = Synth(world)
    _steps(job)
    job.collective("all_reduce", incomplete=range(world), **kw)  # type: ignore[arg-type]
    survivors = [r for r in range(world) if r != victim]
    job.fail_last(survivors, RESET)
    job.alarm("crash", dead_ranks={str(victim): ABORT})
    d = analyze(job.write(tmp_path / "ev", ranks=survivors), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("desync", [odd], 4), d.evidence
    assert list(d.consequences) == [victim] and victim not in d.culprit_ranks
    assert d.dead_ranks == {victim: ABORT}
    assert any(f"rank {victim} died ({ABORT})" in e and "consequence" in e for e in d.evidence)
    assert d.sizes == {"input": [[4]], "output": [[4]]} and d.dtypes is not None
    assert d.dtypes["input"] == ["Float"]
    theirs = "Double" if "dtype_by_rank" in kw and odd == 1 else ("Long" if odd == 4 else "Float")
    assert theirs in d.per_rank[odd], d.per_rank
    assert any(RESET in e for e in d.evidence)
    assert d.to_json()["consequences"] == {str(victim): d.consequences[victim]}
    assert f"rank {victim:<5} (a consequence, not the cause) died ({ABORT})" in render(d)


def test_an_even_split_with_an_aborted_rank_sides_it_with_the_smaller_buffer(
    tmp_path: Path,
) -> None:
    # 3 ranks: 2 sends 16 floats where 0 and 1 expect 8; gloo aborts 0 (it received more than
    # it expected). The dumps left (1: 8, 2: 16) tie; how 0 died says which side it was on.
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", incomplete=range(3), sizes_by_rank={2: [[16]]}, sizes=[[8]])
    job.fail_last([1, 2], RESET)
    job.alarm("crash", dead_ranks={"0": ABORT})
    d = analyze(job.write(tmp_path / "ev", ranks=[1, 2]), jobs=0)
    assert (d.verdict, d.culprit_ranks, list(d.consequences)) == ("desync", [2], [0]), d.evidence
    assert any("an inference from how it died" in e for e in d.evidence)


def test_an_even_split_with_a_rank_killed_otherwise_stays_a_tie(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", incomplete=range(3), sizes_by_rank={2: [[16]]}, sizes=[[8]])
    job.fail_last([1, 2], RESET)
    job.alarm("crash", dead_ranks={"0": "signal SIGKILL"})
    d = analyze(job.write(tmp_path / "ev", ranks=[1, 2]), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("desync", [1, 2]), d.evidence
    assert any("no majority" in e for e in d.evidence)


def test_an_aborted_odd_rank_whose_record_is_lost_is_the_crash_and_no_survivor_is_blamed(
    tmp_path: Path,
) -> None:
    # The odd rank (1, smaller buffer) is the one gloo aborted: the survivors agree.
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", incomplete=range(4), sizes_by_rank={1: [[2]]})
    job.fail_last([0, 2, 3], RESET)
    job.alarm("crash", dead_ranks={"1": ABORT})
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 2, 3]), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.consequences) == ("crash", [1], {}), d.evidence
    assert any(
        "survivors' records agree" in e and "cannot be told" in e and "Received data size" in e
        for e in d.evidence
    ), d.evidence


def test_a_dead_rank_whose_own_record_shows_a_failed_op_is_a_consequence(tmp_path: Path) -> None:
    # Rank 2 was SIGKILLed; rank 0 then died of the broken connection (its recovered record
    # shows the failed all_reduce). The culprit is 2 alone.
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    job.fail_last([0, 1, 3], RESET)
    job.alarm("crash", dead_ranks={"2": "signal SIGKILL", "0": "exit code 1"})
    job.extra[0]["recovered"] = {"after_death": True, "how": "from its shared-memory ring"}
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1, 3]), jobs=0)
    assert (d.verdict, d.culprit_ranks, list(d.consequences)) == ("crash", [2], [0]), d.evidence


# -- 2. a dead rank's record and stacks --------------------------------------------------------
def test_a_recovered_record_is_used_like_a_dump_and_said_to_be_recovered(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", incomplete=range(4), sizes_by_rank={3: [[64]]})
    job.fail_last([0, 1, 2], RESET)
    job.alarm("crash", dead_ranks={"3": ABORT}, ranks=[0, 1, 2])
    job.extra[3] = {"recovered": {"after_death": True, "how": "from its shared-memory ring"}}
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.recovered_ranks) == ("desync", [3], [3]), d.evidence
    assert "[[64]]" in d.per_rank[3]
    assert any(
        "rank 3's record was recovered after its death (from its shared-memory ring)" in e
        for e in d.evidence
    )
    assert d.to_json()["recovered_ranks"] == [3]


def test_the_stacks_at_death_are_named_and_a_sigkill_says_what_is_lost(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[1, 3])
    job.fail_last([0, 2], RESET)
    job.alarm("crash", dead_ranks={"1": "signal SIGSEGV", "3": "signal SIGKILL"})
    ev = job.write(tmp_path / "ev", ranks=[0, 2])
    _stacks_file(ev, 1, method="fatal-signal", when="death", signal="SIGSEGV")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash", [1, 3]), d.evidence
    assert "rank 1's stacks at its death (SIGSEGV) are in stacks_1.txt" in d.evidence
    assert d.culprit_stacks[1] == "/src/ext.py:7 in spin"
    assert any(
        "rank 3 died of SIGKILL: no handler can run on SIGKILL, so its stacks at its death and "
        "its record are lost" in e
        for e in d.evidence
    ), d.evidence


def test_a_stacks_file_written_at_death_makes_a_crash_without_an_alarm(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    _stacks_file(ev, 2, method="fatal-signal", when="death", signal="SIGABRT")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks, d.dead_ranks) == ("crash", [2], {2: "signal SIGABRT"})
    assert not any("never answered" in e for e in d.evidence)


# -- 4. the alarm and time ---------------------------------------------------------------------
def _busy_side_group(dump_order: list[int]) -> Synth:
    """4 ranks: 1 waits in pair13's all_reduce #2, which 3 never issues; background threads drive
    group "bg" (every rank) on, so each rank is caught microseconds into a different bg seq when
    it dumps (in ``dump_order``, a millisecond apart)."""
    job = Synth(4)
    pair = job.group("1", "pair13", [1, 3])
    bg = job.group("2", "bg", [0, 1, 2, 3])
    _steps(job)
    job.collective("all_reduce", group=pair)
    _steps(job, 3, group=bg)
    job.collective("all_reduce", group=pair, skip=[3])
    raised = job.now(1) - job.step_ns + 15 * S
    job.alarm(
        group="1", group_desc="pair13", seq=2, op="gloo:all_reduce", seen_by=1, age_s=15.0,
        timeout_s=15.0, time_ns=raised,
    )  # fmt: skip
    for i, r in enumerate(dump_order):
        dumped = raised + (i + 1) * MS
        st = job.ranks[r]
        for _ in range(i):  # the later a rank dumps, the further its side group got
            job.collective("all_reduce", group=bg, skip=[m for m in range(4) if m != r])
            st.entries[-1].update(state="completed", retired=True)
        st.now_ns = dumped - 20_000
        job.collective("all_reduce", group=bg, skip=[m for m in range(4) if m != r])
        job.extra.setdefault(r, {}).update(dump_time_ns=dumped, hang_timeout_s=15.0)
    return job


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]])
@pytest.mark.parametrize("straddle", [False, True])
def test_a_busy_side_group_is_not_a_wait_and_the_answer_is_the_same_every_time(
    tmp_path: Path, order: list[int], straddle: bool
) -> None:
    job = _busy_side_group(order)
    if straddle:  # the first to dump was caught in a bg op it issued just before the alarm
        first = job.ranks[order[0]].entries[-1]
        first["time_created_ns"] = job.extra[order[0]]["alarm"]["time_ns"] - 50 * MS
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.op, d.collective_seq_id) == ("hang", [3], "all_reduce", 2)
    assert d.process_group is not None and d.process_group.desc == "pair13", d.evidence


def test_an_older_alarm_names_its_operation_in_its_detail_line(tmp_path: Path) -> None:
    job = _busy_side_group([2, 0, 3, 1])
    for extra in job.extra.values():
        a = extra["alarm"]
        for key in ("group", "group_desc", "seq", "op", "seen_by", "age_s", "timeout_s"):
            del a[key]
        a["detail"] = "gloo:all_reduce #2 on group 1 (pair13) in flight 15.0s on rank 1"
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("hang", [3], 2), d.evidence


def test_a_rank_that_reaches_the_hung_collective_after_the_alarm_is_the_culprit(
    tmp_path: Path,
) -> None:
    # 0, 1, 3 wait in all_reduce #4; rank 2 was held up and issued it 3 s after the alarm (its
    # stacks collection let it go): by then it even completed on rank 2.
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    t_hung = job.now(0) - job.step_ns
    raised = t_hung + 15 * S
    job.ranks[2].now_ns = raised + 3 * S
    job.collective("all_reduce", group=job.world, skip=[0, 1, 3], incomplete=())
    for st in job.ranks:  # one all_reduce #4 per rank
        assert st.seq["0"] == 4
    job.alarm(
        group="0", group_desc="default_pg", seq=4, op="gloo:all_reduce", seen_by=0, age_s=15.0,
        timeout_s=15.0, time_ns=raised,
    )  # fmt: skip
    for r in (0, 1, 3):
        job.extra[r]["dump_time_ns"] = raised + 10 * MS
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("hang", [2], 4), d.evidence
    assert d.per_rank[2].startswith("arrived late: issued all_reduce seq 4 3.0 s after the alarm")
    assert any("only after the alarm was raised" in e for e in d.evidence)


@pytest.mark.parametrize("late_s", [3, 0])
def test_a_late_rank_that_caught_up_before_the_dumps_is_still_the_culprit(
    tmp_path: Path, late_s: int
) -> None:
    # The dumps were written after rank 2, held up past the alarm, issued all_reduce #4: it
    # completed everywhere and the job went on to #5. Nobody waits; the alarm still names #4,
    # and rank 2 issued it after the alarm was raised. Entering it before the alarm (late_s=0,
    # the op then completing by itself) blames no one.
    job = Synth(3)
    _steps(job)
    start = job.now(0)
    raised = start + 15 * S
    job.collective("all_reduce", lag_ns={2: 15 * S + late_s * S - (0 if late_s else 5 * S)})
    job.collective("all_reduce")
    job.alarm(group="0", seq=4, op="gloo:all_reduce", seen_by=0, timeout_s=15.0, time_ns=raised)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    if late_s:
        assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("hang", [2], 4), d.evidence
        assert d.per_rank[2].startswith("arrived late: issued all_reduce seq 4 3.0 s after")
        assert any("it completed once they had" in e for e in d.evidence), d.evidence
    else:
        assert (d.verdict, d.culprit_ranks) == ("healthy", []), d.evidence


def test_two_late_ranks_are_both_culprits(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[1, 2])
    raised = job.now(0) - job.step_ns + 15 * S
    for r, after in ((1, 2 * S), (2, 3 * S)):
        job.ranks[r].now_ns = raised + after
        job.collective("all_reduce", skip=[m for m in range(4) if m != r], incomplete=[r])
    job.alarm(group="0", seq=4, op="gloo:all_reduce", seen_by=0, timeout_s=15.0, time_ns=raised)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("hang", [1, 2], 4), d.evidence
    assert d.per_rank[1].startswith("arrived late") and d.per_rank[2].startswith("arrived late")


def test_within_the_clocks_error_a_rank_is_not_late(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    raised = job.now(0) - job.step_ns + 15 * S
    job.ranks[2].now_ns = raised + 2 * MS
    job.collective("all_reduce", skip=[0, 1], incomplete=[2])
    job.alarm(group="0", seq=4, op="gloo:all_reduce", seen_by=0, timeout_s=15.0, time_ns=raised)
    job.extra[2]["clock_error_ns"] = 5 * MS  # rank 2 is on another host, its clock less sure
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", []), d.evidence
    assert any("no rank is missing from it" in e for e in d.evidence)


def test_the_alarms_operation_is_the_one_in_question(tmp_path: Path) -> None:
    # Two groups hang independently on different ranks; the alarm names dp's, so dp's is shown.
    job = Synth(4)
    a = job.group("1", "tp", [0, 1])
    b = job.group("2", "dp", [2, 3])
    _steps(job)
    job.collective("all_reduce", group=a, skip=[1])
    job.collective("all_reduce", group=b, skip=[3])
    job.alarm(group="2", group_desc="dp", seq=1, op="gloo:all_reduce", seen_by=2, time_ns=0)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert d.verdict == "hang" and d.process_group is not None, d.evidence
    assert d.process_group.desc == "dp"


# -- 5. a preempted healthy job, a frozen rank --------------------------------------------------
def test_a_signal_with_nothing_older_than_the_timeout_is_healthy(tmp_path: Path) -> None:
    # SIGTERM during a healthy run: an all_gather 34 ms old, already completed on rank 3.
    job = Synth(4)
    _steps(job, 6)
    job.collective("all_gather", sizes=[[4]], out_sizes=[[16]], incomplete=[0, 1, 2])
    job.alarm("signal", detail="the launcher received SIGTERM")
    for r in range(4):
        job.extra[r].update(dump_time_ns=job.now(r) - job.step_ns + 34 * MS, hang_timeout_s=15.0)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("healthy", []), d.evidence
    assert d.evidence[0] == "stopped by a signal; nothing was stuck"
    assert any("34 ms old" in e for e in d.evidence)


def test_a_signal_while_an_operation_is_past_the_timeout_is_still_a_hang(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job, 6)
    job.collective("all_reduce", skip=[2])
    job.alarm("signal", detail="the launcher received SIGTERM")
    for r in range(4):
        job.extra[r].update(dump_time_ns=job.now(r) + 20 * S, hang_timeout_s=15.0)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence


@pytest.mark.parametrize(
    ("state", "syscall", "says"),
    [
        ("stopped", None, "alive but stopped (SIGSTOP or a debugger)"),
        ("disk-sleep", "read", "alive but stuck in the kernel (uninterruptible sleep in read)"),
        ("sleeping", "nanosleep", "alive but blocked in nanosleep and did not answer the alarm"),
    ],
)
def test_a_frozen_rank_is_a_hang_in_its_own_words_not_a_death(
    tmp_path: Path, state: str, syscall: str | None, says: str
) -> None:
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1, 3])
    _stacks_file(ev, 2, method="py-spy", when="unresponsive", state=state, syscall=syscall)
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence
    assert d.unresponsive_ranks == {2: state}
    assert says in d.per_rank[2]
    assert any(
        e.startswith(f"rank 2 is {says}") and "issued nothing since" in e for e in d.evidence
    )
    assert not any("died" in e or "never answered" in e for e in d.evidence), d.evidence
    assert d.culprit_stacks[2] == "/src/ext.py:7 in spin"


def test_a_frozen_rank_nobody_waits_for_yet_is_the_hang(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job, 5)
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    _stacks_file(ev, 2, method="py-spy", when="unresponsive", state="stopped")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence


def test_a_desync_culprits_line_is_the_mismatched_operations_call_site(tmp_path: Path) -> None:
    # Rank 2's main thread is inside torch (no line of the job's); it issued the odd all_reduce
    # #4 at train.py:77 and is now stuck in #5, issued at train.py:90.
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", sizes_by_rank={2: [[16]]})
    job.collective("all_reduce", incomplete=range(3))
    entries = job.ranks[2].entries
    entries[-2]["frames"] = [{"filename": "/src/train.py", "line": 77, "name": "step"}]
    entries[-1]["frames"] = [{"filename": "/src/train.py", "line": 90, "name": "step"}]
    torch_frame = {
        "filename": "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
        "line": 2800,
        "name": "all_reduce",
    }
    job.stacks[2] = [{"thread_name": "MainThread", "daemon": False, "frames": [torch_frame]}]
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.collective_seq_id) == ("desync", [2], 4), d.evidence
    assert d.culprit_stacks[2] == "/src/train.py:77 in step"


@pytest.mark.parametrize(("world", "root"), [(4, 0), (5, 3)])
def test_a_broadcast_root_that_aborts_every_receiver_is_the_odd_one(
    tmp_path: Path, world: int, root: int
) -> None:
    job = Synth(world)
    _steps(job)
    job.collective("broadcast", incomplete=range(world), sizes_by_rank={root: [[16]]})
    job.fail_last([root], RESET)
    receivers = [r for r in range(world) if r != root]
    job.alarm("crash", dead_ranks={str(r): ABORT for r in receivers})
    d = analyze(job.write(tmp_path / "ev", ranks=[root]), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.op) == ("desync", [root], "broadcast"), d.evidence
    assert sorted(d.consequences) == receivers
    assert any("an inference from how the others died" in e for e in d.evidence)


@pytest.mark.parametrize(("world", "how"), [(2, ABORT), (4, "signal SIGKILL")])
def test_a_lone_survivor_is_not_blamed_without_a_majority_of_aborts(
    tmp_path: Path, world: int, how: str
) -> None:
    job = Synth(world)
    _steps(job)
    job.collective("broadcast", incomplete=range(world), sizes_by_rank={0: [[16]]})
    job.fail_last([0], RESET)
    job.alarm("crash", dead_ranks={str(r): how for r in range(1, world)})
    d = analyze(job.write(tmp_path / "ev", ranks=[0]), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash", list(range(1, world))), d.evidence


def test_a_hang_dumped_alone_names_its_operation_in_its_detail(tmp_path: Path) -> None:
    # No store to raise an alarm through: each rank's dump has only the watchdog's detail line.
    job = Synth(4)
    a = job.group("1", "tp", [0, 1])
    b = job.group("2", "dp", [2, 3])
    _steps(job)
    job.collective("all_reduce", group=a, skip=[1])
    job.collective("all_reduce", group=b, skip=[3])
    for r in range(4):
        job.extra[r] = {"detail": "gloo:all_reduce #1 on group 2 (dp) in flight 16.0s on rank 2"}
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert d.verdict == "hang" and d.process_group is not None, d.evidence
    assert d.process_group.desc == "dp"


# -- corrupt or hostile fields cost only themselves --------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        {"alarm": {"reason": "hang", "group": "0", "seq": 4, "time_ns": float("inf")}},
        {"alarm": {"reason": "hang", "group": "0", "seq": float("nan"), "seen_by": 0}},
        {"alarm": {"reason": "hang", "detail": "x #4 on group 0 (d) in flight 1.2.3s on rank 0"}},
        {"alarm": {"reason": "hang", "group": "0", "seq": 4, "timeout_s": 1e300}},
        {"reason": "hang", "detail": "x #4 on group 0 (d) in flight 1.2.3s on rank 0"},
        {"clock_offset_ns": float("inf"), "clock_error_ns": float("inf")},
        {"hang_timeout_s": 1e300},
        {"alarm": {"reason": "crash", "dead_ranks": {"²": "x", "-1": "y", str(10**12): "z"}}},
        {"failed": {"²": "x"}},
    ],
)
def test_a_corrupt_field_is_passed_over_and_the_dump_still_read(
    tmp_path: Path, extra: dict[str, object]
) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    for r in (0, 1):
        job.extra[r] = copy.deepcopy(extra)
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1]), jobs=0)
    assert (d.unreadable, d.ranks_loaded, d.culprit_ranks) == ({}, 2, [2]), d.evidence
    assert d.dead_ranks == {}


def test_hostile_stacks_file_names_and_headers_are_passed_over(tmp_path: Path) -> None:
    from tether.cli.show import summarize

    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    (ev / "stacks_².txt").write_text("x\n")  # isdigit() but not int()
    _stacks_file(ev, 10**12, when="death", signal="SIGKILL")  # beyond the world of 3
    (ev / "stacks_2.txt").write_text("# tether-stacks " + "[" * 50_000 + "\n")  # RecursionError
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks, d.dead_ranks) == ("hang", [2], {}), d.evidence
    assert any("beyond the world size (3): ignored" in e for e in d.evidence)
    assert "rank 2  no dump" in summarize(ev)


def test_the_ranks_said_to_wait_in_the_operation_are_its_own_group_s(tmp_path: Path) -> None:
    # 0 waits in tp for 1, 2 in dp for 3: both waits are direct, but only 2 waits in dp's.
    job = Synth(4)
    a = job.group("1", "tp", [0, 1])
    b = job.group("2", "dp", [2, 3])
    _steps(job)
    job.collective("all_reduce", group=a, skip=[1])
    job.collective("all_reduce", group=b, skip=[3])
    job.alarm(group="2", group_desc="dp", seq=1, op="gloo:all_reduce", seen_by=2, time_ns=0)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [1, 3]), d.evidence
    assert "rank(s) 3 never issued all_reduce seq 1 in group 2 (dp), which rank(s) 2 wait in" in (
        d.evidence
    )


@pytest.mark.parametrize("dead", [False, True])
def test_per_rank_holds_a_few_culprits_not_all_of_them(tmp_path: Path, dead: bool) -> None:
    job = Synth(24)
    _steps(job)
    job.collective("all_reduce", skip=range(4, 20))
    ranks = None
    if dead:
        job.alarm("crash", dead_ranks={str(r): "signal SIGKILL" for r in range(4, 20)})
        ranks = [0, 1, 2, 3, 20, 21, 22, 23]
    d = analyze(job.write(tmp_path / "ev", ranks=ranks), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash" if dead else "hang", list(range(4, 20)))
    assert sorted(d.per_rank) == list(range(4, 12)), d.per_rank


@pytest.mark.parametrize(("after_s", "culprits"), [(-2, []), (10, [1])])
def test_a_raiser_without_a_dump_leaves_its_clock_unknown(
    tmp_path: Path, after_s: int, culprits: list[int]
) -> None:
    # Two hosts: ranks 2 and 3 run 4 s behind rank 0. Rank 3 raised the alarm (time_ns on its
    # clock; it had issued the operation, or it would not have seen it hang) and its dump is
    # lost. Rank 1 issued all_reduce #4 after the others, at after_s from the alarm: 2 s before
    # it is not late (everyone joined); 10 s after it is late whatever rank 3's offset.
    job = Synth(4, clock_offsets_ns={2: 4 * S, 3: 4 * S})
    _steps(job)
    job.collective("all_reduce", skip=[1], incomplete=[0, 2, 3])
    raised = job.now(0) - job.step_ns + 15 * S  # rank 0's clock
    job.ranks[1].now_ns = raised + after_s * S
    job.collective("all_reduce", skip=[0, 2, 3], incomplete=[1])
    job.alarm(group="0", seq=4, op="gloo:all_reduce", seen_by=3, timeout_s=15.0,
              time_ns=raised - 4 * S)  # fmt: skip
    d = analyze(job.write(tmp_path / "ev", ranks=[0, 1, 2]), jobs=0)
    assert d.culprit_ranks == culprits, d.evidence
    assert d.per_rank.get(1, "").startswith("arrived late") == (culprits == [1])


def test_a_p2p_hang_says_the_peer_never_posted_the_other_side(tmp_path: Path) -> None:
    job = Synth(4)
    _steps(job)
    job.p2p(0, 1)
    job.p2p(1, 2)
    job.p2p(2, 3, post_send=False)
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks, d.op) == ("hang", [2], "recv"), d.evidence
    assert (
        "rank(s) 2 never issued the send matching recv 3<-2 in group 0 (default_pg), which "
        "rank(s) 3 wait in" in d.evidence
    )


@pytest.mark.timeout(30)
def test_a_fifo_named_like_a_stacks_file_is_passed_over(tmp_path: Path) -> None:
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    os.mkfifo(ev / "stacks_2.txt")  # opening it would wait for a writer that never comes
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("crash", [2]), d.evidence


@pytest.mark.timeout(60)
def test_a_huge_stacks_file_is_read_only_as_far_as_a_real_one_goes(tmp_path: Path) -> None:
    # 3 GiB (sparse) past a real block: analyze and show read its first MiB, in 1 GiB of memory.
    job = Synth(3)
    _steps(job)
    job.collective("all_reduce", skip=[2])
    ev = job.write(tmp_path / "ev", ranks=[0, 1])
    _stacks_file(ev, 2, method="py-spy", when="unresponsive", state="sleeping")
    with open(ev / "stacks_2.txt", "r+b") as f:
        f.truncate(3 << 30)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from tether.analyze import analyze\n"
        "from pathlib import Path\nfrom tether.cli.show import summarize\n"
        "d, ev = analyze(sys.argv[1], jobs=0), Path(sys.argv[1])\n"
        "print(d.culprit_ranks, d.culprit_stacks[2], 'ext.py:7 (spin)' in summarize(ev))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ev)], capture_output=True, text=True, timeout=50
    )
    assert proc.stdout == "[2] /src/ext.py:7 in spin True\n", proc.stderr[-2000:]


def test_a_consequence_known_only_by_its_stacks_file_is_said_so(tmp_path: Path) -> None:
    # No alarm recorded rank 3's death (the launcher's agent wrote its stacks as it died).
    job = Synth(4)
    _steps(job)
    job.collective("all_reduce", incomplete=range(4), sizes_by_rank={2: [[16]]})
    job.fail_last([0, 1, 2], RESET)
    ev = job.write(tmp_path / "ev", ranks=[0, 1, 2])
    _stacks_file(ev, 3, method="fatal-signal", when="death", signal="SIGABRT")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks, list(d.consequences)) == ("desync", [2], [3]), d.evidence
    assert any(
        e.startswith("rank 3 died (signal SIGABRT), as its stacks file records: a consequence")
        for e in d.evidence
    ), d.evidence


def test_lateness_is_worked_out_once_per_member_not_per_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.analyze import findings

    job = Synth(64)
    _steps(job)
    job.collective("all_reduce", skip=[37])
    raised = job.now(0) - job.step_ns + 15 * S
    job.alarm(group="0", seq=4, op="gloo:all_reduce", seen_by=0, timeout_s=15.0, time_ns=raised)
    calls = []
    real = findings._issued_at
    monkeypatch.setattr(findings, "_issued_at", lambda c, seq: calls.append(seq) or real(c, seq))
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [37]), d.evidence
    assert 0 < len(calls) <= 63  # 63 waiting ranks asked about 62 others each: 3906 before


# -- large groups ------------------------------------------------------------------------------
def test_a_straggler_outside_the_reference_sample_of_a_large_group(tmp_path: Path) -> None:
    # 600 ranks: each collective's reference time is the median of 255 members spread over the
    # group. The straggler is not one of them, and every rank has its own jitter (up to 2 ms).
    n = 600
    sample = {i * n // findings.REF_MEMBERS for i in range(findings.REF_MEMBERS)}
    (late,) = [r for r in (451, 452, 453) if r not in sample][:1]
    job = Synth(n)
    for k in range(12):
        jitter = {r: (r * 7919 + k * 104729) % (2 * MS) for r in range(n)}
        job.collective("all_reduce", lag_ns={**jitter, late: 40 * MS})
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("straggler", [late]), d.evidence


def test_a_hang_in_a_large_group_names_the_one_rank_absent(tmp_path: Path) -> None:
    # 600 ranks wait in one all_reduce that rank 311 never issued: whom they wait for is worked
    # out once for all of them, and each still lists the others as joined, itself included.
    job = Synth(600)
    _steps(job)
    job.collective("all_reduce", skip=[311])
    d = analyze(job.write(tmp_path / "ev"), jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [311]), d.evidence
    assert "rank(s) 0-310, 312-599 joined it and are stuck inside" in d.evidence, d.evidence
