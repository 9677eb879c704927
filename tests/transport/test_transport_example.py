"""The transport examples, run as users run them: examples/weight_sync.py (a trainer and three
inference hosts, weights checked bit-exact; across simulated nodes in
tests/cluster/test_fanout_nodes.py) and examples/transport_api.py (torch 2.15 code on tether),
which the README's tour quotes."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

import pytest

import tether.transport as tt
from tests._jobs import REPO, worker_env
from tether import _versions

pytestmark = pytest.mark.every_torch


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
        assert sorted(by_rank) == [0, 1, 2, 3], f"step {step}: {proc.stdout}"
        assert len(set(by_rank.values())) == 1, f"step {step} differs: {by_rank}"
    assert seen[1][0] != seen[2][0]  # the weights changed between steps


def _code(line: str) -> str:
    return line.split("  #")[0].strip()


def test_readme_transport_example_is_the_example_program() -> None:
    """The README's transport block is made of lines of examples/transport_api.py (comments
    aside), the program the next test runs."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### One-sided transfers") :]
    start = section.index("```python\n") + len("```python\n")
    block = section[start : section.index("\n```", start)]
    program = {
        _code(line) for line in (REPO / "examples" / "transport_api.py").read_text().splitlines()
    }
    lines = [_code(line) for line in block.splitlines() if _code(line)]
    assert len(lines) >= 10
    assert [line for line in lines if line not in program] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend",
    [
        "tether-tcp",  # names torch 2.15's registry knows too (tether's entry points)
        "local",
        "tcp",
        pytest.param(
            "nixl",  # the backend torch 2.15 ships
            marks=pytest.mark.skipif(
                "nixl" not in tt.supported_transports(), reason="nixl-cu12 not installed"
            ),
        ),
    ],
)
def test_torch_2_15_program_runs_on_tether(backend: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "transport_api.py"), "--backend", backend],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = re.findall(rf"rank (\d): ok over {backend} \((\S+)\)", proc.stdout)
    module = "torch.distributed._transport" if _versions.TORCH_TRANSPORT else "tether.transport"
    assert sorted(ok) == [("0", module), ("1", module)], proc.stdout
