"""The single-stage schedules, ``ScheduleGPipe`` and ``Schedule1F1B``, with 2.15's ``step()``
(:mod:`tether.pipelining.step`) and per-edge P2P groups.

``Schedule1F1B`` runs tether's loop: torch 2.13/2.14's order of receives, computes, sends and
waits, unchanged (a forward send is waited after the next forward in the warm-up, or together with
the first backward's receive), plus what 2.15 adds at those waits: the stage releases the outputs
the send carried (:mod:`tether.pipelining.outputs`), so a first stage holds two microbatches'
outputs instead of one per warm-up microbatch. Its batches are issued per group, so that a send
and a receive of opposite directions can sit on two edge groups.

``ScheduleGPipe`` keeps torch's loop: it waits its forward sends after all forwards (where 2.15
releases them), just before the backwards consume the outputs anyway, so releasing there would
not lower its peak; its batches hold one direction each, which per-edge groups take as they are.
"""

from __future__ import annotations

from typing import Any

from tether.pipelining import _torch
from tether.pipelining._torch import Schedule
from tether.pipelining.p2p import batch_by_group, config, use_edge_groups
from tether.pipelining.step import Step

__all__ = ["Schedule1F1B", "ScheduleGPipe"]


class _SingleStage(Step):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if config.pipeline_per_edge_p2p:
            stage: Any = self._stage
            use_edge_groups([stage], {i: i for i in range(stage.num_stages)})


class _Loop1F1B(Schedule):
    """tether's 1F1B loop (module text), over torch's ``PipelineScheduleSingle``."""

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage, n = self._stage, self._n_microbatches
        warmup = min(n, self._num_stages - stage.stage_index)

        def forward(mb: int) -> None:
            output = stage.forward_one_chunk(
                mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs
            )
            self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)

        def backward(mb: int) -> None:
            loss = self._maybe_get_loss(stage, mb)
            stage.backward_one_chunk(mb, loss=loss, last_backward=mb == n - 1)

        def sent(mb: int) -> None:  # the send that carried mb's outputs has been waited
            if hasattr(stage, "release_fwd_send_outputs"):
                stage.release_fwd_send_outputs(mb)

        def run(ops: list[Any]) -> None:
            _torch.wait_batch_p2p(batch_by_group(ops))

        # Warm-up: each forward's send is waited after the next forward; the last one's goes
        # out with the first backward's receive.
        in_flight: list[Any] = []
        for mb in range(warmup):
            run(stage.get_fwd_recv_ops(mb))
            forward(mb)
            _torch.wait_batch_p2p(in_flight)
            if in_flight:
                sent(mb - 1)
            fwd_sends = stage.get_fwd_send_ops(mb)
            in_flight = batch_by_group(fwd_sends) if mb != warmup - 1 else []
        # Steady state: one backward, one forward, each receive batched with the other's send.
        fwd_mb, bwd_mb = warmup, 0
        while True:
            run(fwd_sends + stage.get_bwd_recv_ops(bwd_mb))
            if fwd_sends:
                sent(fwd_mb - 1)
            backward(bwd_mb)
            bwd_sends = stage.get_bwd_send_ops(bwd_mb)
            bwd_mb += 1
            if fwd_mb == n:
                break
            run(bwd_sends + stage.get_fwd_recv_ops(fwd_mb))
            forward(fwd_mb)
            fwd_sends = stage.get_fwd_send_ops(fwd_mb)
            fwd_mb += 1
        # Cool-down: the remaining backwards, each send waited after the next backward.
        in_flight = batch_by_group(bwd_sends)
        while bwd_mb < n:
            run(stage.get_bwd_recv_ops(bwd_mb))
            backward(bwd_mb)
            _torch.wait_batch_p2p(in_flight)
            in_flight = batch_by_group(stage.get_bwd_send_ops(bwd_mb))
            bwd_mb += 1
        _torch.wait_batch_p2p(in_flight)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)


def _schedule(torch_name: str, *mixins: type) -> Any:
    what = "torch 2.15's ``step()`` keywords, per-edge groups and (1F1B) output release"
    return _torch.extend_schedule(torch_name, (_SingleStage, *mixins), __name__, what)


Schedule1F1B = _schedule("Schedule1F1B", _Loop1F1B)
ScheduleGPipe = _schedule("ScheduleGPipe")
