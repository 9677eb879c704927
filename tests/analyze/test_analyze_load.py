"""`tether analyze` input handling: file names, corrupt and hostile files, the CLI's exit
status, --json keys, the Chrome trace, and real dumps from torch's own gloo recorder."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._fr_synth import Synth
from tether._exceptions import AnalysisError, UnsafeDumpError
from tether.analyze import analyze
from tether.cli.main import main as cli
from tether.events.columns import encode, parse_columns
from tether.events.load import find_dump_files

KEYS = {
    "event",
    "verdict",
    "culprit_ranks",
    "process_group",
    "collective_seq_id",
    "op",
    "evidence",
    "stragglers",
    "missing_dumps",
}


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch PWNED",))


def _hang(tmp_path: Path, name: str = "ev", **kw: object) -> Path:
    job = Synth(4)
    for _ in range(3):
        job.collective("all_reduce")
    job.collective("all_reduce", skip=[3])
    return job.write(tmp_path / name, **kw)  # type: ignore[arg-type]


def test_file_prefixes(tmp_path: Path) -> None:
    ev = tmp_path / "ev"
    ev.mkdir()
    for name in ("comm_lib_trace_rank_0", "comm_lib_trace_rank_1", "stacks_1.txt", ".rank_2.9.tmp"):
        (ev / name).write_bytes(b"x")
    assert sorted(find_dump_files(ev)) == [0, 1]
    (ev / "rank_5").write_bytes(b"x")
    assert sorted(find_dump_files(ev)) == [5]  # tether's own names win


def test_newest_event_and_named_event(tmp_path: Path) -> None:
    _hang(tmp_path, "20260101T000000.000000Z-hang")
    job = Synth(2)
    job.collective("all_reduce")
    job.write(tmp_path / "20260102T000000.000000Z-manual")
    assert analyze(tmp_path).event == "20260102T000000.000000Z-manual"
    assert analyze(tmp_path, event="20260101T000000.000000Z-hang").verdict == "hang"


def test_corrupt_and_truncated_files_are_reported_and_the_rest_analyzed(tmp_path: Path) -> None:
    ev = _hang(tmp_path)
    raw = (ev / "rank_1").read_bytes()
    (ev / "rank_1").write_bytes(raw[: len(raw) // 3])
    (ev / "rank_2").write_bytes(b"\x80\x04garbage")
    d = analyze(ev)
    assert (d.verdict, d.culprit_ranks) == ("hang", [3])
    assert d.missing_dumps == [1, 2]
    assert set(d.unreadable) == {str(ev / "rank_1"), str(ev / "rank_2")}
    assert any("truncated or corrupt" in e for e in d.evidence)


def test_hostile_pickle_is_refused_and_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ev = _hang(tmp_path)
    data = pickle.loads((ev / "rank_0").read_bytes())
    data["entries"].append(_Exploit())
    (ev / "rank_0").write_bytes(pickle.dumps(data))
    d = analyze(ev)
    assert not (tmp_path / "PWNED").exists()
    assert 0 in d.missing_dumps
    assert "refusing to load posix.system" in d.unreadable[str(ev / "rank_0")]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(0, 4000), noise=st.binary(max_size=64), pos=st.integers(0, 4000))
def test_fuzzed_files_never_crash_the_analyzer(
    tmp_path: Path, cut: int, noise: bytes, pos: int
) -> None:
    ev = tmp_path / "fuzz"
    if not ev.exists():
        _hang(tmp_path, "fuzz")
    good = (ev / "rank_0").read_bytes() if not (tmp_path / "good").exists() else None
    if good is not None:
        (tmp_path / "good").write_bytes(good)
    raw = (tmp_path / "good").read_bytes()
    bad = raw[:pos] + noise + raw[pos + len(noise) :]
    (ev / "rank_0").write_bytes(bad[: max(cut, 1)] if cut < len(bad) else bad)
    d = analyze(ev, jobs=0)
    assert d.verdict in ("hang", "crash", "desync", "healthy", "inconclusive", "straggler")
    assert 3 in d.culprit_ranks or d.verdict != "hang"


@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "process_group",
                    "collective_seq_id",
                    "profiling_name",
                    "state",
                    "retired",
                    "input_sizes",
                    "time_created_ns",
                    "is_p2p",
                    "pg_id",
                ]
            ),
            st.one_of(
                st.none(),
                st.integers(-3, 3),
                st.text(max_size=5),
                st.booleans(),
                st.lists(st.integers(0, 3), max_size=3),
                st.tuples(st.text(max_size=2)),
            ),
        ),
        max_size=8,
    )
)
def test_schema_fuzz_never_raises(entries: list[dict[str, object]]) -> None:
    from tether.analyze.engine import analyze_event
    from tether.analyze.event import Event, _groups, _merge_sigs
    from tether.analyze.model import _reduce

    data = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": entries}
    ranks = {r: _reduce(r, Path(f"rank_{r}"), dict(data)) for r in range(2)}
    sigs = _merge_sigs(ranks)
    ev = Event(
        name="fuzz",
        path=Path("."),
        ranks=ranks,
        unreadable={},
        world_size=2,
        groups=_groups(ranks, 2, []),
        sigs=sigs,
        dead_ranks={},
        reason=None,
        notes=[],
    )
    assert analyze_event(ev).verdict in ("hang", "crash", "desync", "healthy", "straggler")


def test_cli_json_text_exit_codes_and_chrome_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ev = _hang(tmp_path)
    out = tmp_path / "trace.json"
    assert cli(["analyze", str(ev), "--json", "--chrome-trace", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) >= KEYS and got["culprit_ranks"] == [3] and got["verdict"] == "hang"
    trace = json.loads(out.read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}
    assert len([e for e in xs if e["pid"] == 0]) == 4
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names[3] == "rank 3 (CULPRIT)" and names[0] == "rank 0"
    assert cli(["analyze", str(ev)]) == 0
    assert "HANG: culprit rank(s) 3" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["analyze", str(empty)]) == 2
    assert "input unusable" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank_0").write_bytes(b"not a pickle")
    assert cli(["analyze", str(bad)]) == 2
    assert "rank_0" in capsys.readouterr().err
    with pytest.raises(AnalysisError, match="no such directory"):
        analyze(tmp_path / "nowhere")


_GLOO_WORKER = textwrap.dedent(
    """
    import os, pickle, sys, time, torch, torch.distributed as dist
    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank,
                            world_size=world)
    sub = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(2), group=sub)
    dist.barrier()
    # torch's recorder retires finished work on its own thread, a moment later: dump once it
    # has caught up (a dump taken in that moment reads as ops still in flight).
    for _ in range(100):
        raw = torch._C._distributed_c10d._dump_fr_trace()
        if all(e["retired"] for e in pickle.loads(raw)["entries"]):
            break
        time.sleep(0.1)
    with open(os.path.join(out, f"comm_lib_trace_rank_{rank}"), "wb") as f:
        f.write(raw)
    dist.destroy_process_group()
    """
)


def test_real_torch_gloo_dumps(tmp_path: Path) -> None:
    """torch 2.13's own gloo recorder (TORCH_FR_BUFFER_SIZE on), dumped by torch itself."""
    ev = tmp_path / "native"
    ev.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(_GLOO_WORKER)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(ev), str(tmp_path / "init")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    raw = pickle.loads((ev / "comm_lib_trace_rank_0").read_bytes())
    assert {e["state"] for e in raw["entries"]} == {"scheduled"}  # the quirk is still there
    d = analyze(ev)
    assert d.ranks_loaded == 2 and d.missing_dumps == []
    assert d.verdict == "healthy", d.evidence
    for r in range(2):  # torch's C++ pickler's output takes the column-wise path, same result
        _assert_columnwise_equals_loop(pickle.loads((ev / f"comm_lib_trace_rank_{r}").read_bytes()))


