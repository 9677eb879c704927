"""torch's multi-stage (runtime) schedules with 2.15's constructor controls, and a runtime that
executes 2.15's explicit wait actions.

Each class subclasses torch's own (``isinstance`` holds) and takes 2.15's signature: torch's
parameters, then ``max_active_stages=3``, ``unshard_lookahead="full"``, and keyword-only
``defer_reduce_grad_wait=False``, ``max_outstanding_sends=None``. Lowering adds
UNSHARD/RESHARD with the lookahead, REDUCE_GRAD with its WAIT_REDUCE_GRAD, torch's own
send/receive pass, then WAIT_SEND_F/WAIT_SEND_B under the send budget
(:mod:`tether.pipelining.lowering`).

At run time a send's work is kept until its WAIT_SEND action, not to the step's end: torch's
runtime keeps its sends in a list local to its loop, so tether runs sends and waits through the
runtime's own per-action function table (``_comp_type_to_function_map``, where
``register_custom_function`` puts user functions; it accepts none for these types). A WAIT_SEND_F
also releases the forward outputs it carried (:mod:`tether.pipelining.outputs`). REDUCE_GRAD starts
an FSDP stage's reduction and WAIT_REDUCE_GRAD waits for it (``tether.fsdp``'s
``finalize_backward(async_op=True)``); UNSHARD and RESHARD leave a stage unsharded across
``step(finalize_gradients=False)``.
"""

from __future__ import annotations

import csv
import inspect
from typing import Any

from tether.pipelining import _torch
from tether.pipelining.actions import (
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    WAIT_REDUCE_GRAD,
    WAIT_SEND_B,
    WAIT_SEND_F,
    I,
    _Action,
    from_torch,
    send_of,
)
from tether.pipelining.lowering import (
    add_reduce_grad,
    add_unshard_reshard,
    add_wait_send,
    add_wait_send_budget,
    check_max_active_stages,
    check_max_outstanding_sends,
    resolve_unshard_lookahead,
    validate_reduce_grad_waits,
    validate_send_waits,
)
from tether.pipelining.p2p import config, use_edge_groups
from tether.pipelining.stats import Tally
from tether.pipelining.step import Step

__all__ = [
    "ScheduleDualPipeV",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
]

_CONTROLS = (
    inspect.Parameter("max_active_stages", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=3),
    inspect.Parameter("unshard_lookahead", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="full"),
    inspect.Parameter("defer_reduce_grad_wait", inspect.Parameter.KEYWORD_ONLY, default=False),
    inspect.Parameter("max_outstanding_sends", inspect.Parameter.KEYWORD_ONLY, default=None),
)


