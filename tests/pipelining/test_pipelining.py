"""tether.pipelining's lowering and constructor contract, single process: the exact action lists
2.15's rules give (send waits, the send budget, unshard lookahead, the REDUCE_GRAD wait), every
ValueError, the action strings, the receive-buffer state machine, the release of forward outputs,
``step()``'s keywords and the per-edge flag."""

from __future__ import annotations

import inspect
import types
import weakref
from typing import Any

import pytest

from tether._versions import TORCH_PIPELINE_CONTROLS

if TORCH_PIPELINE_CONTROLS:
    pytest.skip(
        "the backport's lowering and stage internals: on torch 2.15 tether.pipelining is torch's "
        "own classes, whose behaviour the integration tests check",
        allow_module_level=True,
    )

import torch
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining import _utils
from torch.distributed.pipelining._backward import stage_backward

from tether._exceptions import ConfigError
from tether.config import pipeline_per_edge_p2p_default
from tether.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    _torch,
)
from tether.pipelining.actions import _Action, _ComputationType, from_torch
from tether.pipelining.lowering import (
    CYCLE,
    add_reduce_grad,
    add_unshard_reshard,
    add_wait_send,
    add_wait_send_budget,
    resolve_unshard_lookahead,
    validate_reduce_grad_waits,
    validate_send_waits,
)
from tether.pipelining.outputs import ReleasedOutputs, releasable
from tether.pipelining.recv import RecvCache, make_jit
from tether.pipelining.schedules import _refuse_shared_comm_ctx
from tether.pipelining.stats import Tally
from tether.pipelining.step import Step

pytestmark = [pytest.mark.timeout(60), pytest.mark.every_torch]


def acts(text: str) -> list[_Action]:
    return [a for s in text.split() if (a := _Action.from_str(s)) is not None]


def show(actions: list[_Action]) -> str:
    return " ".join(map(str, actions))


def identity(stage: int) -> int:
    return stage


def one_f_one_b() -> dict[int, list[_Action]]:
    """Two ranks, one stage each, two microbatches, after torch's own send/receive pass."""
    compute = {0: acts("0F0 0F1 0B0 0B1"), 1: acts("1F0 1B0 1F1 1B1")}
    comms = torch_schedules._add_send_recv(compute, stage_to_rank=identity, num_stages=2)
    return {r: [a for x in v if (a := from_torch(x)) is not None] for r, v in comms.items()}


def test_new_action_strings_parse_and_round_trip() -> None:
    for text in ("3WAIT_SEND_F1", "0WAIT_SEND_B12", "2WAIT_REDUCE_GRAD", "1W0", "4SEND_B3", "0F0"):
        action = _Action.from_str(text)
        assert action is not None and str(action) == text
    assert _Action.from_str("3WAIT_SEND_F1") == (3, _ComputationType.WAIT_SEND_F, 1, None)
    assert _Action.from_str("2WAIT_REDUCE_GRAD") == (2, "WAIT_REDUCE_GRAD", None, None)
    # torch 2.13's pattern reads the new strings as a BACKWARD_WEIGHT ("W"): why tether parses.
    assert str(torch_schedules._Action.from_str("1WAIT_SEND_F0")) == "1W"
    overlap = _Action.from_str("(0F1;1B0)OVERLAP_F_B")
    assert overlap is not None and overlap.sub_actions == tuple(acts("0F1 1B0"))
    with pytest.raises(RuntimeError, match="Invalid action string"):
        _Action.from_str("0WAIT")
    # tether's actions equal torch's, and run through torch's runtime comparisons.
    assert _Action.from_str("2SEND_F1") == torch_schedules._Action(2, torch_schedules.SEND_F, 1)


def test_send_waits_follow_2_15s_placement() -> None:
    waited = add_wait_send(one_f_one_b())
    # A forward send waits after the local backward of its microbatch; backward sends at the end.
    assert show(waited[0]) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0WAIT_SEND_F0 0RECV_B1 0B1 0WAIT_SEND_F1"
    )
    assert show(waited[1]) == (
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1WAIT_SEND_B0 1WAIT_SEND_B1"
    )
    validate_send_waits(waited, identity, 2)
    assert add_wait_send(waited) == waited  # sends already waited get no second wait


