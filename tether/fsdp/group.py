"""torch 2.15's ``FSDPParamGroup`` behaviour on 2.13/2.14: per-parameter policies, mixed dtypes,
and reductions deferred to ``finalize_backward`` under manual finalization."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from tether.fsdp import _torch
from tether.fsdp.params import TetherFSDPParam, grad_dtype_override
from tether.fsdp.policy import MixedPrecisionPolicy, resolve_for_param
from tether.fsdp.reduce import refuse_offload

__all__ = ["TetherParamGroup"]


class TetherParamGroup(_torch.fsdp_param_group.FSDPParamGroup):
    """Built by torch's ``fully_shard`` in place of its own group (``tether.fsdp.fully_shard``
    names this class for the duration of the call)."""

    fsdp_params: list[TetherFSDPParam]

    def __init__(
        self,
        params: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: Any,
        post_forward_mesh_info: Any,
        device: Any,
        shard_placement_fn: Any,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: Any,
    ) -> None:
        # Resolved here, where the parameters are still the user's: the override function and
        # the grad_dtype capture see them as 2.15 shows them (before sharding replaces them).
        policies = [resolve_for_param(mp_policy, param) for param in params]
        overrides = [grad_dtype_override(param) for param in params]
        if isinstance(mp_policy, MixedPrecisionPolicy):
            mp_policy = dataclasses.replace(mp_policy, param_dtype_override_fn=None)
        super().__init__(
            params,
            modules,
            mesh_info,
            post_forward_mesh_info,
            device,
            shard_placement_fn,
            mp_policy,
            offload_policy,
        )
        for fsdp_param, policy, (override, grad_dtype) in zip(
            self.fsdp_params, policies, overrides, strict=True
        ):
            fsdp_param.__class__ = TetherFSDPParam
            fsdp_param.adopt(policy, override, grad_dtype)
        self.manual_finalization = False  # latched by the root for one accumulation step
        self.finalizing = False

    def lazy_init(self) -> None:
        super().lazy_init()
        if any(p.offload_to_cpu for p in self.fsdp_params) and (
            len({p.sharded_grad_dtype for p in self.fsdp_params}) > 1
            or len({p.unsharded_grad_dtype for p in self.fsdp_params}) > 1
        ):
            raise refuse_offload(f"group '{self._module_fqn}'")

    def _init_mp_dtypes(self) -> None:
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtype_attrs(fsdp_param.mp_policy)
        trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        orig_dtypes = {p.orig_dtype for p in trainable}
        if len(orig_dtypes) > 1:
            raise AssertionError(
                f"FSDP expects uniform original parameter dtype but got {orig_dtypes}"
            )
        self._orig_dtype = next(iter(orig_dtypes)) if trainable else None
        # One policy per group, so one reduce dtype; None: the gradients' promoted dtype.
        self._reduce_dtype = self.mp_policy.reduce_dtype

    def post_backward(self, *unused: Any) -> None:
        if self.reduce_grads and self.reduce_scatter_unused_params:
            self._validate_unused_param_grad_dtypes()
        if self.manual_finalization and self.reduce_grads and not self.finalizing:
            # Manual finalization: autograd's hook only reshards; finalize_backward reduces.
            self._training_state = _torch.TrainingState.POST_BACKWARD
            if self.reshard_after_backward:
                self.reshard()
            # No upcast: finalize_backward reduces these as they are (accumulating over several
            # backwards takes sync off, as 2.15's docs require, and torch's branch upcasts).
            return
        super().post_backward(*unused)

    def reduce_now(self) -> None:
        """The reduction a manual ``finalize_backward`` runs for this group."""
        self.finalizing = True
        try:
            super().post_backward()
        finally:
            self.finalizing = False

    def _validate_unused_param_grad_dtypes(self) -> None:
        for fsdp_param in self.fsdp_params:
            if fsdp_param.sharded_param.requires_grad and fsdp_param.unsharded_grad_dtype is None:
                raise ValueError(
                    "Reducing unused parameters with grad_dtype=None requires an explicit "
                    "MixedPrecisionPolicy.reduce_dtype, the dtype of their zero gradients "
                    f"(parameter {fsdp_param._param_fqn or fsdp_param._module_info.param_name!r})"
                )
