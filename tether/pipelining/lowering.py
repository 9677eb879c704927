"""torch 2.15's lowering passes that 2.13 lacks: unshard lookahead, the REDUCE_GRAD wait, and
explicit send waits under an optional budget. Pure functions of the schedule, computed the same
on every rank (each rank lowers every rank's actions, as torch does).

Send-wait rules (2.15): a forward send waits right after the local backward of the same stage and
microbatch (that backward needs the peer's gradient, so the peer has long received the send and
the wait never stalls); backward sends, and forward sends no local backward follows, wait at the
end of the step. ``max_outstanding_sends=K`` then moves waits ahead of each send while K sends
are pending: the oldest pending send first, skipping any move that would make the ranks wait on
each other in a cycle (checked by :func:`simulate`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from tether.pipelining.actions import (
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    SEND_WAITS,
    SENDS,
    UNSHARD,
    WAIT_REDUCE_GRAD,
    B,
    F,
    I,
    W,
    _Action,
    send_of,
    wait_for,
)

__all__ = [
    "add_reduce_grad",
    "add_unshard_reshard",
    "add_wait_send",
    "add_wait_send_budget",
    "resolve_unshard_lookahead",
    "simulate",
    "validate_reduce_grad_waits",
    "validate_send_waits",
]

CYCLE = "Pipeline sends, receives, and waits form a cycle"


def check_max_active_stages(max_active_stages: object) -> int:
    if (
        isinstance(max_active_stages, bool)
        or not isinstance(max_active_stages, int)
        or max_active_stages < 1
    ):
        raise ValueError(f"max_active_stages must be a positive integer, got {max_active_stages!r}")
    return max_active_stages


def check_max_outstanding_sends(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("max_outstanding_sends must be a non-negative integer")
    return value


def resolve_unshard_lookahead(
    unshard_lookahead: object, pp_group_size: int, max_active_stages: int
) -> tuple[int, ...]:
    """Each pipeline rank's lookahead: ``"full"`` is ``max_active_stages`` everywhere (2.13's
    behaviour), ``"auto"`` is ``min(rank + 2, max_active_stages)``, a tuple names one per rank."""
    check_max_active_stages(max_active_stages)
    if unshard_lookahead == "full":
        return (max_active_stages,) * pp_group_size
    if unshard_lookahead == "auto":
        return tuple(min(rank + 2, max_active_stages) for rank in range(pp_group_size))
    if not isinstance(unshard_lookahead, tuple):
        raise ValueError(
            "unshard_lookahead must be 'full', 'auto' or a tuple of one int per pipeline rank, "
            f"got {unshard_lookahead!r}"
        )
    if len(unshard_lookahead) != pp_group_size:
        raise ValueError(
            f"unshard_lookahead has {len(unshard_lookahead)} entries for "
            f"{pp_group_size} pipeline ranks"
        )
    for value in unshard_lookahead:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= max_active_stages
        ):
            raise ValueError(
                f"unshard_lookahead entries must be ints in [1, max_active_stages="
                f"{max_active_stages}], got {unshard_lookahead!r}"
            )
    return unshard_lookahead


def _next_stages(count: int, actions: Sequence[_Action | None]) -> list[int]:
    """The next ``count`` distinct stages to compute (an OVERLAP_F_B counts all its stages, as
    in torch, so it may give more)."""
    seen: list[int] = []
    for action in actions:
        if action is None:
            continue
        indices = (
            [a.stage_index for a in action.sub_actions]
            if action.computation_type == OVERLAP_F_B and action.sub_actions is not None
            else [action.stage_index]
        )
        for index in indices:
            if index not in seen:
                seen.append(index)
                if len(seen) == count and action.computation_type != OVERLAP_F_B:
                    return seen
        if len(seen) >= count:
            break
    return seen


def add_unshard_reshard(
    compute_actions: Sequence[_Action | None],
    max_active_stages: int = 3,
    *,
    unshard_lookahead: int | None = None,
) -> list[_Action]:
    """UNSHARD/RESHARD around one rank's compute actions: at most ``max_active_stages`` stages
    unsharded, each fetched when it is among the next ``unshard_lookahead`` stages to compute
    (None: ``max_active_stages``, which is torch 2.13's lowering exactly)."""
    lookahead = max_active_stages if unshard_lookahead is None else unshard_lookahead
    active: list[int] = []
    out: list[_Action] = []
    for i, action in enumerate(compute_actions):
        if action is None:
            continue
        keep = _next_stages(max_active_stages, compute_actions[i:])
        fetch = [s for s in _next_stages(lookahead, compute_actions[i:]) if s not in active]
        for stage in [s for s in active if s not in keep]:
            active.remove(stage)
            out.append(_Action(stage, RESHARD, None))
        for stage in fetch:
            active.append(stage)
            out.append(_Action(stage, UNSHARD, None))
        out.append(action)
    out.extend(_Action(stage, RESHARD, None) for stage in active)
    return out


def add_reduce_grad(
    actions: Sequence[_Action | None], n_microbatches: int, defer_reduce_grad_wait: bool = False
) -> list[_Action]:
    """REDUCE_GRAD after a stage's last backward, and its WAIT_REDUCE_GRAD: right after it, or
    (deferred) before this rank's next REDUCE_GRAD or at the step's end, so that at most one
    reduction is pending per rank."""
    out: list[_Action] = []
    count: dict[int, int] = defaultdict(int)
    pending: int | None = None
    for action in actions:
        if action is None:
            continue
        out.append(action)
        leaves = (
            action.sub_actions
            if action.computation_type == OVERLAP_F_B and action.sub_actions is not None
            else (action,)
        )
        for leaf in leaves:
            if leaf.computation_type not in (W, B):
                continue
            count[leaf.stage_index] += 1
            if count[leaf.stage_index] != n_microbatches:
                continue
            if pending is not None:
                out.append(_Action(pending, WAIT_REDUCE_GRAD, None))
            out.append(_Action(leaf.stage_index, REDUCE_GRAD, None))
            if defer_reduce_grad_wait:
                pending = leaf.stage_index
            else:
                out.append(_Action(leaf.stage_index, WAIT_REDUCE_GRAD, None))
    if pending is not None:
        out.append(_Action(pending, WAIT_REDUCE_GRAD, None))
    return out


def validate_reduce_grad_waits(actions: dict[int, list[_Action]]) -> None:
    """Each REDUCE_GRAD is waited once, after it and before the rank's next REDUCE_GRAD."""
    for rank, rank_actions in actions.items():
        pending: int | None = None
        for action in rank_actions:
            if action.computation_type == REDUCE_GRAD:
                if pending is not None:
                    raise ValueError(
                        f"REDUCE_GRAD for stage {action.stage_index} on pipeline rank {rank} "
                        f"starts before stage {pending}'s reduction was waited on"
                    )
                pending = action.stage_index
            elif action.computation_type == WAIT_REDUCE_GRAD:
                if pending != action.stage_index:
                    raise ValueError(
                        f"{action} on pipeline rank {rank} waits for no pending REDUCE_GRAD"
                    )
                pending = None
        if pending is not None:
            raise ValueError(
                f"REDUCE_GRAD for stage {pending} on pipeline rank {rank} is never waited on"
            )


def _backs(action: _Action) -> tuple[_Action, ...]:
    if action.computation_type == OVERLAP_F_B and action.sub_actions is not None:
        return action.sub_actions
    return (action,)


def add_wait_send(actions: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
    """WAIT_SEND_F/WAIT_SEND_B for every send without one (2.15's placement; module text)."""
    out: dict[int, list[_Action]] = {}
    for rank, rank_actions in actions.items():
        waited = {a for a in rank_actions if a.computation_type in SEND_WAITS}
        after: dict[int, list[_Action]] = defaultdict(list)
        at_end: list[_Action] = []
        for i, action in enumerate(rank_actions):
            if action.computation_type not in SENDS or (wait := wait_for(action)) in waited:
                continue
            spot = None
            if action.computation_type == SEND_F:
                for j in range(i + 1, len(rank_actions)):
                    if any(
                        b.computation_type in (B, I)
                        and (b.stage_index, b.microbatch_index)
                        == (action.stage_index, action.microbatch_index)
                        for b in _backs(rank_actions[j])
                    ):
                        spot = j
                        break
            if spot is None:
                at_end.append(wait)
                continue
            # After the backward's own sends: the wait must not delay them.
            while spot + 1 < len(rank_actions) and rank_actions[spot + 1].computation_type in SENDS:
                spot += 1
            after[spot].append(wait)
        lowered: list[_Action] = []
        for i, action in enumerate(rank_actions):
            lowered.append(action)
            lowered.extend(after.get(i, ()))
        out[rank] = lowered + at_end
    return out


def _peer_recv(send: _Action) -> _Action:
    if send.computation_type == SEND_F:
        return _Action(send.stage_index + 1, RECV_F, send.microbatch_index)
    return _Action(send.stage_index - 1, RECV_B, send.microbatch_index)


def simulate(
    actions: dict[int, list[_Action]], stage_to_rank: Callable[[int], int], num_stages: int
) -> bool:
    """Whether every rank gets through its actions, given that a send's wait needs the peer to
    have posted the matching receive, and a compute needs its cross-rank input's send posted."""
    posted: set[_Action] = set()
    at = dict.fromkeys(actions, 0)

    def needs(action: _Action) -> list[_Action]:
        kind = action.computation_type
        if kind in SEND_WAITS:
            return [_peer_recv(send_of(action))]
        out = []
        for leaf in _backs(action):
            s, mb = leaf.stage_index, leaf.microbatch_index
            if leaf.computation_type == F and s > 0 and stage_to_rank(s - 1) != stage_to_rank(s):
                out.append(_Action(s - 1, SEND_F, mb))
            elif (
                leaf.computation_type in (B, I)
                and s < num_stages - 1
                and stage_to_rank(s + 1) != stage_to_rank(s)
            ):
                out.append(_Action(s + 1, SEND_B, mb))
        return out

    progress = True
    while progress:
        progress = False
        for rank, rank_actions in actions.items():
            while at[rank] < len(rank_actions):
                action = rank_actions[at[rank]]
                if any(n not in posted for n in needs(action)):
                    break
                if action.computation_type in (SEND_F, SEND_B, RECV_F, RECV_B):
                    posted.add(action)
                at[rank] += 1
                progress = True
    return all(at[r] == len(a) for r, a in actions.items())


def add_wait_send_budget(
    actions: dict[int, list[_Action]],
    max_outstanding_sends: int,
    stage_to_rank: Callable[[int], int],
    num_stages: int,
) -> dict[int, list[_Action]]:
    """Move waits ahead so that no rank ever has ``max_outstanding_sends`` sends pending when
    it issues another (module text); ValueError where that cannot be done."""
    limit = max_outstanding_sends
    out = {rank: list(rank_actions) for rank, rank_actions in actions.items()}
    for rank in sorted(out):
        i = 0
        while i < len(out[rank]):
            action = out[rank][i]
            if action.computation_type in SENDS:
                pending = _pending(out[rank], i)
                while len(pending) >= limit:
                    for send in pending:
                        trial = _move_wait(out[rank], wait_for(send), i)
                        if simulate({**out, rank: trial}, stage_to_rank, num_stages):
                            out[rank] = trial
                            i += 1  # the wait went in at i: the send is one further on
                            pending.remove(send)
                            break
                    else:
                        raise ValueError(
                            f"Cannot satisfy max_outstanding_sends={limit} on pipeline rank "
                            f"{rank} before {action}. Outstanding: {pending}. Increase the "
                            "limit or change the schedule."
                        )
            i += 1
    return out


def _pending(rank_actions: list[_Action], i: int) -> list[_Action]:
    """The sends before position ``i`` whose wait comes at or after it, oldest first."""
    waits_before = {a for a in rank_actions[:i] if a.computation_type in SEND_WAITS}
    return [
        a
        for a in rank_actions[:i]
        if a.computation_type in SENDS and wait_for(a) not in waits_before
    ]


def _move_wait(rank_actions: list[_Action], wait: _Action, to: int) -> list[_Action]:
    trial = [a for a in rank_actions if a != wait]
    trial.insert(to, wait)
    return trial


def validate_send_waits(
    actions: dict[int, list[_Action]], stage_to_rank: Callable[[int], int], num_stages: int
) -> None:
    """Each send is waited once, later, on its rank; no wait without its send; no cycle."""
    for rank, rank_actions in actions.items():
        sent: set[_Action] = set()
        waited: set[_Action] = set()
        for action in rank_actions:
            if action.computation_type in SENDS:
                sent.add(wait_for(action))
            elif action.computation_type in SEND_WAITS:
                if action not in sent or action in waited:
                    raise ValueError(f"{action} on pipeline rank {rank} waits for no pending send")
                waited.add(action)
        if sent != waited:
            raise ValueError(
                f"sends never waited on pipeline rank {rank}: {sorted(map(str, sent - waited))}"
            )
    if not simulate(actions, stage_to_rank, num_stages):
        raise ValueError(CYCLE)
