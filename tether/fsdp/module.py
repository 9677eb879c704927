"""``fully_shard`` and ``FSDPModule`` with torch 2.15's controls, built on torch 2.13/2.14's FSDP2.

``fully_shard`` is torch's, called with tether's param group in place of torch's for the duration
of the call; afterwards the module's state and class are swapped for tether's subclasses, so the
module is still a ``torch.distributed.fsdp.FSDPModule`` and everything torch's FSDP2 does (the
all-gather, streams, prefetching, state dicts) stays torch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, Literal, cast, overload

import torch
from torch import nn

from tether.fsdp import _torch, reduce
from tether.fsdp.group import TetherParamGroup
from tether.fsdp.params import TetherFSDPParam
from tether.fsdp.policy import MixedPrecisionPolicy
from tether.fsdp.state import GradientReductionHandle, TetherFSDPState

__all__ = ["FSDPModule", "fully_shard"]

_torch_fully_shard = _torch.fully_shard_module.fully_shard
_OffloadPolicy = _torch.fully_shard_module.OffloadPolicy
_swap_lock = threading.Lock()
# Frozen dataclasses, shared as torch shares its own defaults.
_DEFAULT_POLICY = MixedPrecisionPolicy()
_DEFAULT_OFFLOAD = _OffloadPolicy()


class FSDPModule(_torch.fully_shard_module.FSDPModule):
    """torch's ``FSDPModule`` plus torch 2.15's manual finalization and storage controls."""

    # [FSDP<Orig>, tether FSDPModule, torch FSDPModule, Orig, ...]: the original class is 3rd.
    _orig_cls_mro_index: int = 3

    def _tether_state(self) -> TetherFSDPState:
        state = self._get_fsdp_state()
        assert type(state) is TetherFSDPState, state
        return state

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether ``finalize_backward()`` (not the end of autograd's backward) reduces this
        root's gradients and ends the accumulation step. Root only; latched at the first
        pre-backward until that step is finalized."""
        state = self._tether_state()
        if state._is_root is False:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root FSDP module"
            )
        if enabled == state.manual_requested:
            return  # pipeline stages set it at every forward
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode during backward"
            )
        if state.manual_active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts"
            )
        state.manual_requested = enabled

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Reduce the gradients of every group whose sync is on, reshard the rest, and end the
        accumulation step (at once, or at the returned handle's ``wait()`` if ``async_op``).
        If several backward passes precede one finalization, disable gradient sync for them and
        re-enable it before finalizing."""
        return self._tether_state().finalize_backward(async_op)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep unsharded parameters' storage allocated across reshards, so their data pointers
        stay the same from one step to the next (CUDA graph capture); costs that memory."""
        modules = list(self.modules()) if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                for group in module._tether_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.keep_unsharded_storage = keep

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Gradients of parameters with a grad_dtype of their own keep that dtype across
        # model.to()/.half(): torch's _apply would convert them with the parameters.
        # detach(): an alias torch's in-place conversion (param.grad.data = ...) leaves alone.
        kept = [
            (fsdp_param, fsdp_param.sharded_param.grad.detach())
            for group in self._get_fsdp_state()._fsdp_param_groups
            for fsdp_param in group.fsdp_params
            if isinstance(fsdp_param, TetherFSDPParam)
            and fsdp_param._grad_override
            and fsdp_param.sharded_param.grad is not None
        ]
        result = super()._apply(*args, **kwargs)
        for fsdp_param, grad in kept:
            param = fsdp_param.sharded_param
            param.grad = grad.to(device=param.device)
        return cast("FSDPModule | list[FSDPModule]", result)


_fsdp_classes: dict[type, type] = {}


def _tether_class(torch_class: type) -> type:
    """``FSDP<Orig>`` with tether's ``FSDPModule`` in place of torch's, one per class."""
    original = _torch.original_class(torch_class)
    found = _fsdp_classes.get(original)
    if found is None:
        namespace = {"__deepcopy__": torch_class.__dict__["__deepcopy__"]}
        found = type(torch_class.__name__, (FSDPModule, original), namespace)
        _fsdp_classes[original] = found
    return found


@contextlib.contextmanager
def _tether_groups() -> Iterator[None]:
    """torch's ``_init_param_group`` builds tether's group while this is open (it imports the
    class from its module at each call). The name is process-wide: a torch ``fully_shard`` run
    by another thread at the same moment would build tether's group too (sharding is set-up
    code, run by one thread in practice)."""
    module = _torch.fsdp_param_group
    with _swap_lock:
        reduce.install()
        torch_group = module.FSDPParamGroup
        module.FSDPParamGroup = TetherParamGroup
        try:
            yield
        finally:
            module.FSDPParamGroup = torch_group


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Any = None,
    mp_policy: MixedPrecisionPolicy = _DEFAULT_POLICY,
    offload_policy: Any = _DEFAULT_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> FSDPModule | list[FSDPModule]:
    """torch's ``fully_shard`` (same arguments and defaults) with torch 2.15's
    ``param_dtype_override_fn``, per-parameter ``grad_dtype`` and manual finalization."""
    with _tether_groups():  # (this torch was checked when tether.fsdp was imported)
        result = _torch_fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=shard_placement_fn,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
            dp_mesh_dims=dp_mesh_dims,
        )
    modules = result if isinstance(result, list) else [result]
    state = _torch_fully_shard.state(modules[0])
    state.__class__ = TetherFSDPState
    state.adopt()
    if isinstance(mp_policy, MixedPrecisionPolicy):  # resolved per parameter; 2.15 keeps none
        state._mp_policy = dataclasses.replace(mp_policy, param_dtype_override_fn=None)
    for sharded in modules:
        sharded.__class__ = _tether_class(type(sharded))
    return cast("FSDPModule | list[FSDPModule]", result)


# torch's fully_shard.state(module) (its contract's state lookup), for code that calls it.
fully_shard.state = _torch_fully_shard.state  # type: ignore[attr-defined]
