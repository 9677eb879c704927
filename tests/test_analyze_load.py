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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._fr_synth import Synth
from tether._exceptions import AnalysisError
from tether.analyze import analyze
from tether.cli.main import main as cli
from tether.recorder.load import find_dump_files

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
    d = analyze(ev, jobs=1)
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
    import os, sys, torch, torch.distributed as dist
    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank,
                            world_size=world)
    sub = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(2), group=sub)
    dist.barrier()
    raw = torch._C._distributed_c10d._dump_fr_trace()
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
