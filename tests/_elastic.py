"""`tether run --elastic` jobs of tests/workers/elastic_train.py, and the check of their training:
every committed loss equal to a single-process run of the same global batch, replicas identical."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._jobs import WORKERS, worker_env
from tether.demo.elastic_job import reference_losses
from tether.events.layout import elastic_timeline_file

JOB_TIMEOUT_S = 150.0
WORLD = 4


@dataclasses.dataclass
class Run:
    returncode: int
    log: str
    outputs: list[dict[str, Any]]
    dumps: Path

    def by_rank(self) -> dict[tuple[int, int], dict[str, Any]]:
        return {(o["rank"], o["incarnation"]): o for o in self.outputs}

    def event(self) -> Path:
        """The event of the (last) deaths, which holds the elastic timeline."""
        files = sorted(f for d in self.dumps.iterdir() if (f := elastic_timeline_file(d)).exists())
        assert files, f"no timeline in {self.dumps}:\n{self.log}"
        return files[-1].parent

    def timeline(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(elastic_timeline_file(self.event()).read_text())
        return data


def command(tmp_path: Path, *worker_args: str, flags: tuple[str, ...] = ()) -> list[str]:
    out = tmp_path / "out"
    out.mkdir()
    return [
        sys.executable,
        "-m",
        "tether.cli.main",
        "run",
        "--elastic",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        f"--dump-dir={tmp_path / 'dumps'}",
        *flags,
        str(WORKERS / "elastic_train.py"),
        f"--out={out}",
        "--step-sleep=0.01",  # paces the survivors while a replacement starts (seconds)
        *worker_args,
    ]


def run(tmp_path: Path, *worker_args: str, flags: tuple[str, ...] = ()) -> Run:
    cmd = command(tmp_path, *worker_args, flags=flags)
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    proc = subprocess.run(
        cmd,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    log = proc.stdout.decode(errors="replace")
    outputs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return Run(proc.returncode, log, outputs, dumps)


def check_training(result: Run, *, members: set[int]) -> None:
    """The last members' committed losses are the single-process run's, step for step, and
    their parameters are identical. A member that a death left a step behind the others was
    healed from one that applied it (its history says so): it took that step, healed."""
    assert result.returncode == 0, result.log
    final = {o["rank"]: o for o in result.outputs if o["final_world_size"] == len(members)}
    assert set(final) == members, f"{sorted(final)} finished, not {sorted(members)}\n{result.log}"
    # Each beat to its node's agent and heard the decisions from it, not from the job's store
    # (on etcd, a node's workers also take turns to beat there: one beat every 0.25 s a node).
    for o in result.outputs:
        assert o["heartbeat_to"] == "agent", o
    reference = reference_losses(max(len(o["losses"]) for o in result.outputs) + 1)
    for o in result.outputs:
        for step, loss in o["losses"].items():
            expected = reference[int(step)]
            assert abs(loss - expected) <= 1e-9 * abs(expected), (o["rank"], step, loss, expected)
    steps = [
        set(map(int, o["losses"])) | took_healed(o) for o in final.values() if o["incarnation"] == 0
    ]
    assert steps and all(s == steps[0] for s in steps), "survivors committed different steps"
    assert sorted(steps[0]) == list(range(len(steps[0]))), "a step was skipped"
    digests: dict[int, set[str]] = {}
    for o in final.values():  # HSDP: each part of the state is its replicas'
        digests.setdefault(o.get("part", 0), set()).add(o["digest"])
    assert all(len(d) == 1 for d in digests.values()), f"replicas differ: {digests}"


def took_healed(output: dict[str, Any]) -> set[int]:
    """The steps a worker did not apply itself but took from a healer at a regroup (the step
    before the one it was healed to)."""
    return {
        e["step"] - 1
        for e in output["history"]
        if e["heal_bytes"] and e.get("healer") not in (None, output["rank"])
    }
