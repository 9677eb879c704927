"""torch's ``PipelineStage`` with just-in-time receive buffers (:mod:`tether.pipelining.recv`)."""

from __future__ import annotations

from typing import Any

from tether.pipelining import _torch
from tether.pipelining.recv import _JitRecvInfo, make_jit
from tether.pipelining.stats import Tally

__all__ = ["PipelineStage"]


class PipelineStage(_torch.TorchPipelineStage):
    """torch's ``PipelineStage``, same constructor; its receive buffers are allocated right
    before each receive and handed over to the compute that consumes them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tether_recv = Tally()
        """Receive buffers held; a tether schedule shares one object among a rank's stages."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_forward_infra(*args, **kwargs)
        make_jit(self.args_recv_info, self._tether_recv)
        return out

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_backward_infra(*args, **kwargs)
        make_jit(self.grad_recv_info, self._tether_recv)
        return out

    def _get_recv_ops(self, recv_infos: tuple[Any, ...], *args: Any) -> list[Any]:
        allocated = []
        try:
            for info in recv_infos:
                if isinstance(info, _JitRecvInfo) and info.tensor_meta is not None:
                    info.allocate_buffer(self.device)
                    allocated.append(info)
            ops: list[Any] = super()._get_recv_ops(recv_infos, *args)
        except BaseException:
            for info in allocated:  # never posted: nothing can write into them
                info.take_buffer(missing_ok=True)
            raise
        return ops

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
                info.allocate_buffer(self.device).zero_()
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def _take(infos: tuple[Any, ...]) -> None:
    for info in infos:
        if isinstance(info, _JitRecvInfo):
            info.take_buffer(missing_ok=True)
