"""How long a job takes to end after one rank raises an exception: tether run against torchrun.

Run from the repository root::

    python bench/crash_exit.py              # 5 repetitions per world size: about 4 minutes
    python bench/crash_exit.py --reps 1     # one repetition

The same script (``bench/workers/raise_job.py``: DDP on a small model, gloo, one rank raises
ValueError between two collectives at step 3) runs under plain ``torchrun`` and under
``tether run`` (its defaults: the failing rank raises the crash alarm and dumps; every other rank
dumps), and under ``tether run`` with ``TETHER_EXIT_LINGER=0`` (the rank exits at once; the
launcher's alarm and the rank's ring file speak for it). Each run is a fresh launcher; the
modes are interleaved, the culprit rank rotates. Measured: from the moment the culprit raises
(it writes ``time.time_ns()`` first) to the launcher's exit, as this script sees it. For tether
the diagnosis is checked too: ``tether analyze`` must name the culprit and its exception.

Reported per world size and mode: median [min-max] seconds; tether's median minus torchrun's.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, env, spread

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKER = REPO / "bench" / "workers" / "raise_job.py"
MODES = ("torchrun", "tether", "tether-linger-0")
JOB_TIMEOUT_S = 120.0


def command(mode: str, world: int, dumps: Path, sync: Path, culprit: int) -> list[str]:
    launcher = ["-m", "torch.distributed.run"]
    if mode != "torchrun":
        launcher = ["-m", "tether.cli.main", "run", f"--dump-dir={dumps}"]
    return [
        sys.executable, *launcher, "--standalone", f"--nproc-per-node={world}",
        str(WORKER), "--sync", str(sync), "--culprit", str(culprit),
    ]  # fmt: skip


def one(mode: str, world: int, culprit: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tether-bench-crash-") as tmp:
        dumps, sync = Path(tmp, "dumps"), Path(tmp, "sync")
        sync.mkdir()
        extra = {"OMP_NUM_THREADS": "1"}
        if mode == "tether-linger-0":
            extra["TETHER_EXIT_LINGER"] = "0"
        log = Path(tmp, "log")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                command(mode, world, dumps, sync, culprit),
                env=env(**extra),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                code = proc.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise SystemExit(f"{mode} did not end: {log.read_text()[-3000:]}") from None
        ended = time.time_ns()
        raised = int((sync / "raised").read_text())
        result: dict[str, Any] = {"mode": mode, "exit_code": code, "s": (ended - raised) / 1e9}
        if mode != "torchrun":
            result["right"] = diagnosed(dumps, culprit)
        return result


def diagnosed(dumps: Path, culprit: int) -> bool:
    from tether.analyze import analyze

    d = analyze(dumps)
    raised = d.exceptions.get(culprit, "")
    return (d.verdict, d.culprit_ranks) == ("crash", [culprit]) and raised.startswith(
        "ValueError: bad batch"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--worlds", default="3,4")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for world in worlds:
        for rep in range(args.reps):
            culprit = 1 + rep % (world - 1)
            for mode in MODES:
                runs.setdefault((world, mode), []).append(one(mode, world, culprit))
    print(f"{'world':>5}  {'mode':<16} {'exception -> launcher exit, s':<32} right  exit codes")
    figures: dict[str, Any] = {"reps": args.reps}
    for (world, mode), results in runs.items():
        seconds = [r["s"] for r in results]
        right = [r["right"] for r in results if "right" in r]
        codes = sorted({r["exit_code"] for r in results})
        shown = f"{sum(right)}/{len(right)}" if right else "-"
        print(f"{world:>5}  {mode:<16} {spread(seconds):<32} {shown:<6} {codes}")
        figures[f"{mode}_{world}_s"] = round(statistics.median(seconds), 3)
        if right:
            figures[f"{mode}_{world}_right"] = f"{sum(right)}/{len(right)}"
    for world in worlds:
        base = figures[f"torchrun_{world}_s"]
        for mode in MODES[1:]:
            delta = figures[f"{mode}_{world}_s"] - base
            figures[f"{mode}_{world}_minus_torchrun_s"] = round(delta, 3)
            print(f"world {world}: {mode} median - torchrun median = {delta:+.3f} s")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