class _Controls(Step):
    """2.15's controls on one of torch's runtime schedules (module text)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        torch_class = next(c for c in cls.__mro__ if c.__module__.startswith("torch."))
        torch_init = inspect.signature(vars(torch_class)["__init__"])
        params = [*torch_init.parameters.values(), *_CONTROLS]
        cls.__signature__ = inspect.Signature(params[1:])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = type(self).__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        controls = {p.name: values.pop(p.name) for p in _CONTROLS}
        stages = values["stages"]
        self._tether_max_active = check_max_active_stages(controls["max_active_stages"])
        self._tether_budget = check_max_outstanding_sends(controls["max_outstanding_sends"])
        self._tether_defer_reduce = bool(controls["defer_reduce_grad_wait"])
        self._tether_lookahead_arg = controls["unshard_lookahead"]
        self._tether_lookahead = resolve_unshard_lookahead(
            controls["unshard_lookahead"], stages[0].group_size, self._tether_max_active
        )
        if self._tether_defer_reduce:
            _refuse_shared_comm_ctx(stages)
        self._tether_recv = Tally()
        self._tether_outputs = Tally()
        self._tether_send = Tally()
        self._tether_sends: dict[_Action, tuple[list[Any], int]] = {}
        self._tether_split_backward: set[int] = set()  # stages whose backward is I then W
        for stage in stages:  # one count per rank, whatever its number of stages
            if hasattr(stage, "_tether_recv"):
                stage._tether_recv = self._tether_recv
                stage._tether_outputs = self._tether_outputs
        super().__init__(**values)
        self._tether_stages = {s.stage_index: s for s in stages}
        table = self._comp_type_to_function_map
        for kind in (SEND_F, SEND_B):
            table[kind] = self._tether_run_send
        for kind in (WAIT_SEND_F, WAIT_SEND_B):
            table[kind] = self._tether_run_wait_send
        table[UNSHARD] = self._tether_run_unshard
        table[RESHARD] = self._tether_run_reshard
        table[REDUCE_GRAD] = self._tether_run_reduce_grad
        table[WAIT_REDUCE_GRAD] = self._tether_run_wait_reduce_grad
        if config.pipeline_per_edge_p2p:
            use_edge_groups(stages, self.stage_index_to_group_rank)

    # -- lowering ---------------------------------------------------------------------------------
    def _prepare_schedule_with_comms(
        self, actions: dict[int, list[Any]], format: str = "compute_only"
    ) -> None:
        self._validate_and_set_stage_mapping(actions)
        mapping = dict(self.stage_index_to_group_rank)
        num_stages: int = self._num_stages

        def stage_to_rank(stage: int) -> int:
            return int(mapping[stage])

        plain = {r: [from_torch(a) for a in acts] for r, acts in actions.items()}
        if format == "compute_comms":
            if self._tether_lookahead_arg != "full":
                raise ValueError(
                    "unshard_lookahead applies when tether lowers a compute-only schedule; a "
                    "compute_comms schedule already places its UNSHARD actions"
                )
            given = {r: [a for a in acts if a is not None] for r, acts in plain.items()}
            if any(len(given[r]) != len(acts) for r, acts in plain.items()):
                raise AssertionError("Expected action to be not None, got NoneType")
            lowered = add_wait_send(given)  # a 2.13/2.14 CSV has none: wait at the step's end
        elif format == "compute_only":
            for rank, acts in plain.items():
                for i, action in enumerate(acts):
                    if action is not None and not action.is_compute_op:
                        raise ValueError(
                            f"Expected compute-only schedule but found communication action "
                            f"'{action}' at rank {rank}, position {i}. Communication actions "
                            "(e.g. SEND_F, RECV_F, etc.) should not be present when "
                            "format='compute_only'."
                        )
            per_rank = {
                rank: add_reduce_grad(
                    add_unshard_reshard(
                        acts,
                        self._tether_max_active,
                        unshard_lookahead=self._tether_lookahead[rank],
                    ),
                    self._n_microbatches,
                    self._tether_defer_reduce,
                )
                for rank, acts in plain.items()
            }
            # tether's actions pass for torch's in its passes (str-valued enum, equal tuples).
            comms = _torch.add_send_recv(
                per_rank, stage_to_rank=stage_to_rank, num_stages=num_stages
            )
            if self._defer_pp_recv:
                comms = _torch.defer_recv_ops(comms, stage_to_rank=stage_to_rank)
            lowered = add_wait_send(
                {
                    r: [a for x in acts if (a := from_torch(x)) is not None]
                    for r, acts in comms.items()
                }
            )
            if self._tether_budget is not None:
                lowered = add_wait_send_budget(
                    lowered, self._tether_budget, stage_to_rank, num_stages
                )
        else:
            raise NotImplementedError(f"{format=} is not implemented")
        validate_reduce_grad_waits(lowered)
        validate_send_waits(lowered, stage_to_rank, num_stages)
        self.pipeline_order_with_comms = lowered
        self._tether_split_backward = {
            a.stage_index
            for action in lowered[self.rank]
            for a in (action.sub_actions or ()) + (action,)
            if a.computation_type == I
        }

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        if format != "compute_comms":
            super()._load_csv(filename, format)
            return
        with open(filename, newline="") as csvfile:
            actions = {
                rank: [_Action.from_str(cell) for cell in row]
                for rank, row in enumerate(csv.reader(csvfile))
            }
        self._prepare_schedule_with_comms(actions, format=format)

    # -- run time ---------------------------------------------------------------------------------
    def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
        self._tether_sends.clear()  # a failed step's works: nothing waits for them any more
        self._tether_send = Tally()  # the stages reset the other counts (clear_runtime_states)
        out = super()._step_microbatches(*args, **kwargs)
        if self._tether_sends:
            raise RuntimeError(f"sends never waited: {sorted(map(str, self._tether_sends))}")
        return out

    def _tether_run_send(self, action: _Action, ctx: Any) -> None:
        stage = self._tether_stages[action.stage_index]
        mb = action.microbatch_index
        ops = (
            stage.get_fwd_send_ops(mb)
            if action.computation_type == SEND_F
            else stage.get_bwd_send_ops(mb)
        )
        nbytes = sum(op.tensor.nbytes for op in ops)
        self._tether_sends[action] = (_torch.batch_p2p(ops), nbytes)
        self._tether_send.add(nbytes)

    def _tether_run_wait_send(self, action: _Action, ctx: Any) -> None:
        send = send_of(action)
        if send not in self._tether_sends:
            raise RuntimeError(f"{action} waits for a send this step did not issue")
        works, nbytes = self._tether_sends.pop(send)
        _torch.wait_batch_p2p(works)
        self._tether_send.remove(nbytes)
        stage = self._tether_stages[action.stage_index]
        if (
            action.computation_type == WAIT_SEND_F
            and action.stage_index not in self._tether_split_backward
            and hasattr(stage, "release_fwd_send_outputs")
        ):
            stage.release_fwd_send_outputs(action.microbatch_index)

    # FSDP: torch's UNSHARD/RESHARD, except that a stage stays unsharded across a step with
    # finalize_gradients=False and into the next one.
    def _tether_run_unshard(self, action: _Action, ctx: Any) -> None:
        stage = self._tether_stages[action.stage_index]
        if not isinstance(stage.submod, _torch.FSDPModule):
            return
        index = action.stage_index
        unshard_ops = self.unshard_ops
        if index in self.unsharded_stages or index in unshard_ops:
            if self._tether_carried or self._tether_deferring:
                return
            raise AssertionError(f"Unsharding the same stage_idx={index} twice")
        for module in stage.submod.modules():
            if isinstance(module, _torch.FSDPModule):
                unshard_ops[index].append(module.unshard(async_op=True))

    def _tether_run_reshard(self, action: _Action, ctx: Any) -> None:
        stage = self._tether_stages[action.stage_index]
        if not isinstance(stage.submod, _torch.FSDPModule) or self._tether_deferring:
            return
        index = action.stage_index
        if index not in self.unsharded_stages:
            raise AssertionError(f"Resharding stage_idx={index} without unsharding")
        if index in self.unshard_ops:
            raise AssertionError(f"Resharding stage_idx={index} before finishing unshard")
        for module in stage.submod.modules():
            if isinstance(module, _torch.FSDPModule):
                module.reshard()
        self.unsharded_stages.remove(index)

    def _tether_run_reduce_grad(self, action: _Action, ctx: Any) -> None:
        stage = self._tether_stages[action.stage_index]
        if hasattr(stage, "start_gradient_reduction"):
            stage.start_gradient_reduction()
        else:  # torch's stage: reduce and scale now; its WAIT_REDUCE_GRAD has nothing to do
            stage.perform_reduce_grad(self._tether_grad_scale())

    def _tether_run_wait_reduce_grad(self, action: _Action, ctx: Any) -> None:
        stage = self._tether_stages[action.stage_index]
        if hasattr(stage, "wait_for_gradient_reduction"):
            stage.wait_for_gradient_reduction(self._tether_grad_scale())

    def _tether_grad_scale(self) -> int:
        return int(self._n_microbatches) if self.scale_grads else 1


def _refuse_shared_comm_ctx(stages: list[Any]) -> None:
    contexts = [
        id(stage.submod._get_fsdp_state()._comm_ctx)
        for stage in stages
        if isinstance(stage.submod, _torch.FSDPModule)
    ]
    if len(set(contexts)) < len(contexts):
        raise ValueError(
            "defer_reduce_grad_wait does not support FSDP stages that share a communication "
            "context. Do not call share_comm_ctx() for stages of a schedule with "
            "defer_reduce_grad_wait=True"
        )


def _runtime(torch_name: str) -> Any:
    return _torch.extend_schedule(torch_name, (_Controls,), __name__, "torch 2.15's controls")


ScheduleLoopedBFS = _runtime("ScheduleLoopedBFS")
ScheduleInterleaved1F1B = _runtime("ScheduleInterleaved1F1B")
ScheduleInterleavedZeroBubble = _runtime("ScheduleInterleavedZeroBubble")
ScheduleZBVZeroBubble = _runtime("ScheduleZBVZeroBubble")
ScheduleDualPipeV = _runtime("ScheduleDualPipeV")