@pytest.mark.parametrize(
    ("budget", "rank0", "rank1"),
    [
        (
            1,
            "0F0 0SEND_F0 0F1 0WAIT_SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0WAIT_SEND_F1",
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1WAIT_SEND_B0 1SEND_B1 1WAIT_SEND_B1",
        ),
        (
            2,
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0WAIT_SEND_F0 0RECV_B1 0B1 0WAIT_SEND_F1",
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1WAIT_SEND_B0 1WAIT_SEND_B1",
        ),
    ],
)
def test_send_budget_moves_the_oldest_wait_ahead(budget: int, rank0: str, rank1: str) -> None:
    lowered = add_wait_send_budget(add_wait_send(one_f_one_b()), budget, identity, 2)
    assert (show(lowered[0]), show(lowered[1])) == (rank0, rank1)
    validate_send_waits(lowered, identity, 2)


def test_an_impossible_budget_names_the_rank_and_the_action() -> None:
    with pytest.raises(ValueError) as raised:
        add_wait_send_budget(add_wait_send(one_f_one_b()), 0, identity, 2)
    assert str(raised.value) == (
        "Cannot satisfy max_outstanding_sends=0 on pipeline rank 0 before 0SEND_F0. "
        "Outstanding: []. Increase the limit or change the schedule."
    )


def test_a_wait_that_would_cycle_is_refused() -> None:
    # Rank 0 waits for microbatch 0's send before sending microbatch 1, but rank 1 posts
    # microbatch 0's receive only after computing microbatch 1.
    cyclic = {
        0: acts("0F0 0SEND_F0 0WAIT_SEND_F0 0F1 0SEND_F1 0WAIT_SEND_F1"),
        1: acts("1RECV_F1 1F1 1RECV_F0 1F0"),
    }
    with pytest.raises(ValueError, match=CYCLE):
        validate_send_waits(cyclic, identity, 2)
    unwaited = {0: acts("0F0 0SEND_F0"), 1: acts("1RECV_F0 1F0")}
    with pytest.raises(ValueError, match="never waited"):
        validate_send_waits(unwaited, identity, 2)
    with pytest.raises(ValueError, match="waits for no pending send"):
        validate_send_waits({0: acts("0WAIT_SEND_F0"), 1: []}, identity, 2)


def test_unshard_lookahead_resolves_as_in_2_15() -> None:
    assert resolve_unshard_lookahead("full", 4, 3) == (3, 3, 3, 3)
    assert resolve_unshard_lookahead("auto", 4, 3) == (2, 3, 3, 3)
    assert resolve_unshard_lookahead((1, 2), 2, 2) == (1, 2)
    for bad, match in (
        ("some", "must be 'full', 'auto'"),
        ((1, 2, 3), "3 entries for 2 pipeline ranks"),
        ((0, 1), r"ints in \[1, max_active_stages=3\]"),
        ((True, 1), r"ints in \[1"),
    ):
        with pytest.raises(ValueError, match=match):
            resolve_unshard_lookahead(bad, 2, 3)
    with pytest.raises(ValueError, match="max_active_stages must be a positive integer"):
        resolve_unshard_lookahead("full", 2, True)