# -- the column-wise reduction is the entry-by-entry loop, faster ---------------------------------
def _assert_columnwise_equals_loop(data: dict[str, Any], *, must_be_fast: bool = True) -> None:
    import copy

    from tether.analyze import model

    calls: list[int] = []
    loop = model._columns

    def counting(*args: Any) -> None:
        calls.append(1)
        loop(*args)

    model._columns = counting  # type: ignore[assignment]
    try:
        fast = model._reduce(0, Path("rank_0"), copy.deepcopy(data))
    finally:
        model._columns = loop
    slow = model._reduce(0, Path("rank_0"), copy.deepcopy(data), columnwise=False)
    assert fast == slow
    if must_be_fast and fast.flavor != "torchcomms":
        assert not calls, "the column-wise path gave up on a well-formed dump"
    # The dump's column file (tether's dumps have one) reads as the same columns.
    raw = encode(data, pickle_size=1)
    if raw is None:
        assert not must_be_fast or fast.flavor != "tether", "a tether dump without columns"
        return
    try:
        from_file = model._reduce_columns(
            0, Path("rank_0"), parse_columns(raw, source="cols_0.npz", pickle_size=1)
        )
    except UnsafeDumpError:  # sizes that are not lists: read_rank reads the pickle instead
        assert not must_be_fast
        return
    assert from_file == fast


