"""torch 2.15's manual backward finalization on 2.13/2.14: the root's ``FSDPState``.

With ``set_manual_backward_finalization(True)`` on the root, the mode latches at the first
pre-backward of an accumulation step. While latched, autograd's end-of-backward callback neither
reduces nor finalizes (``set_is_last_backward`` is ignored) and each group's post-backward hook
only reshards; ``finalize_backward()`` then reduces every group whose gradient sync is on (in
reverse order), reshards the others, and, at once or at ``GradientReductionHandle.wait()``, waits
for the reductions, finalizes the groups and releases the latch.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.fsdp import _torch
from tether.fsdp.group import TetherParamGroup

__all__ = ["GradientReductionHandle", "TetherFSDPState"]


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` makes the reduced gradients
    ready for the optimizer and ends the accumulation step."""

    def __init__(self, root: TetherFSDPState | None) -> None:
        self._root = root  # None: an inert handle (finalize_backward before the first forward)
        self._invalidated = False

    def wait(self) -> None:
        if self._invalidated:
            raise RuntimeError(
                "This gradient reduction handle was invalidated by reset_iter_state(); the "
                "gradients it was reducing are lost (zero_grad() and start the accumulation step "
                "again)"
            )
        if self._root is not None:
            self._root.end_backward_iteration(self)  # raises before the handle is spent: retry
        self._root = None

    def _invalidate(self) -> None:
        self._invalidated = True
        self._root = None


