"""Per-parameter compute and gradient dtypes: torch 2.15's ``FSDPParam`` behaviour on 2.13/2.14.

:class:`TetherFSDPParam` is torch's ``FSDPParam`` with four changes, made only for parameters of
modules sharded by :func:`tether.fsdp.fully_shard` (torch's own groups are untouched):

- its ``mp_policy`` is the parameter's own (``param_dtype_override_fn`` resolved in
  ``fully_shard``);
- a ``grad_dtype`` the user set on the parameter before ``fully_shard`` is kept on the sharded
  parameter, across ``model.to()`` and ``load_state_dict(assign=True)``;
- gradients accumulate straight into the unsharded parameter's ``.grad`` at
  :attr:`~TetherFSDPParam.unsharded_grad_dtype`, so there is no separate accumulation buffer and
  no bf16 accumulation of an fp32 ``grad_dtype``; ``unsharded_accumulated_grad`` is kept as an
  alias of that ``.grad``, as in 2.15. Where that dtype is wider than the compute dtype the upcast
  is deferred, as 2.15 does: a backward's gradient lands in the compute dtype, the reduce-scatter's
  copy-in casts it, and only a backward that does not reduce (gradient accumulation) upcasts it
  in place for the next one to add to;
- with ``set_keep_unsharded_storage(True)`` resharding keeps the unsharded storage allocated, so
  its data pointers stay put (what CUDA graph capture needs).
"""

from __future__ import annotations

import torch
from torch import nn

from tether.fsdp import _torch
from tether.fsdp.policy import TorchPolicy

__all__ = [
    "TetherFSDPParam",
    "grad_dtype_override",
    "reduce_dtype_none_follows_grad_dtype",
    "reduce_dtype_none_follows_grad_dtype_enabled",
]

_follow_grad_dtype = False


def reduce_dtype_none_follows_grad_dtype(enabled: bool = True) -> None:
    """Opt in to torch 2.15's ``reduce_dtype=None`` numerics on torch 2.13/2.14 (process-wide).

    torch 2.15 changed what ``MixedPrecisionPolicy(reduce_dtype=None)`` means without a warning:
    gradients used to be reduced in ``param_dtype`` when it was set; they now follow the
    parameter's ``grad_dtype`` (its original dtype when unset), e.g. fp32 for fp32 parameters
    computed in bf16. Set ``reduce_dtype`` explicitly to get the same numerics on every torch.
    A parameter whose ``grad_dtype`` was set explicitly follows it either way. Read when a
    module's unsharded parameters are first made (its first forward or ``unshard()``).
    """
    global _follow_grad_dtype
    _follow_grad_dtype = bool(enabled)


def reduce_dtype_none_follows_grad_dtype_enabled() -> bool:
    return _follow_grad_dtype


def grad_dtype_override(param: nn.Parameter) -> tuple[bool, torch.dtype | None]:
    """Whether ``param`` has a ``grad_dtype`` of its own, and which (``None``: any dtype).

    torch 2.13/2.14 have no ``Tensor._has_grad_dtype_override``, so an override is a
    ``grad_dtype`` other than the parameter's dtype: one set explicitly *equal* to its dtype reads
    as unset (it then follows dtype conversions, as an unset one does in 2.15)."""
    dtype = param.grad_dtype
    return dtype != param.dtype, dtype