@pytest.mark.parametrize("flavor", ["tether", "torch", "gloo", "torchcomms"])
def test_columnwise_reduction_equals_the_loop(flavor: str) -> None:
    job = Synth(4, flavor=flavor, clock_offsets_ns={1: 5_000, 2: -7_000})
    sub = job.group("1", "tp", [1, 3])
    for k in range(6):
        job.collective("all_reduce", sizes=[[4, 2]] if k % 2 else [[8]])
        job.collective("all_gather", group=sub, sizes=[[2]], out_sizes=[[4]])
        job.p2p(0, 2)
        job.p2p(3, 1, group=sub)
    job.collective("broadcast", sizes_by_rank={2: [[3]]}, dtype_by_rank={1: "Half"})
    job.p2p(2, 0, post_recv=False)
    job.collective("all_reduce", skip=[1])
    job.ring_size = 9
    for r in range(4):
        _assert_columnwise_equals_loop(job.dump(r))


_NAMES = st.sampled_from(
    ["gloo:all_reduce", "gloo:send 0->1", "gloo:recv 1<-0", "nccl:_allgather_base", "barrier"]
)
_VALUE = st.one_of(
    st.none(), st.integers(-3, 3), st.booleans(), st.floats(0, 2), st.text(max_size=3)
)
# Dims are ints, as every recorder writes them: ``==`` (the loop's cache, the column-wise
# comparison) takes ``[[1]]``, ``[[True]]`` and ``[[1.0]]`` for the same sizes, the loop's
# string table does not, and which of them a rank's signature keeps differs.
_SIZES = st.one_of(st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2), _VALUE)
_DTYPES = st.one_of(st.lists(st.sampled_from(["Float", "Half"]), max_size=2), st.lists(_VALUE))
_GROUP = st.one_of(
    st.sampled_from([("0", "default_pg"), ("1", "tp"), ["0", "default_pg"], ("0", ""), ()]),
    st.tuples(st.one_of(st.integers(0, 1), st.booleans(), st.text(max_size=1))),
    _VALUE,
)


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {
                "process_group": _GROUP,
                "collective_seq_id": st.one_of(st.integers(0, 4), _VALUE),
                "profiling_name": st.one_of(_NAMES, _VALUE),
                "input_sizes": _SIZES,
                "output_sizes": _SIZES,
                "input_dtypes": _DTYPES,
                "output_dtypes": _DTYPES,
                "state": st.one_of(st.sampled_from(["completed", "started", "scheduled"]), _VALUE),
                "retired": _VALUE,
                "time_created_ns": st.one_of(st.integers(0, 1 << 62), _VALUE),
                "is_p2p": _VALUE,
                "pg_id": st.one_of(st.integers(0, 2), _VALUE),
                "record_id": st.one_of(st.integers(0, 9), _VALUE),
            }
        ),
        max_size=12,
    ),
    completed=st.integers(-1, 3),
    tether=st.booleans(),
)
def test_columnwise_reduction_equals_the_loop_fuzzed(
    entries: list[dict[str, object]], completed: int, tether: bool
) -> None:
    status = {"0": {"last_enqueued_collective": 3, "last_completed_collective": completed}}
    data = {"version": "2.10", "pg_config": {}, "pg_status": status, "entries": entries}
    if tether:  # a tether dump: its column file too, where its entries have a columnar form
        data["tether"] = {"format": 1, "world_size": 4}
    _assert_columnwise_equals_loop(data, must_be_fast=False)


_INT = st.integers(0, 4)


@settings(max_examples=150, deadline=None)
@given(
    entries=st.lists(
        st.fixed_dictionaries(
            {
                "process_group": st.sampled_from([("0", "default_pg"), ("1", "tp"), ("0", "")]),
                "collective_seq_id": _INT,
                "profiling_name": _NAMES,
                "input_sizes": st.lists(st.lists(_INT, max_size=2), max_size=2),
                "output_sizes": st.lists(st.lists(_INT, max_size=2), max_size=2),
                "input_dtypes": st.lists(st.sampled_from(["Float", "Half"]), max_size=2),
                "output_dtypes": st.lists(st.sampled_from(["Float", "Half"]), max_size=2),
                "state": st.sampled_from(["completed", "started", "scheduled", "?"]),
                "retired": st.booleans(),
                "time_created_ns": st.integers(0, 1 << 62),
                "is_p2p": st.booleans(),
                "pg_id": st.integers(0, 2),
                "record_id": _INT,
            }
        ),
        max_size=12,
    ),
    completed=st.integers(-1, 3),
    reconfigured=st.one_of(st.none(), st.integers(0, 1 << 62)),
)
def test_a_column_file_reads_as_its_dump_fuzzed(
    entries: list[dict[str, object]], completed: int, reconfigured: int | None
) -> None:
    status = {"0": {"last_enqueued_collective": 3, "last_completed_collective": completed}}
    meta: dict[str, object] = {"format": 1, "world_size": 4}
    if reconfigured is not None:  # entries from the regroup after the alarm on are left out
        meta["alarm"] = {"reason": "crash", "time_ns": 1}
        meta["reconfigures"] = {"0": [{"time_ns": reconfigured}]}
    data = {"version": "2.10", "pg_config": {}, "pg_status": status, "entries": entries}
    data["tether"] = meta
    assert encode(data, pickle_size=1) is not None
    _assert_columnwise_equals_loop(data, must_be_fast=False)