def test_unshard_lookahead_staggers_the_unshards() -> None:
    compute = acts("0F0 2F0 4F0 0F1 2F1 4F1 4B0 2B0 0B0")
    # "full" (max_active_stages=3) fetches the three stages up front: torch 2.13's lowering.
    full = add_unshard_reshard(compute, 3)
    assert show(full).startswith("0UNSHARD 2UNSHARD 4UNSHARD 0F0")
    torch_full = torch_schedules._add_unshard_reshard(list(compute), 3)
    assert [str(a) for a in torch_full] == [str(a) for a in full]
    # Lookahead 1: each stage is fetched just before its first compute, and resharded once it
    # is not among the next three, as with "full".
    one = add_unshard_reshard(compute, 3, unshard_lookahead=1)
    assert show(one) == (
        "0UNSHARD 0F0 2UNSHARD 2F0 4UNSHARD 4F0 0F1 2F1 4F1 4B0 4RESHARD 2B0 2RESHARD 0B0 0RESHARD"
    )
    # max_active_stages=2 keeps only the next two stages (torch's eviction rule): stage 0 goes
    # as soon as it is not among them, and comes back for its next compute.
    two = add_unshard_reshard(compute, 2, unshard_lookahead=1)
    assert show(two).startswith("0UNSHARD 0F0 0RESHARD 2UNSHARD 2F0 2RESHARD 4UNSHARD 4F0")


def test_reduce_grad_is_waited_at_once_or_deferred() -> None:
    compute = acts("0B0 2B0 0B1 2B1")
    assert show(add_reduce_grad(compute, 2)) == (
        "0B0 2B0 0B1 0REDUCE_GRAD 0WAIT_REDUCE_GRAD 2B1 2REDUCE_GRAD 2WAIT_REDUCE_GRAD"
    )
    deferred = add_reduce_grad(compute, 2, defer_reduce_grad_wait=True)
    assert show(deferred) == (
        "0B0 2B0 0B1 0REDUCE_GRAD 2B1 0WAIT_REDUCE_GRAD 2REDUCE_GRAD 2WAIT_REDUCE_GRAD"
    )
    # Without the waits, both are torch 2.13's REDUCE_GRAD placement.
    torch_placed = [str(a) for a in torch_schedules._add_reduce_grad(list(compute), 2)]
    assert [str(a) for a in deferred if a.computation_type != "WAIT_REDUCE_GRAD"] == torch_placed
    validate_reduce_grad_waits({0: deferred})
    with pytest.raises(ValueError, match="never waited"):
        validate_reduce_grad_waits({0: acts("0REDUCE_GRAD")})
    with pytest.raises(ValueError, match="starts before stage 0's reduction was waited on"):
        validate_reduce_grad_waits({0: acts("0REDUCE_GRAD 2REDUCE_GRAD")})
    with pytest.raises(ValueError, match="waits for no pending REDUCE_GRAD"):
        validate_reduce_grad_waits({0: acts("0WAIT_REDUCE_GRAD")})