class TetherFSDPParam(_torch.fsdp_param.FSDPParam):
    """torch's ``FSDPParam`` with torch 2.15's per-parameter dtypes; made by class swap."""

    _grad_override: bool
    _grad_dtype: torch.dtype | None
    _follow: bool | None  # reduce_dtype_none_follows_grad_dtype, fixed at the first unshard
    keep_unsharded_storage: bool

    def adopt(self, policy: TorchPolicy, override: bool, grad_dtype: torch.dtype | None) -> None:
        """Take this parameter's resolved policy and the ``grad_dtype`` captured from it."""
        self.__dict__.pop("unsharded_accumulated_grad", None)  # now the property below
        self.mp_policy = policy
        self._grad_override = override
        self._grad_dtype = grad_dtype
        self._follow = None
        self.keep_unsharded_storage = False
        self._apply_grad_dtype()

    def _read_grad_dtype(self) -> None:
        """Take the sharded parameter's ``grad_dtype`` as this parameter's policy: one set after
        ``fully_shard`` but before lazy init counts, as in 2.15."""
        self._grad_override, self._grad_dtype = grad_dtype_override(self.sharded_param)

    def _apply_grad_dtype(self) -> None:
        if not self._grad_override:
            return
        param = self.sharded_param
        grad = param.grad
        if grad is not None and self._grad_dtype is not None and grad.dtype != self._grad_dtype:
            # model.to() cast the gradient too; FSDPModule._apply puts the kept one back.
            param.grad = None
        param.grad_dtype = self._grad_dtype

    # -- dtypes --------------------------------------------------------------------------------
    def init_dtype_attrs(self, mp_policy: TorchPolicy) -> None:
        super().init_dtype_attrs(self.mp_policy)  # this parameter's policy, not the group's

    @property
    def unsharded_grad_dtype(self) -> torch.dtype | None:
        """The dtype gradients accumulate in on the unsharded parameter (2.15's rule):
        ``reduce_dtype`` if set, else the parameter's own ``grad_dtype`` if it has one (``None``:
        any), else its original dtype; before 2.15 the last is the compute dtype unless
        :func:`reduce_dtype_none_follows_grad_dtype` opted in."""
        reduce_dtype: torch.dtype | None = self.mp_policy.reduce_dtype
        if reduce_dtype is not None:
            return reduce_dtype
        if self._grad_override:
            return self._grad_dtype
        follow = _follow_grad_dtype if self._follow is None else self._follow
        compute: torch.dtype = self.orig_dtype if follow else self.param_dtype
        return compute or self.orig_dtype

    @property
    def sharded_grad_dtype(self) -> torch.dtype | None:
        """The dtype of the sharded gradient the optimizer sees (``None``: the reduce dtype)."""
        return self._grad_dtype if self._grad_override else self.orig_dtype

    # -- gradients live in .grad -----------------------------------------------------------------
    @property
    def defers_upcast(self) -> bool:
        """Whether gradients accumulate in a dtype wider than they are computed in."""
        accumulate = self.unsharded_grad_dtype
        compute = self.param_dtype or self.orig_dtype
        return (
            accumulate is not None
            and accumulate != compute
            and torch.promote_types(accumulate, compute) == accumulate
        )

    def init_unsharded_param(self) -> None:
        created = not hasattr(self, "_unsharded_param")
        super().init_unsharded_param()
        if created:
            # The leaf's grad_dtype is fixed now: so is the rule that chose it.
            self._follow = _follow_grad_dtype
            # None: autograd keeps a bf16 gradient bf16 (no fp32 copy of every gradient in a
            # backward that reduces at once; measured +2.3 % step time on bench/fsdp_precision.py
            # before), and adds later ones to an upcast .grad in its fp32.
            self._unsharded_param.grad_dtype = (
                None if self.defers_upcast else self.unsharded_grad_dtype
            )

    @property
    def unsharded_accumulated_grad(self) -> torch.Tensor | None:
        """An alias of the unsharded parameter's ``.grad`` (kept for callers of torch's name)."""
        unsharded = self.__dict__.get("_unsharded_param")
        return None if unsharded is None else unsharded.grad

    @unsharded_accumulated_grad.setter
    def unsharded_accumulated_grad(self, value: torch.Tensor | None) -> None:
        unsharded = self.__dict__.get("_unsharded_param")
        if unsharded is not None:
            unsharded.grad = value

    def to_accumulated_grad_if_needed(self) -> None:
        """After a backward that did not reduce: upcast a deferred ``.grad`` in place, so the
        next backward accumulates into the wide dtype (torch calls this after resharding)."""
        unsharded = self.__dict__.get("_unsharded_param")
        accumulate = self.unsharded_grad_dtype
        if unsharded is None or unsharded.grad is None or accumulate is None:
            return
        if unsharded.grad.dtype != accumulate:
            unsharded.grad = unsharded.grad.to(accumulate)

    def accumulate_unsharded_grad_if_needed(self) -> None:
        """Nothing to do: autograd accumulated into ``.grad``."""

    @property
    def unsharded_zero_grad_data(self) -> torch.Tensor:
        zeros = torch.zeros_like(self.unsharded_param, dtype=self.unsharded_grad_dtype)
        inner: torch.Tensor = self._get_grad_inner_tensor(zeros)
        return inner

    # -- storage and conversions -----------------------------------------------------------------
    def free_unsharded_param(self) -> None:
        if not self.keep_unsharded_storage:
            super().free_unsharded_param()

    def reset_sharded_param(self) -> None:
        # torch calls this at lazy init and after model.to() / load_state_dict(assign=True).
        before = self.sharded_param
        super().reset_sharded_param()
        if self.sharded_param is before and "_unsharded_param" not in self.__dict__:
            self._read_grad_dtype()  # the user's parameter: what it says now is the policy
        else:
            self._apply_grad_dtype()  # a new parameter (or the leaf exists): the policy survives