class TetherFSDPState(_torch.fsdp_state.FSDPState):
    """torch's ``FSDPState`` with manual finalization; made by class swap in ``fully_shard``."""

    manual_requested: bool
    manual_active: bool
    pending_reduction: GradientReductionHandle | None

    def adopt(self) -> None:
        self.manual_requested = False
        self.manual_active = False
        self.pending_reduction = None

    # -- lazy init: the root learns its states ---------------------------------------------------
    def _lazy_init(self) -> None:
        if self._is_root is None:
            try:
                self._validate_tree()  # before torch's lazy init commits: a retry checks again
            except (TypeError, RuntimeError):
                # torch's pre-forward marked this state FORWARD first, and would skip the root's
                # pre-forward (and so this check) on the next call.
                self._training_state = _torch.TrainingState.IDLE
                raise
        first = self._is_root is None
        super()._lazy_init()
        if not (first and self._is_root):
            return
        self._state_ctx.tether_root = self
        # Roots of share_comm_ctx (pipeline stages) see each other's latches through it.
        roots = getattr(self._comm_ctx, "tether_roots", None)
        if roots is None:
            roots = self._comm_ctx.tether_roots = []
        roots.append(self)

    def _root_pre_forward(self, module: Any, args: Any, kwargs: Any) -> Any:
        # 2.15 refuses a forward while a gradient reduction of this root, or of one sharing its
        # communication context, is not waited: its buffers are still in use. torch's pre-forward
        # hook is bound before the class swap, so the check sits in what that hook calls.
        if getattr(self._comm_ctx, "tether_reduction", None) is not None:
            self._training_state = _torch.TrainingState.IDLE  # as before this forward
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        return super()._root_pre_forward(module, args, kwargs)

    def _validate_tree(self) -> None:
        """What the root's lazy init will find below it: tether's states only, and no request
        for manual finalization but the root's."""
        for module in self._modules[0].modules():
            state = self._get_state_for_module(module)
            if state is None or state is self:
                continue
            if type(state) is not TetherFSDPState:
                raise TypeError(
                    "tether.fsdp: every fully_shard of a model must be tether.fsdp.fully_shard; "
                    f"{type(module).__name__} was sharded by torch's"
                )
            if state.manual_requested:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root FSDP module"
                )

    def _root(self) -> TetherFSDPState | None:
        return getattr(self._state_ctx, "tether_root", None)

    def _groups(self) -> list[TetherParamGroup]:
        return [g for s in self._state_ctx.all_states for g in s._fsdp_param_groups]

    def _latch(self, active: bool) -> None:
        self.manual_active = active
        for group in self._groups():
            group.manual_finalization = active

    # -- backward ------------------------------------------------------------------------------
    def _register_root_post_backward_final_callback(self) -> None:
        root = self._root()
        if root is not None and root.manual_requested and not root.manual_active:
            root._latch(True)  # latched at the first pre-backward of the accumulation step
        super()._register_root_post_backward_final_callback()

    def _root_post_backward_final_callback(self) -> None:
        root = self._root()
        if root is None or not root.manual_active:
            super()._root_post_backward_final_callback()
            return
        with torch.profiler.record_function("FSDP::root_post_backward_callback"):
            context = self._state_ctx
            context.iter_forward_root = None
            for state in context.all_states:
                state._modules_to_run_forward.clear()
                for group in reversed(state._fsdp_param_groups):
                    if group._training_state != _torch.TrainingState.POST_BACKWARD:
                        group.post_backward()  # unused in this backward: reshards, defers
                    group._training_state = _torch.TrainingState.IDLE
                state._training_state = _torch.TrainingState.IDLE
            context.post_backward_final_callback_queued = False

    # -- finalize_backward ---------------------------------------------------------------------
    def finalize_backward(self, async_op: bool) -> GradientReductionHandle | None:
        if self._is_root is None:  # before the first forward: nothing to finalize
            return GradientReductionHandle(None) if async_op else None
        self._validate_finalize(async_op)
        for state in reversed(self._state_ctx.all_states):
            for group in reversed(state._fsdp_param_groups):
                if group.reduce_grads:
                    group.reduce_now()
                elif group.reshard_after_backward:
                    group.reshard()
        handle = GradientReductionHandle(self)
        self.pending_reduction = handle
        self._comm_ctx.tether_reduction = handle
        if async_op:
            return handle
        handle.wait()
        return None

    def _validate_finalize(self, async_op: bool) -> None:
        if self.pending_reduction is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward again"
            )
        if getattr(self._comm_ctx, "tether_reduction", None) is not None:
            raise RuntimeError(
                "Another gradient reduction sharing this communication context must be waited on "
                "before finalizing backward"
            )
        if not self._is_root:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        if not self.manual_requested:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if self._state_ctx.post_backward_final_callback_queued:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        # 2.15's order: a partial output anywhere first, then a group that would not all-reduce;
        # the root's group is named "<root>".
        hsdp = [group for group in self._groups() if group._is_hsdp]
        for group in hsdp:
            if group._partial_reduce_output is not None:
                raise RuntimeError(
                    "FSDP manual backward finalization does not support partial gradient "
                    f"reductions for parameter group {group._module_fqn or '<root>'!r}. Use "
                    "automatic backward finalization for this configuration"
                )
        for group in hsdp:
            if group.reduce_grads and not group.all_reduce_grads:
                raise RuntimeError(
                    "FSDP manual backward finalization requires all-reduce for parameter group "
                    f"{group._module_fqn or '<root>'!r}. Call set_requires_all_reduce(True) before "
                    "finalization"
                )
        if async_op and any(s is not self and s.manual_active for s in self._sharing_roots()):
            raise RuntimeError(
                "Asynchronous gradient finalization cannot overlap work from another FSDP root "
                "sharing the communication context"
            )

    def _sharing_roots(self) -> list[TetherFSDPState]:
        return list(getattr(self._comm_ctx, "tether_roots", [self]))

    def end_backward_iteration(self, handle: GradientReductionHandle) -> None:
        """Wait for the reductions, finalize every group, release the latch."""
        with torch.profiler.record_function("FSDP::finalize_backward_wait"):
            for group in self._groups():
                group.finalize_backward()
                group._training_state = _torch.TrainingState.IDLE
            stream = self._device_handle.current_stream()
            for reduce_state in self._comm_ctx.reduce_scatter_states:
                if reduce_state.event is not None:
                    stream.wait_event(reduce_state.event)
            self._comm_ctx.reduce_scatter_states.clear()
            self._comm_ctx.post_forward_order.clear()
        self._clear(handle)

    def _clear(self, handle: GradientReductionHandle | None) -> None:
        if self.pending_reduction is handle:
            self.pending_reduction = None
        if getattr(self._comm_ctx, "tether_reduction", None) is handle:
            self._comm_ctx.tether_reduction = None
        self._latch(False)

    def _reset_iter_state(self) -> None:
        super()._reset_iter_state()
        if self.pending_reduction is not None:
            self.pending_reduction._invalidate()
            self._clear(self.pending_reduction)
        elif self._is_root:
            self._latch(False)