def test_constructors_take_2_15s_signature_and_refuse_bad_controls() -> None:
    params = inspect.signature(ScheduleInterleaved1F1B).parameters
    names = list(params)
    assert names[names.index("defer_pp_recv") + 1 :] == [
        "max_active_stages",
        "unshard_lookahead",
        "defer_reduce_grad_wait",
        "max_outstanding_sends",
    ]
    assert params["max_active_stages"].default == 3
    assert params["unshard_lookahead"].default == "full"
    assert params["defer_reduce_grad_wait"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["max_outstanding_sends"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "args_chunk_spec" not in inspect.signature(ScheduleLoopedBFS).parameters
    assert issubclass(ScheduleInterleaved1F1B, torch_schedules.ScheduleInterleaved1F1B)
    stages: Any = [types.SimpleNamespace(group_size=2)]
    for value in (-1, True, 1.5):
        with pytest.raises(
            ValueError, match="max_outstanding_sends must be a non-negative integer"
        ):
            ScheduleInterleaved1F1B(stages, 4, max_outstanding_sends=value)
    with pytest.raises(ValueError, match="max_active_stages must be a positive integer"):
        ScheduleInterleaved1F1B(stages, 4, None, None, None, None, True, True, False, 0)
    with pytest.raises(TypeError):  # keyword-only, as in 2.15
        ScheduleInterleaved1F1B(
            stages, 4, None, None, None, None, True, True, False, 3, "full", True
        )


def test_receive_buffers_exist_only_while_held() -> None:
    meta = _utils.extract_tensor_meta(torch.zeros(2, 3))
    info = torch.distributed.pipelining.stage._RecvInfo("x", 0, torch.zeros(2, 3), meta)
    stats = Tally()
    make_jit({0: (info,)}, stats, RecvCache("cpu"))
    assert info.buffer is None  # the preallocated buffer is gone
    buffer = info.allocate_buffer()
    assert info.buffer is buffer and (stats.now, stats.now_bytes) == (1, 24)
    with pytest.raises(_utils.PipeliningMetadataError, match="still owned by an incomplete"):
        info.allocate_buffer()  # pytorch#185331: never silently reused
    with pytest.raises(_utils.PipeliningMetadataError, match="still owned by an incomplete"):
        info.buffer = torch.zeros(2, 3)
    assert info.take_buffer() is buffer and stats.now == 0 and stats.peak == 1
    with pytest.raises(_utils.PipeliningMetadataError, match="has not been set"):
        info.take_buffer()
    info.buffer = torch.ones(2, 3)  # a same-rank stage's hand-off: held, not allocated here
    assert stats.now == 0 and info.take_buffer() is not None


def test_receive_buffer_reused_only_when_nothing_else_uses_it() -> None:
    cache, meta = RecvCache("cpu"), _utils.extract_tensor_meta(torch.zeros(4, 8))

    def ptr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    first = cache.empty(meta)
    first_ptr, view = ptr(first), first[1:]  # a view (a pending receive, a user's reference)
    del first
    second = cache.empty(meta).requires_grad_()
    second_ptr, graph = ptr(second), (second * 3).sum()  # autograd holds the leaf
    del second
    third = cache.empty(meta)
    third_ptr, alias = ptr(third), third.detach()  # another tensor on its memory
    del third
    fourth = cache.empty(meta)  # the caller keeps this very object
    assert len({first_ptr, second_ptr, third_ptr, ptr(fourth)}) == 4  # all in use: no reuse
    del view
    reused = cache.empty(meta)
    assert ptr(reused) == first_ptr and reused.shape == (4, 8) and not reused.requires_grad
    graph.backward()  # leaves a gradient on the leaf, as torch's stage_backward does
    del graph  # the graph freed: the leaf is free too
    again = cache.empty(meta)
    assert ptr(again) == second_ptr and again.grad is None and not again.requires_grad
    del alias
    assert ptr(cache.empty(meta)) == third_ptr
    hooked = cache.empty(meta).requires_grad_()  # (its layout's meta wants no gradient: reset)
    hooked_ptr = ptr(hooked)
    hooked.register_hook(lambda grad: grad)  # a user's hook stays with the object
    del hooked
    assert ptr(cache.empty(meta)) != hooked_ptr
    wanted = _utils.extract_tensor_meta(torch.zeros(4, 8, requires_grad=True))
    assert ptr(cache.empty(wanted)) not in (first_ptr, second_ptr, third_ptr)  # activations
    other = cache.empty(_utils.extract_tensor_meta(torch.zeros(8, 4)))  # another layout
    assert ptr(other) not in (first_ptr, second_ptr, third_ptr, ptr(fourth))
    kept = [cache.empty(meta) for _ in range(RecvCache.LIMIT + 5)]  # a caller keeps all
    assert all(len(entries) <= RecvCache.LIMIT for entries in cache._buffers.values())
    assert len({ptr(t) for t in kept}) == len(kept)  # never two live tensors on one storage
    assert ptr(fourth) not in {ptr(t) for t in kept}


def test_per_edge_p2p_reads_torchs_variable() -> None:
    var = "TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P"
    assert pipeline_per_edge_p2p_default({}) is False
    assert pipeline_per_edge_p2p_default({var: "1"}) is True
    assert pipeline_per_edge_p2p_default({var: "off"}) is False
    with pytest.raises(ConfigError, match=var):
        pipeline_per_edge_p2p_default({var: "sometimes"})


def test_released_outputs_backward_as_torch_does_and_free_the_outputs() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 4)
    x = torch.randn(2, 3, requires_grad=True)
    grad = torch.randn(2, 4)
    expected_input = stage_backward((layer(x),), (grad,), [x])[0]
    expected_weight = layer.weight.grad.clone()  # type: ignore[union-attr]
    layer.zero_grad()
    out = layer(x)
    released = ReleasedOutputs((out,))
    alive = weakref.ref(out)
    del out
    assert alive() is None  # the stage's reference was the last one
    (got,) = released.backward((grad,), [x])
    assert torch.equal(got, expected_input) and x.grad is None  # taken off the input, as torch
    assert torch.equal(layer.weight.grad, expected_weight)  # type: ignore[arg-type]


def test_outputs_are_kept_where_2_15_keeps_them() -> None:
    plain = (torch.zeros(1),)
    stage = types.SimpleNamespace(
        is_last=False, has_backward=True, dw_builder=None, submod=torch.nn.Linear(1, 1)
    )
    assert releasable(stage, plain)
    assert not releasable(types.SimpleNamespace(**vars(stage) | {"is_last": True}), plain)
    assert not releasable(types.SimpleNamespace(**vars(stage) | {"dw_builder": list}), plain)
    assert not releasable(types.SimpleNamespace(**vars(stage) | {"has_backward": False}), plain)
    subclass = (torch.nn.Parameter(torch.zeros(1)),)  # not a plain torch.Tensor
    assert not releasable(stage, subclass)


def test_step_takes_2_15s_keywords_and_checks_pre_split_inputs() -> None:
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B):
        params = inspect.signature(cls.step).parameters
        assert params["finalize_gradients"].default is True, cls
        assert {"arg_mbs", "kwarg_mbs", "target_mbs"} <= set(params), cls
    assert issubclass(Schedule1F1B, torch_schedules.Schedule1F1B)
    fake: Any = types.SimpleNamespace(_n_microbatches=2)
    fake._check_inputs = types.MethodType(torch_schedules._PipelineSchedule._check_inputs, fake)

    def check(*args: Any, kwargs: Any = None, target: Any = None, **mbs: Any) -> Any:
        given = {"arg_mbs": None, "kwarg_mbs": None, "target_mbs": None} | mbs
        return Step._check_presplit(fake, args, kwargs or {}, target, *given.values())

    with pytest.raises(ValueError, match="instead of positional args"):
        check(torch.zeros(1), arg_mbs=[(), ()])
    with pytest.raises(ValueError, match="Unexpected keyword arguments with pre-split inputs: m"):
        check(kwargs={"m": 1}, arg_mbs=[(), ()])
    with pytest.raises(ValueError, match="instead of target="):
        check(target=torch.zeros(1), target_mbs=[1, 2])
    with pytest.raises(ValueError, match="Expecting 2 arg_mbs"):
        check(arg_mbs=[()])
    with pytest.raises(TypeError, match=r"arg_mbs\[1\] is a <class 'list'>"):
        check(arg_mbs=[(), []])
    assert check(arg_mbs=[(1,), (2,)], target_mbs=[3, 4]) == ([(1,), (2,)], [{}, {}], [3, 4])


def test_deferred_reduce_grad_waits_refuse_a_shared_fsdp_context() -> None:
    class Stage(_torch.FSDPModule):
        def __init__(self, context: object) -> None:
            self.context = context

        def _get_fsdp_state(self) -> Any:
            return types.SimpleNamespace(_comm_ctx=self.context)

    shared, own = object(), object()
    stages = [types.SimpleNamespace(submod=object.__new__(Stage)) for _ in range(2)]
    for stage, context in zip(stages, (shared, own), strict=True):
        Stage.__init__(stage.submod, context)
    _refuse_shared_comm_ctx(stages)  # one context each: fine
    stages[1].submod.context = shared
    with pytest.raises(ValueError, match="does not support FSDP stages that share a comm"):
        _refuse_shared_comm_ctx(stages)
