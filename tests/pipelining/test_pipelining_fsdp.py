"""PP(2) x FSDP(2) on four real gloo processes (``tests/workers/pipeline_fsdp.py``): the pipeline
schedules ``tether.pipelining`` hands out reduce ``tether.fsdp`` stages through manual
finalization, overlap the reduction when asked, and accumulate across
``step(finalize_gradients=False)``, against a single-process reference (the backport on torch
2.13/2.14, torch's own classes on 2.15)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store

pytestmark = pytest.mark.every_torch


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = new_store()
    dumps = tmp_path_factory.mktemp("pipelining_fsdp") / "dumps"
    job = launch("pipeline_fsdp.py", 4, port=store.port, dump_dir=Path(dumps), timeout=240)
    return job.results()


def _kinds(actions: list[str]) -> list[str]:
    return [a.lstrip("0123456789").rstrip("0123456789") for a in actions]


@pytest.mark.timeout(300)
def test_gradients_and_losses_match_the_reference(seen: list[dict[str, Any]]) -> None:
    assert {out["pp_rank"] for out in seen} == {0, 1}
    for out in seen:
        for case in out["cases"]:
            label = (out["rank"], case["name"], case["controls"], case["steps_per_update"])
            assert case["grad_rel_err"] < 1e-5, label
            if out["pp_rank"] == 1:
                assert case["loss_rel_err"] < 1e-5, label


@pytest.mark.timeout(300)
def test_each_stage_reduces_once_per_update_and_deferral_overlaps(
    seen: list[dict[str, Any]],
) -> None:
    for out in seen:
        for case in out["cases"]:
            for step, timeline in enumerate(case["events"]):
                finalize = case["between_steps"][step]["finalize"]
                events = [e for e in timeline if not e.startswith("backward")]
                # A step that finalizes reduces each stage once; one that does not, none.
                expected = [f"{what}{s}" for s in out["stages"] for what in ("start", "wait")]
                assert sorted(events) == (sorted(expected) if finalize else []), events
                # Each reduction is waited before the next starts: at most one pending per rank.
                assert [e[:4] for e in events] == ["star", "wait"] * len(events[::2]), events
                if not finalize:
                    continue
                # With the wait deferred, the stage computed before it waited (2.15: the wait
                # goes just before the next REDUCE_GRAD); otherwise nothing runs in between.
                overlapped = [
                    any(
                        e.startswith("backward")
                        for e in timeline[timeline.index(f"start{s}") : timeline.index(f"wait{s}")]
                    )
                    for s in out["stages"]
                ]
                if case["controls"].get("defer_reduce_grad_wait"):
                    assert sum(overlapped) == len(out["stages"]) - 1, timeline  # all but the last
                else:
                    assert not any(overlapped), timeline


@pytest.mark.timeout(300)
def test_a_step_that_does_not_finalize_keeps_parameters_unsharded_and_grads_unreduced(
    seen: list[dict[str, Any]],
) -> None:
    for out in seen:
        for case in out["cases"]:
            for state in case["between_steps"]:
                if state["finalize"]:
                    assert not any(state["unsharded"]), case["name"]
                    assert not any(state["grads_none"]), case["name"]
                else:
                    assert all(state["unsharded"]), case["name"]
                    assert all(state["grads_none"]), case["name"]
            assert any(not s["finalize"] for s in case["between_steps"]) == (
                case["steps_per_update"] == 2
            )


@pytest.mark.timeout(300)
def test_unshard_lookahead_auto_staggers_the_unshards(seen: list[dict[str, Any]]) -> None:
    for out in seen:
        for case in out["cases"]:
            kinds = _kinds(case["actions"])
            first_compute = kinds.index("F")
            up_front = kinds[:first_compute].count("UNSHARD")
            if case["controls"].get("max_active_stages") == 1:
                assert up_front == 1, case["actions"]
            elif case["controls"].get("unshard_lookahead") == "auto":
                assert up_front == min(out["pp_rank"] + 2, 3), case["actions"]  # 2, then 3
            else:  # "full": max_active_stages=3, all three of this rank's stages
                assert up_front == 3, case["actions"]
