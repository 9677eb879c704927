"""How often ``tether analyze`` names the right verdict and culprit, over repeated real jobs.

Run from the repository root::

    python bench/diagnosis.py --repeat 5 --load     # the goal: 100 % on a loaded machine
    python bench/diagnosis.py --repeat 1 --jobs stuck-gil-sleep,busy-side-4

Each repetition runs the whole fault corpus as real ``tether run`` jobs, three at once: the jobs
of tests/workers/faultjobs.py (backend aborts, dead ranks, stuck C code, busy side groups, real
training code) and the analyzer's older corpus (tests/workers/scenarios.py, each scenario under
``tether run --hang-timeout=3``; class ``scenarios``). Every job's event is then diagnosed by
the command a user runs, ``tether analyze EVENT --json``, timed from start to exit. A run is
right when the verdict and the culprit ranks are both the expected ones; a job that leaves no
event, or whose analysis fails, is wrong on both.

``--load`` keeps one busy-looping process per CPU running for the whole benchmark (the figure
that counts is the one on a loaded machine); they are stopped at the end.

Output: one line per run, a table per class (runs, verdict right, culprit right, both, the
diagnosis time), the wrong runs, then one JSON line: ``accuracy`` (share of runs right),
``runs``, ``worst_class`` (lowest accuracy; ties: the first in table order) and ``classes``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.workers.faultjobs import JOBS, FaultJob, Outcome, job_env, run_jobs  # noqa: E402

SCENARIO_HANG_TIMEOUT_S = 3.0
JOB_DEADLINE_S = 90.0
ANALYZE_TIMEOUT_S = 120.0


def scenario_jobs() -> dict[str, FaultJob]:
    """tests/workers/scenarios.py's corpus as ``tether run`` jobs, with the expectations of
    tests/analyze/test_analyze_jobs_integ.py."""
    from tests.analyze.test_analyze_jobs_integ import EXPECTED
    from tests.workers.scenarios import SCENARIOS

    script = REPO / "tests" / "workers" / "scenarios.py"
    return {
        f"scenario-{name}": FaultJob(
            cls="scenarios",
            world_size=scenario.world_size,
            culprits=tuple(EXPECTED[name].culprits),
            verdict=EXPECTED[name].verdict,
            reason=EXPECTED[name].reason,
            fault=None,
            what=(scenario.fault.__doc__ or name).split("\n")[0],
            hang_timeout=SCENARIO_HANG_TIMEOUT_S,
            argv=(str(script), "--scenario", name),
        )
        for name, scenario in SCENARIOS.items()
    }


@dataclasses.dataclass
class Run:
    name: str
    cls: str
    repeat: int
    verdict_ok: bool
    culprit_ok: bool
    analyze_s: float | None
    got: str
    """What the analyzer said (or why there is no diagnosis)."""
    want: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.verdict_ok and self.culprit_ok


def diagnose(event: Path) -> tuple[dict[str, Any] | None, float, str]:
    """``tether analyze EVENT --json``: its output, its time, and its error text."""
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tether.cli.main", "analyze", str(event), "--json"],
            capture_output=True,
            text=True,
            timeout=ANALYZE_TIMEOUT_S,
            env=job_env(),
        )
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started, f"no answer within {ANALYZE_TIMEOUT_S:g}s"
    took = time.monotonic() - started
    if proc.returncode != 0:
        return None, took, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    try:
        return json.loads(proc.stdout), took, ""
    except json.JSONDecodeError as exc:
        return None, took, f"not JSON ({exc})"


def judge(outcome: Outcome, repeat: int) -> Run:
    job = outcome.job
    want = f"{job.verdict} {list(job.culprits)}"
    bad = dict(verdict_ok=False, culprit_ok=False, want=want, wall_s=outcome.wall_s)
    event = outcome.event()
    if outcome.exit_code is None:
        return Run(outcome.name, job.cls, repeat, analyze_s=None, got="job killed at deadline",
                   **bad)  # fmt: skip
    if event is None:
        return Run(outcome.name, job.cls, repeat, analyze_s=None, got="no event", **bad)
    out, took, error = diagnose(event)
    if out is None:
        return Run(outcome.name, job.cls, repeat, analyze_s=took, got=error, **bad)
    verdict, culprits = out.get("verdict"), out.get("culprit_ranks")
    return Run(
        outcome.name,
        job.cls,
        repeat,
        verdict_ok=verdict == job.verdict,
        culprit_ok=culprits == list(job.culprits),
        analyze_s=took,
        got=f"{verdict} {culprits}",
        want=want,
        wall_s=outcome.wall_s,
    )


@contextlib.contextmanager
def cpu_load(on: bool) -> Iterator[int]:
    """One busy-looping process per CPU while the block runs; yields how many."""
    procs: list[subprocess.Popen[bytes]] = []
    if on:
        for _ in range(os.cpu_count() or 1):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    try:
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)


def pct(n: int, total: int) -> str:
    return f"{100 * n / total:5.1f}%" if total else "    -"


def summarize(runs: list[Run], classes: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cls in classes:
        mine = [r for r in runs if r.cls == cls]
        times = [r.analyze_s for r in mine if r.analyze_s is not None]
        n = len(mine)
        out[cls] = {
            "runs": n,
            "verdict": round(sum(r.verdict_ok for r in mine) / n, 4) if n else None,
            "culprit": round(sum(r.culprit_ok for r in mine) / n, 4) if n else None,
            "accuracy": round(sum(r.ok for r in mine) / n, 4) if n else None,
            "analyze_s_median": round(statistics.median(times), 3) if times else None,
            "analyze_s_max": round(max(times), 3) if times else None,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole corpus")
    parser.add_argument("--jobs", help="comma-separated job names (default: all)")
    parser.add_argument("--load", action="store_true", help="a busy loop on every CPU meanwhile")
    parser.add_argument("--parallel", type=int, default=3, help="jobs at once (default 3)")
    parser.add_argument("--no-scenarios", action="store_true", help="faultjobs.py's jobs only")
    parser.add_argument("--keep", type=Path, help="keep every job's events here")
    args = parser.parse_args()
    if args.repeat < 1 or args.parallel < 1:
        parser.error("--repeat and --parallel must be at least 1")
    table = dict(JOBS)
    if not args.no_scenarios:
        table.update(scenario_jobs())
    if args.jobs:
        names = [n.strip() for n in args.jobs.split(",") if n.strip()]
        unknown = sorted(set(names) - set(table))
        if unknown:
            parser.error(f"unknown jobs {unknown}; known: {', '.join(table)}")
        table = {n: table[n] for n in names}
    classes = list(dict.fromkeys(job.cls for job in table.values()))

    started = time.monotonic()
    load_start = os.getloadavg()[0]
    runs: list[Run] = []
    root = args.keep or Path(tempfile.mkdtemp(prefix="tether-diagnosis-"))
    print(f"{len(table)} jobs x {args.repeat}, {args.parallel} at once, "
          f"load {'on' if args.load else 'off'}; events under {root}")  # fmt: skip
    with cpu_load(args.load) as loaders:
        for repeat in range(args.repeat):
            outcomes = run_jobs(table, root / f"repeat{repeat}", args.parallel, JOB_DEADLINE_S)
            for name in table:
                run = judge(outcomes[name], repeat)
                runs.append(run)
                took = "-" if run.analyze_s is None else f"{run.analyze_s:.2f}s"
                print(f"  [{repeat}] {name:28} {'ok   ' if run.ok else 'WRONG'} "
                      f"want {run.want:18} got {run.got:18} analyze {took} job {run.wall_s:.0f}s",
                      flush=True)  # fmt: skip
    per_class = summarize(runs, classes)

    print(f"\n{'class':16} {'runs':>5} {'verdict':>8} {'culprit':>8} {'both':>8} "
          f"{'analyze median':>15} {'max':>7}")  # fmt: skip
    for cls, s in per_class.items():
        mine = [r for r in runs if r.cls == cls]
        median = "-" if s["analyze_s_median"] is None else f"{s['analyze_s_median']:.2f}s"
        worst = "-" if s["analyze_s_max"] is None else f"{s['analyze_s_max']:.2f}s"
        print(f"{cls:16} {s['runs']:5} {pct(sum(r.verdict_ok for r in mine), len(mine)):>8} "
              f"{pct(sum(r.culprit_ok for r in mine), len(mine)):>8} "
              f"{pct(sum(r.ok for r in mine), len(mine)):>8} {median:>15} {worst:>7}")  # fmt: skip
    wrong = [r for r in runs if not r.ok]
    for r in wrong:
        print(f"WRONG [{r.repeat}] {r.name}: want {r.want}, got {r.got}")
    accuracy = sum(r.ok for r in runs) / len(runs)
    worst_class = min(per_class, key=lambda c: per_class[c]["accuracy"])
    times = [r.analyze_s for r in runs if r.analyze_s is not None]
    print(json.dumps({
        "accuracy": round(accuracy, 4),
        "runs": len(runs),
        "worst_class": worst_class,
        "classes": per_class,
        "repeat": args.repeat,
        "jobs": len(table),
        "load": args.load,
        "load_processes": loaders,
        "loadavg_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "analyze_s_median": round(statistics.median(times), 3) if times else None,
        "wrong": [f"{r.name}@{r.repeat}: {r.got}" for r in wrong],
        "elapsed_s": round(time.monotonic() - started, 1),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
