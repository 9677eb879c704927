"""examples/weight_sync.py, run as users run it: three processes, weights checked bit-exact."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

import pytest

from tests._jobs import REPO, worker_env


@pytest.mark.timeout(150)
def test_weight_sync_arrives_bit_exact() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "weight_sync.py"), "--steps", "2"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen: dict[int, dict[int, str]] = defaultdict(dict)
    for rank, step, sha in re.findall(r"rank (\d) step (\d+) sha256 ([0-9a-f]{64})", proc.stdout):
        seen[int(step)][int(rank)] = sha
    assert sorted(seen) == [1, 2], proc.stdout
    for step, by_rank in seen.items():
        assert sorted(by_rank) == [0, 1, 2], f"step {step}: {proc.stdout}"
        assert len(set(by_rank.values())) == 1, f"step {step} differs: {by_rank}"
    assert seen[1][0] != seen[2][0]  # the weights changed between steps
    assert "over local" in proc.stdout  # backend="auto" on one host
