"""Groups torch splits from a recorded one (``dist.split_group``) behave with tether as without
it, and are recorded like any group: a real 3-rank gloo job, plain and under tether
(``tests/workers/split.py``). torch 2.13's gloo refuses to split a group with no bound device,
and tether leaves that refusal as it is; 2.14's and 2.15's split it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store

pytestmark = [pytest.mark.every_torch, pytest.mark.python_recorder, pytest.mark.regroup]


def run(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    store = new_store()
    job = launch("split.py", 3, "--mode", mode, port=store.port, dump_dir=tmp_path / mode)
    return job.results()


@pytest.mark.timeout(180)
def test_a_split_behaves_as_without_tether_and_its_child_is_recorded(tmp_path: Path) -> None:
    plain, recorded = run("plain", tmp_path), run("tether", tmp_path)
    assert [r["split"] for r in recorded] == [r["split"] for r in plain]
    if "error" in plain[0]["split"]:  # torch 2.13: no split without a bound device
        assert plain[0]["split"]["error"].startswith("RuntimeError: No device associated")
        return
    assert [r["split"] for r in plain] == [
        {"size": 2, "sum": [3.0, 3.0]},
        {"size": 2, "sum": [3.0, 3.0]},
        {"size": 1, "sum": [3.0, 3.0]},
    ]
    for rank, out in enumerate(recorded):
        members = "[0, 1]" if rank < 2 else "[2]"
        # The child's all-reduce, recorded on the child with its members.
        assert ["halves", members, "gloo:all_reduce", "completed"] in out["recorded"], out
