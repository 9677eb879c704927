"""torch's own distributed tests, run twice in one go: on plain torch, then with tether installed
in every process (``sitecustomize.py`` on ``PYTHONPATH``); every test must end the same way.

    python tests/torch_suite/run.py [-k EXPRESSION]     (make test-torch-suite)

Prints a table (tests passed, failed, skipped, wall time per run), every test whose outcome
differs, and one JSON line of the figures; exits 1 where any outcome differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SUITES = {"distributed_test.py (gloo, 2 ranks)": HERE / "distributed_gloo.py"}
RUN_TIMEOUT_S = 3600.0
"""One whole run of a suite; each test is bounded by pytest's own timeout (pyproject.toml)."""


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed | failed | skipped, from pytest's JUnit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        found[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return found


def run(suite: Path, *, tether: bool, select: str | None, scratch: Path) -> tuple[dict, float]:
    junit = scratch / f"{suite.stem}-{'tether' if tether else 'plain'}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    paths = [str(REPO)] + ([str(HERE)] if tether else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    marks = scratch / f"{suite.stem}-recorded-pids"
    if tether:
        env["TETHER_DUMP_DIR"] = str(scratch / "dumps")
        env["TORCH_SUITE_MARKS"] = str(marks)
    command = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider"]
    command += ["-W", "default", f"--junitxml={junit}", "-o", "addopts="]
    command += ["-k", select] if select else []
    start = time.monotonic()
    subprocess.run(command, cwd=REPO, env=env, timeout=RUN_TIMEOUT_S, check=False)
    found, wall = outcomes(junit), time.monotonic() - start
    ran = sum(outcome != "skipped" for outcome in found.values())
    recorded = len(marks.read_text().split()) if marks.exists() else 0
    if tether and recorded <= ran:  # the runner and each test's two ranks
        raise SystemExit(f"tether recorded in {recorded} processes for {ran} tests: not installed")
    return found, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", help="pytest's -k: only the tests it selects")
    args = parser.parse_args()
    rows, differ, figures = [], [], {}
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        for name, suite in SUITES.items():
            plain, plain_s = run(suite, tether=False, select=args.select, scratch=Path(tmp))
            tethered, tether_s = run(suite, tether=True, select=args.select, scratch=Path(tmp))
            for mode, result, wall in (("plain", plain, plain_s), ("tether", tethered, tether_s)):
                counts = Counter(result.values())
                rows.append(
                    (name, mode, counts["passed"], counts["failed"], counts["skipped"], wall)
                )
                figures[f"{suite.stem}/{mode}"] = {**counts, "wall_s": round(wall, 1)}
            for test in sorted(set(plain) | set(tethered)):
                if plain.get(test) != tethered.get(test):
                    differ.append((test, plain.get(test, "absent"), tethered.get(test, "absent")))
    print(f"{'suite':<38} {'run':<7} {'passed':>7} {'failed':>7} {'skipped':>8} {'wall s':>8}")
    for name, mode, passed, failed, skipped, wall in rows:
        print(f"{name:<38} {mode:<7} {passed:>7} {failed:>7} {skipped:>8} {wall:>8.1f}")
    for test, was, now in differ:
        print(f"DIFFERS {test}: plain {was}, with tether {now}")
    print(json.dumps({"suites": figures, "differ": [t for t, _, _ in differ]}))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
