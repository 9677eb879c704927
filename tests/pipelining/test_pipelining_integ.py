"""tether.pipelining in a real 2-process gloo job (``tests/workers/pipeline_controls.py``): every
schedule, torch's and ``tether.pipelining``'s under each control, against a single-process
reference, with what each rank held (measured alike for every implementation) checked against the
lowered schedule. ``tether.pipelining`` is tether's backport before torch 2.15 and torch's own
classes on 2.15: the same expectations hold for both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._jobs import launch, new_store
from tether._versions import TORCH_PIPELINE_CONTROLS

pytestmark = pytest.mark.every_torch


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = new_store()
    dumps = tmp_path_factory.mktemp("pipelining") / "dumps"
    job = launch("pipeline_controls.py", 2, port=store.port, dump_dir=Path(dumps), timeout=240)
    return job.results()


def has_2_15_controls(case: dict[str, Any]) -> bool:
    """The case ran 2.15's pipeline controls: tether's, or torch's own from 2.15 on."""
    return case["which"] == "tether" or TORCH_PIPELINE_CONTROLS


def split(action: str) -> tuple[str, str, str]:
    """``"3RECV_F0"`` -> ``("3", "RECV_F", "0")``."""
    body = action.lstrip("0123456789")
    kind = body.rstrip("0123456789")
    return action[: len(action) - len(body)], kind, body[len(kind) :]


def flat(actions: list[str]) -> list[str]:
    """``(0F1;1B0)OVERLAP_F_B`` as its two actions, in the order they run."""
    out: list[str] = []
    for action in actions:
        if action.startswith("("):
            out.extend(action[1 : action.index(")")].split(";"))
        else:
            out.append(action)
    return out


def bounds(actions: list[str]) -> tuple[int, int]:
    """The most receives posted and not yet consumed, and the most sends not yet waited, along
    one rank's lowered actions (each moves one tensor in this model)."""
    actions = flat(actions)
    held = pending = most_held = most_pending = 0
    for action in actions:
        stage, kind, mb = split(action)
        held += kind in ("RECV_F", "RECV_B")
        pending += (kind in ("SEND_F", "SEND_B")) - (kind in ("WAIT_SEND_F", "WAIT_SEND_B"))
        most_held, most_pending = max(most_held, held), max(most_pending, pending)
        # A compute consumes the receive this rank posted for it (none from a same-rank stage).
        if kind == "F":
            held -= f"{stage}RECV_F{mb}" in actions
        elif kind in ("B", "I"):
            held -= f"{stage}RECV_B{mb}" in actions
    return most_held, most_pending


@pytest.mark.timeout(300)
def test_every_schedule_matches_the_single_process_reference(seen: list[dict[str, Any]]) -> None:
    for out in seen:
        assert len(out["cases"]) == 28
        for case in out["cases"]:
            label = (out["rank"], case["name"], case["which"], case["controls"])
            assert case["grad_rel_err"] < 1e-5, label
            if case["loss_rel_err"] is not None:
                assert case["loss_rel_err"] < 1e-5, label
        # The last stage's rank reports losses for every schedule.
    assert any(c["loss_rel_err"] is not None for out in seen for c in out["cases"])


@pytest.mark.timeout(300)
def test_receive_buffers_are_held_only_between_receive_and_compute(
    seen: list[dict[str, Any]],
) -> None:
    n_mb = seen[0]["n_mb"]
    for out in seen:
        for case in out["cases"]:
            label = (out["rank"], case["name"], case["controls"])
            held = case["recv_buffers_peak"]
            if not has_2_15_controls(case):
                # torch 2.13/2.14: one buffer per microbatch and direction, for the stage's life.
                assert held[0] == held[1] and held[0] % n_mb == 0 and held[0] >= n_mb, label
                continue
            if case["actions"] is None:  # single-stage schedule: torch's loop, tether's stage
                assert held == [1, 1], label
                continue
            recv_bound, _ = bounds(case["actions"])
            assert held == [recv_bound, recv_bound], label
    tether_il = next(
        c
        for c in seen[1]["cases"]
        if c["name"] == "ScheduleInterleaved1F1B" and c["which"] == "tether"
    )
    torch_il = next(
        c
        for c in seen[1]["cases"]
        if c["name"] == "ScheduleInterleaved1F1B" and c["which"] == "torch"
    )
    if TORCH_PIPELINE_CONTROLS:  # the same classes
        assert torch_il["recv_buffers_peak"] == tether_il["recv_buffers_peak"]
    else:
        assert torch_il["recv_buffers_peak"][0] >= 8 * tether_il["recv_buffers_peak"][0]