# -- worker processes ----------------------------------------------------------------------------
def _mixed_event(tmp_path: Path) -> Path:
    job = Synth(40)
    sub = job.group("1", "tp", list(range(0, 40, 2)))
    for _ in range(3):
        job.collective("all_reduce")
        job.collective("all_gather", group=sub, sizes=[[2]], out_sizes=[[40]])
        job.p2p(1, 3)
    job.p2p(5, 7, post_recv=False)
    job.collective("all_reduce", skip=[9])
    ev = job.write(tmp_path / "ev")
    (ev / "rank_11").write_bytes((ev / "rank_11").read_bytes()[:500])
    data = pickle.loads((ev / "rank_13").read_bytes())
    data["entries"].append(_Exploit())
    (ev / "rank_13").write_bytes(pickle.dumps(data))
    return ev


def test_workers_give_what_reading_in_process_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.analyze import event

    monkeypatch.chdir(tmp_path)
    ev = _mixed_event(tmp_path)
    monkeypatch.setattr(event, "CHUNK_BYTES", 20_000)  # many chunks, several per worker
    here = analyze(ev, jobs=0).to_json()
    assert here["culprit_ranks"] == [9] and here["missing_dumps"] == [11, 13]
    for jobs in (1, 3, None):
        assert analyze(ev, jobs=jobs).to_json() == here
    assert not (tmp_path / "PWNED").exists()


def test_a_worker_that_dies_is_replaced_by_reading_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.analyze import event

    ev = _mixed_event(tmp_path)
    here = analyze(ev, jobs=0).to_json()
    monkeypatch.setattr(event, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(event, "_child", lambda *a: os._exit(3))  # forked: the child runs it
    assert analyze(ev, jobs=2).to_json() == here


def test_a_worker_result_holds_only_columns() -> None:
    import io

    from tether.analyze.event import _ResultUnpickler
    from tether.analyze.model import GroupCols, P2POp, RankTrace

    tr = RankTrace(rank=0, path="x", groups={"0": GroupCols()})
    tr.p2p.append(P2POp(group="0", kind="send", peer=1, done=False, t=0, idx=0, sig=0))
    assert _ResultUnpickler(io.BytesIO(pickle.dumps([tr], protocol=5))).load() == [tr]
    with pytest.raises(UnsafeDumpError, match=r"posix\.system"):
        _ResultUnpickler(io.BytesIO(pickle.dumps([_Exploit()]))).load()


# -- reading dumps does not import torch ---------------------------------------------------------
def test_analyze_never_imports_torch(tmp_path: Path) -> None:
    ev = _hang(tmp_path)
    code = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from tether.cli.main import main
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            main(["analyze", "--help"])
        assert main(["analyze", {str(ev)!r}, "--json", "--jobs", "2"]) == 0
        import tether.analyze, tether.events.load
        from tether import load_dump, UnsafeDumpError, Config
        load_dump({str(ev / "rank_0")!r})
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not torch, torch
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_lazy_package_names_resolve_as_before() -> None:
    code = textwrap.dedent(
        """
        import inspect, sys, types
        import tether, tether.recorder
        assert "torch" not in sys.modules
        from tether import init_process_group, install, uninstall, load_dump, dump
        import tether.runtime, tether.events.load
        from tether.api import init_process_group as real
        assert init_process_group is real and dump is tether.runtime.dump
        assert install is tether.runtime.install and load_dump is tether.events.load.load_dump
        assert inspect.isfunction(tether.install) and inspect.isfunction(tether.dump)
        assert tether.__all__ == sorted(tether.__all__)
        public = {n for n in dir(tether) if not n.startswith("_")}
        assert public == {n for n in tether.__all__ if not n.startswith("_")}, public
        try:
            tether.nothing_here
        except AttributeError as exc:
            assert "nothing_here" in str(exc)
        else:
            raise AssertionError("no AttributeError")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_a_hostile_world_size_is_not_enumerated(tmp_path: Path) -> None:
    """A dump claiming a world of 10**12 ranks (or a file named for such a rank) must not make
    the analyzer list every missing rank of it."""
    ev = _hang(tmp_path)
    data = pickle.loads((ev / "rank_0").read_bytes())
    data["tether"]["world_size"] = 10**12
    data["pg_config"] = {"9": {"name": "9", "desc": "x", "ranks": [0, 10**12]}}
    (ev / "rank_0").write_bytes(pickle.dumps(data))
    (ev / f"rank_{10**12}").write_bytes(b"x")
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks, d.world_size) == ("hang", [3], 4)
