"""`tether analyze`'s verdicts where the evidence is partial or indirect: cascades ending in a
rank without a dump, roots stuck inside an operation, groups the ring dropped, coalesced
collectives, unreadable and absent dumps, ties."""

from __future__ import annotations

import copy
from pathlib import Path

from tests._fr_synth import MS, Synth
from tether.analyze import analyze, render


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