@pytest.mark.timeout(300)
def test_tethers_own_counts_agree_with_the_probe(seen: list[dict[str, Any]]) -> None:
    """``tether.pipelining.memory_stats`` (tether's stages) counts what the probe measures."""
    counted = 0
    for out in seen:
        for case in out["cases"]:
            for step, tally in enumerate(case["counted_by_tether"]):
                label = (out["rank"], case["name"], case["controls"], step)
                probe = [case["recv_buffers_peak"][step], case["fwd_outputs_peak"][step]]
                probe += [case["pending_sends_peak"][step]][: len(tally) - 2]
                assert tally == probe, label
                counted += 1
    # tether's stages count on 2.13/2.14; torch 2.15's classes count nothing.
    assert (counted > 0) != TORCH_PIPELINE_CONTROLS


SPLIT_BACKWARD_RELEASES = TORCH_PIPELINE_CONTROLS
"""torch 2.15 also releases the outputs of a stage whose backward is split (zero-bubble schedules'
I and W); tether's backport keeps them to the input backward (docs/compat.md)."""


def outputs_bound(actions: list[str], last_stage: int, releases: bool) -> int:
    """The most microbatches whose forward outputs one rank holds for backward along its
    lowered actions: from a forward (not the last stage's) to that microbatch's backward, or to
    the wait of the send that carried them where the stage releases outputs (2.15's rules)."""
    actions = flat(actions)
    split_backward = set()
    if not SPLIT_BACKWARD_RELEASES:
        split_backward = {split(a)[0] for a in actions if split(a)[1] == "I"}
    live: set[tuple[str, str]] = set()
    most = 0
    for action in actions:
        stage, kind, mb = split(action)
        if kind == "F" and int(stage) != last_stage:
            live.add((stage, mb))
        elif kind in ("B", "I") or (
            kind == "WAIT_SEND_F" and releases and stage not in split_backward
        ):
            live.discard((stage, mb))
        most = max(most, len(live))
    return most


@pytest.mark.timeout(300)
def test_forward_outputs_are_released_once_their_send_is_waited(
    seen: list[dict[str, Any]],
) -> None:
    released_early = False
    for out in seen:
        for case in out["cases"]:
            if not has_2_15_controls(case) or case["actions"] is None:
                continue
            label = (out["rank"], case["name"], case["controls"])
            ddp = bool(case["controls"].get("ddp"))
            last = case["n_stages"] - 1
            bound = outputs_bound(case["actions"], last, releases=not ddp)
            assert case["fwd_outputs_peak"] == [bound, bound], label
            kept = outputs_bound(case["actions"], last, releases=False)
            if ddp:  # fails closed: held to the backward, as without release
                assert bound == kept, label
            released_early |= bound < kept
    # A tight send budget moves waits ahead of backward, so outputs go sooner there.
    assert released_early


@pytest.mark.timeout(300)
def test_single_stage_schedules_hold_outputs_as_their_waits_allow(
    seen: list[dict[str, Any]],
) -> None:
    n_mb = seen[0]["n_mb"]
    for out in seen:
        last = out["rank"] == out["world"] - 1
        for case in out["cases"]:
            if not has_2_15_controls(case) or case["actions"] is not None:
                continue
            # 1F1B releases each output when its send is waited (after the next forward);
            # GPipe waits its sends after all forwards, so it holds every one until then.
            expected = 0 if last else (2 if case["name"] == "Schedule1F1B" else n_mb)
            assert case["fwd_outputs_peak"] == [expected, expected], (out["rank"], case["name"])


@pytest.mark.timeout(300)
def test_pending_sends_follow_the_wait_actions_and_the_budget(seen: list[dict[str, Any]]) -> None:
    for out in seen:
        for case in out["cases"]:
            if not has_2_15_controls(case) or case["actions"] is None:
                continue
            label = (out["rank"], case["name"], case["controls"])
            _, send_bound = bounds(case["actions"])
            assert case["pending_sends_peak"] == [send_bound, send_bound], label
            budget = case["controls"].get("max_outstanding_sends")
            if budget is not None:
                assert send_bound <= budget, label
            else:  # 2.15's placement: backward sends wait at the step's end, so more are pending
                assert send_bound > 2, label


@pytest.mark.timeout(300)
def test_reduce_grad_waits_are_deferred_on_request(seen: list[dict[str, Any]]) -> None:
    for out in seen:
        for case in out["cases"]:
            if not has_2_15_controls(case) or case["actions"] is None:
                continue
            kinds = [split(a)[1] for a in flat(case["actions"])]
            reduce_at = [i for i, k in enumerate(kinds) if k == "REDUCE_GRAD"]
            waits_at = [i for i, k in enumerate(kinds) if k == "WAIT_REDUCE_GRAD"]
            assert len(reduce_at) == len(waits_at) == case["n_local_stages"]
            if case["controls"].get("defer_reduce_grad_wait"):
                # The first reduction is waited just before the second starts.
                assert waits_at[0] == reduce_at[1] - 1 and waits_at[0] > reduce_at[0] + 1
            else:  # waited before anything else computes (only receives/sends between)
                for r, w in zip(reduce_at, waits_at, strict=True):
                    between = set(kinds[r + 1 : w])
                    assert w > r and not between & {"F", "B", "I", "W", "REDUCE_GRAD"}, kinds
