"""torch's ``PipelineStage`` with torch 2.15's stage mechanics: just-in-time receive buffers
(:mod:`tether.pipelining.recv`), forward outputs released after their send
(:mod:`tether.pipelining.outputs`), and FSDP gradient reduction through manual backward
finalization: ``forward_one_chunk`` turns it on for an FSDP submodule that has it
(``tether.fsdp.fully_shard``), ``start_gradient_reduction`` starts the reduction
(``finalize_backward(async_op=True)``) and ``wait_for_gradient_reduction`` waits for it and scales,
so that a schedule can overlap the reduction with later compute (``WAIT_REDUCE_GRAD``).
"""

from __future__ import annotations

from typing import Any

import torch

from tether.pipelining import _torch
from tether.pipelining.outputs import ReleasedOutputs, releasable
from tether.pipelining.p2p import on_edges
from tether.pipelining.recv import RecvCache, _JitRecvInfo, make_jit
from tether.pipelining.stats import Tally

__all__ = ["PipelineStage"]


class PipelineStage(_torch.TorchPipelineStage):
    """torch's ``PipelineStage``, same constructor, with 2.15's stage mechanics (module text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tether_recv = Tally()
        """Receive buffers held; a tether schedule shares one object among a rank's stages."""
        self._tether_cache = RecvCache(self.device)
        self._tether_outputs = Tally()
        """Microbatches whose forward outputs this rank's stages hold for backward (shared too)."""
        self._tether_held: dict[int, int] = {}  # microbatch -> bytes of its held outputs
        self._tether_reduction: Any = None  # the GradientReductionHandle being waited for
        self._tether_edges: dict[tuple[int, int], Any] | None = None
        """Per-edge P2P groups, set by a schedule built with ``pipeline_per_edge_p2p``."""
        self._tether_finalize = True
        """Set by the schedule's ``step(finalize_gradients=)``: False leaves an FSDP submodule
        unsharded and its gradients unreduced and unscaled until a step that finalizes."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_forward_infra(*args, **kwargs)
        make_jit(self.args_recv_info, self._tether_recv, self._tether_cache)
        return out

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_backward_infra(*args, **kwargs)
        make_jit(self.grad_recv_info, self._tether_recv, self._tether_cache)
        return out

    def _get_recv_ops(self, recv_infos: tuple[Any, ...], *args: Any) -> list[Any]:
        allocated = []
        try:
            for info in recv_infos:
                if isinstance(info, _JitRecvInfo) and info.tensor_meta is not None:
                    info.allocate_buffer()
                    allocated.append(info)
            ops: list[Any] = self._on_edges(super()._get_recv_ops(recv_infos, *args))
        except BaseException:
            for info in allocated:  # never posted: nothing can write into them
                info.take_buffer(missing_ok=True)
            raise
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        return self._on_edges(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        return self._on_edges(super().get_bwd_send_ops(bwd_chunk_id))

    def _on_edges(self, ops: list[Any]) -> list[Any]:
        return ops if self._tether_edges is None else on_edges(ops, self._tether_edges)

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> Any:
        activations = super()._retrieve_recv_activations(fwd_chunk_id)
        _take(self.args_recv_info[fwd_chunk_id])
        return activations

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        _take(self.grad_recv_info[bwd_chunk_id])
        return grads

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        # torch zeroes the preallocated buffer of a None gradient; here there is none yet.
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs, strict=False):
            if grad is None and isinstance(info, _JitRecvInfo) and info.tensor_meta is not None:
                info.allocate_buffer().zero_()
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # -- forward outputs --------------------------------------------------------------------------
    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        if self.has_backward and _manual_fsdp(self.submod):
            # 2.15 does this here, so a schedule's REDUCE_GRAD can finalize; subclasses that
            # override forward_one_chunk must keep calling it.
            self.submod.set_manual_backward_finalization(True)
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.has_backward and not self.is_last:
            outputs, _ = self.fwd_cache[fwd_chunk_id]
            nbytes = sum(t.nbytes for t in outputs if isinstance(t, torch.Tensor))
            self._tether_held[fwd_chunk_id] = nbytes
            self._tether_outputs.add(nbytes)
        return output

    def release_fwd_send_outputs(self, mb_index: int) -> bool:
        """Drop microbatch ``mb_index``'s forward outputs, keeping their autograd edges; called
        once the send that carries them has been waited. False where 2.15's rules keep them
        (:mod:`tether.pipelining.outputs`) or they are gone already."""
        entry = self.fwd_cache.get(mb_index)
        if entry is None or mb_index not in self._tether_held or not releasable(self, entry[0]):
            return False
        self.fwd_cache[mb_index] = (ReleasedOutputs(entry[0]), entry[1])
        self._tether_outputs.remove(self._tether_held.pop(mb_index))
        return True

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        if bwd_chunk_id in self._tether_held:  # torch pops the outputs from the cache now
            self._tether_outputs.remove(self._tether_held.pop(bwd_chunk_id))
        super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        released = bwd_kwargs["stage_output"]
        if not isinstance(released, ReleasedOutputs):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":  # releasable() refuses DDP, dw_builder; the schedule I/W
            raise AssertionError(f"released outputs reached a {backward_type!r} backward")
        if isinstance(self.submod, _torch.FSDPModule):  # what torch does for FSDP, then backward
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(False)
        grads = released.backward(bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    # -- FSDP gradient reduction ------------------------------------------------------------------
    def start_gradient_reduction(self) -> None:
        """Start reducing this stage's FSDP gradients (the schedule's REDUCE_GRAD)."""
        if not self.has_backward or not isinstance(self.submod, _torch.FSDPModule):
            return
        if not self._tether_finalize:
            return  # a step(finalize_gradients=False): accumulate, keep the parameters
        if not _manual_fsdp(self.submod):  # torch's own fully_shard: reduce now, synchronously
            super().perform_reduce_grad(1)
            return
        if self._tether_reduction is not None:
            raise RuntimeError(
                f"stage {self.stage_index}: the previous gradient reduction must be waited on "
                "before reducing again"
            )
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_reshard_after_backward(True)
        self._tether_reduction = self.submod.finalize_backward(async_op=True)

    def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
        """Wait for the reduction started by :meth:`start_gradient_reduction`, leave manual
        finalization, and scale the gradients (the schedule's WAIT_REDUCE_GRAD)."""
        if not self._tether_finalize and isinstance(self.submod, _torch.FSDPModule):
            return
        handle, self._tether_reduction = self._tether_reduction, None
        if handle is not None:
            handle.wait()
            self.submod.set_manual_backward_finalization(False)
        self.scale_grads(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self.start_gradient_reduction()
        self.wait_for_gradient_reduction(grad_scale_factor)

    def clear_runtime_states(self) -> None:
        handle, self._tether_reduction = self._tether_reduction, None
        if handle is not None:  # a failed step's reduction: finish it before anything reuses it
            handle.wait()
            self.submod.set_manual_backward_finalization(False)
        for nbytes in self._tether_held.values():
            self._tether_outputs.remove(nbytes)
        self._tether_held.clear()
        self._tether_outputs.reset()  # a step starts: its peaks count from here
        self._tether_recv.reset()
        super().clear_runtime_states()


def _manual_fsdp(submod: Any) -> bool:
    """An FSDP module with 2.15's manual finalization (tether.fsdp's, or torch 2.15's)."""
    return isinstance(submod, _torch.FSDPModule) and hasattr(
        type(submod), "set_manual_backward_finalization"
    )


def _take(infos: tuple[Any, ...]) -> None:
    for info in infos:
        if isinstance(info, _JitRecvInfo):
            info.take_buffer(missing_ok=True)
