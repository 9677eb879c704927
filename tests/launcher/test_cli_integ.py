"""The command line: `tether run` on real torchrun jobs, `tether demo`, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import tether
from tests._jobs import WORKERS, native_expected, tether_cli, until, worker_env
from tether.analyze import Diagnosis, Verdict
from tether.cli.demo import EXPECTED_VERDICT, _judge
from tether.cli.main import main
from tether.demo.job import FAULTS
from tether.events.load import load_event, resolve_event


def read_results(directory: Path) -> list[dict[str, object]]:
    return [json.loads((directory / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(150)
def test_run_records_a_script_that_never_imports_tether(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    proc = tether_cli(
        "run", "--standalone", "--nproc-per-node=2", f"--dump-dir={dumps}", "--dump-on-exit",
        str(WORKERS / "untouched.py"), results=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorder = (
        "ProcessGroup/RecordingBackend"
        if native_expected()
        else "RecordingProcessGroup/ProcessGroupGloo"
    )
    assert [r["recorder"] for r in read_results(tmp_path)] == [recorder] * 2
    event = resolve_event(dumps)
    assert event.name.endswith("-exit")
    by_rank, errors = load_event(event)
    assert not errors and sorted(by_rank) == [0, 1]
    for rank, data in by_rank.items():
        names = [e["profiling_name"] for e in data["entries"]]
        assert names == ["gloo:all_reduce", "gloo:barrier"]
        assert data["tether"]["global_rank"] == rank and data["tether"]["job_id"]


@pytest.mark.timeout(150)
def test_a_missing_script_is_one_line_per_rank(tmp_path: Path) -> None:
    missing = tmp_path / "missing.py"
    proc = tether_cli(
        "run", "--standalone", "--nproc-per-node=2", f"--dump-dir={tmp_path / 'dumps'}",
        str(missing),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    said = [line for line in out.splitlines() if "can't open file" in line]
    assert len(said) == 2 and all(str(missing) in line for line in said), out
    assert "Traceback" not in out and "bootstrap" not in out, out


@pytest.mark.timeout(150)
def test_a_raising_scripts_traceback_starts_in_the_script(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("def load():\n    raise ValueError('no shard')\n\nload()\n")
    proc = tether_cli(
        "run", "--standalone", "--nproc-per-node=1", f"--dump-dir={tmp_path / 'dumps'}",
        str(script),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    tb = out[out.index("Traceback (most recent call last):") :].splitlines()
    # As `python boom.py` prints it: the script's two frames, nothing of the bootstrap or runpy.
    assert f'File "{script}", line 4, in <module>' in tb[1], out
    assert f'File "{script}", line 2, in load' in tb[3], out
    assert "ValueError: no shard" in tb[5], out
    assert "bootstrap" not in out and "runpy" not in out, out
    assert "rank 0 failed (exit code 1): ValueError: no shard" in out, out


WAITS_FOR_THE_PAGE = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
seen, deadline = sys.argv[1], time.monotonic() + 60
while dist.get_rank() == 0 and not os.path.exists(seen) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


def agent_relays(page: str) -> list[str] | None:
    """Each rank's alarm source, as rank 0's cluster view says it, once all say "agent"."""
    with urllib.request.urlopen(f"{page}/api/cluster", timeout=10) as response:
        rows = json.loads(response.read())["ranks"]
    sources = [(row["health"] or {}).get("alarm_source") for row in rows]
    return sources if all(s == "agent" for s in sources) else None


@pytest.mark.timeout(150)
def test_tether_run_says_where_the_cluster_page_is_when_workers_output_goes_to_files(
    tmp_path: Path,
) -> None:
    script, seen = tmp_path / "job.py", tmp_path / "seen"
    script.write_text(WAITS_FOR_THE_PAGE)
    command = [
        sys.executable, "-m", "tether.cli.main", "run", "--standalone", "--nproc-per-node=2",
        f"--dump-dir={tmp_path / 'dumps'}", "--debug-port=0", "--redirects=3",
        f"--log-dir={tmp_path / 'logs'}", str(script), str(seen),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=worker_env())
    said: list[str] = []
    sources: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            if "cluster page" in line:
                # Every rank hears of alarms from this node's agent, not from the store.
                url = line.split()[-1].rstrip("/")
                sources = until(
                    lambda url=url: agent_relays(url),
                    "the ranks never heard from the agent",
                    timeout=30.0,
                )
                seen.touch()  # rank 0 may end now
        assert proc.wait(60) == 0, "".join(said)
        assert sources == ["agent", "agent"], "".join(said)
    finally:
        proc.kill()
        proc.wait(10)
    (page,) = [line for line in said if "cluster page" in line]
    assert page.startswith("tether run: cluster page http://127.0.0.1:"), page
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert "cluster page" not in logs


@pytest.mark.timeout(150)
def test_no_tether_is_plain_torchrun(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    proc = tether_cli(
        "run", "--no-tether", "--standalone", "--nproc-per-node=2", f"--dump-dir={dumps}",
        "--dump-on-exit", str(WORKERS / "untouched.py"), results=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = read_results(tmp_path)
    assert [r["recorder"] for r in out] == ["ProcessGroup/ProcessGroupGloo"] * 2
    assert [r["sum"] for r in out] == [[2.0, 2.0]] * 2
    assert not dumps.exists()


@pytest.mark.timeout(150)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    proc = tether_cli(
        "demo", "--world-size=2", "--culprit=1", "--fault=hang", "--fault-step=2", "--steps=4",
        "--hang-timeout=2", f"--dump-dir={dumps}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    event = resolve_event(dumps)
    assert event.name.endswith("-hang")
    assert f"2 of 2 ranks dumped into {event} (hang)" in proc.stdout
    assert "gloo:send 0->1" in proc.stdout and "gloo:recv 1<-0" in proc.stdout
    # Said once, by tether run (rank 0 leaves it to the launcher).
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "cluster page" in line]
    assert len(said) == 1 and said[0].startswith("tether run: cluster page http://127.0.0.1:")
    assert sorted(p.name for p in event.iterdir()) == [
        "cols_0.npz",
        "cols_1.npz",
        "rank_0",
        "rank_1",
    ]
    # It ends with the analyzer's diagnosis of its own event, which names the culprit.
    assert f"$ tether analyze {event}\nevent {event.name}" in proc.stdout
    assert "HANG: culprit rank(s) 1\n" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "tether demo: ok: the analyzer says hang, culprit rank(s) [1], as injected"
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("fault", "ranks", "steps", "reason", "verdict"),
    [
        # A majority names the odd rank: three ranks.
        ("desync", 3, 4, "hang", "DESYNC"),
        # Late in most of its collectives, DDP's set-up ones included: enough steps.
        ("straggler", 2, 8, "exit", "STRAGGLER"),
    ],
)
def test_demo_faults_are_diagnosed(
    fault: str, ranks: int, steps: int, reason: str, verdict: str, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    proc = tether_cli(
        "demo", f"--world-size={ranks}", "--culprit=1", f"--fault={fault}", "--fault-step=1",
        f"--steps={steps}", "--hang-timeout=2", f"--dump-dir={dumps}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    event = resolve_event(dumps)
    assert event.name.endswith(f"-{reason}")
    assert f"{verdict}: culprit rank(s) 1\n" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        f"tether demo: ok: the analyzer says {verdict.lower()}, culprit rank(s) [1], as injected"
    )


def test_demo_fails_unless_the_diagnosis_names_the_injected_culprit() -> None:
    def diagnosis(verdict: Verdict, culprits: list[int]) -> Diagnosis:
        return Diagnosis(event="e", verdict=verdict, culprit_ranks=culprits)

    assert _judge(diagnosis("hang", [2]), "hang", 2).startswith("ok:")
    assert _judge(diagnosis("hang", [2]), "gil", 2).startswith("ok:")
    assert _judge(diagnosis("healthy", []), "none", 2).startswith("ok:")
    assert _judge(diagnosis("hang", [1]), "hang", 2).startswith("MISMATCH:")
    assert _judge(diagnosis("hang", [1, 2]), "hang", 2).startswith("MISMATCH:")
    assert _judge(diagnosis("crash", [2]), "hang", 2).startswith("MISMATCH:")
    assert _judge(diagnosis("straggler", [0]), "none", 2) == (
        "MISMATCH: the analyzer says straggler, culprit rank(s) [0]; injected 'none' should "
        "give healthy, culprit rank(s) none"
    )
    assert set(EXPECTED_VERDICT) == set(FAULTS)


def test_bad_flags_say_what_to_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--ring-size=-1", "--standalone", "x.py"]) == 2
    assert "ring_size must be a number of entries in [0, 1000000]" in capsys.readouterr().err

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["run", f"--dump-dir={blocker}/d", "--standalone", "x.py"]) == 2
    assert "is not writable" in capsys.readouterr().err

    assert main(["run", "--no-python", "--standalone", "ls"]) == 2
    assert "--no-tether" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-such-flag", "x.py"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err

    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_unknown_backend_is_refused_before_anything_starts() -> None:
    with pytest.raises(tether.ConfigError, match=r"unknown backend 'nope'.*register_backend"):
        tether.init_process_group("nope")
    with pytest.raises(tether.ConfigError, match="unknown backend 'ncc'"):
        tether.init_process_group("cpu:gloo,cuda:ncc")
