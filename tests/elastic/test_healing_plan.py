"""Who heals whom at a regroup (``tether.elastic.manager.healing_plans``), with DDP's one part
of the state and with HSDP's shards: the cases a death mid-step can leave; and how the healers
report it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tether._exceptions import TetherError
from tether.elastic.manager import healing_plans
from tether.job.elastic import Decision, Membership


def whole(rank: int) -> int:
    return 0  # DDP: every member holds the whole state


def shard_of(rank: int) -> int:
    return rank % 2  # HSDP, two ranks a node: rank k of a node holds shard k


def test_ddp_heals_a_replacement_and_a_member_behind_from_the_lowest_member_furthest_on() -> None:
    decision = Decision(2, (0, 1, 2, 3), fresh=(3,))
    at = {0: 7, 1: 8, 2: 8, 3: -1}
    assert healing_plans(decision, at, whole) == {0: (1, (3, 0))}


def test_ddp_without_fresh_members_at_one_step_heals_nobody() -> None:
    decision = Decision(1, (0, 1, 2))
    assert healing_plans(decision, {0: 4, 1: 4, 2: 4}, whole) == {0: (0, ())}


def test_hsdp_heals_each_replacement_from_a_member_holding_its_shard() -> None:
    decision = Decision(2, (0, 1, 2, 3, 4, 5), fresh=(4, 5))
    at = {0: 9, 1: 9, 2: 9, 3: 9, 4: -1, 5: -1}
    assert healing_plans(decision, at, shard_of) == {0: (0, (4,)), 1: (1, (5,))}


def test_hsdp_takes_back_a_replica_ahead_when_a_shard_never_reached_its_step() -> None:
    # Rank 0 applied step 5; rank 2 (its shard's other replica) and both replicas of shard 1 did
    # not: the job is at step 5 for shard 1 only from step 5's start, so rank 0 goes back to it.
    decision = Decision(1, (0, 1, 2, 3))
    at = {0: 6, 1: 5, 2: 5, 3: 5}
    assert healing_plans(decision, at, shard_of) == {0: (2, (0,)), 1: (1, ())}


def test_hsdp_stops_when_no_replica_of_a_shard_is_at_the_jobs_step() -> None:
    decision = Decision(1, (0, 1, 2, 3))
    at = {0: 6, 1: 5, 2: 6, 3: 5}  # shard 0 applied the step on both replicas, shard 1 on none
    with pytest.raises(TetherError, match="no member holding part 0 of the state is at step 5"):
        healing_plans(decision, at, shard_of)


def test_a_shard_with_no_member_left_cannot_heal_its_replacement() -> None:
    decision = Decision(3, (0, 2, 5), fresh=(5,))
    with pytest.raises(TetherError, match="part 1"):
        healing_plans(decision, {0: 3, 2: 3, 5: -1}, shard_of)


def test_the_healers_of_several_shards_report_one_regroup_with_all_their_bytes(
    store: dist.TCPStore,
) -> None:
    membership = Membership(store)
    entry = {"epoch": 2, "step": 9, "heal_s": 0.5, "heal_over": "tcp"}
    membership.report_regrouped(2, {**entry, "heal_bytes": 4880, "healer": 0}, healers=2)
    assert membership.regrouped(2) is None, "reported before every healer did"
    membership.report_regrouped(2, {**entry, "heal_bytes": 4352, "healer": 1}, healers=2)
    report = membership.regrouped(2)
    assert report is not None and (report["heal_bytes"], report["healers"]) == (9232, 2)
