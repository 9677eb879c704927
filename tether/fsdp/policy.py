"""torch 2.15's ``MixedPrecisionPolicy``, with ``param_dtype_override_fn``, for torch 2.13/2.14.

A subclass of torch's own frozen dataclass: its four positional fields keep their order and
defaults, and the new field is keyword-only as in 2.15. Only ``tether.fsdp.fully_shard`` applies
the override: torch 2.13/2.14's own ``fully_shard`` accepts the object and ignores the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as _TorchPolicy

__all__ = ["MixedPrecisionPolicy", "TorchPolicy", "resolve_for_param"]

TorchPolicy = _TorchPolicy
"""torch's own policy class: a plain one (no override function) is accepted as it is."""


@dataclass(frozen=True)
class MixedPrecisionPolicy(_TorchPolicy):
    """torch's ``MixedPrecisionPolicy`` plus 2.15's ``param_dtype_override_fn``.

    ``param_dtype_override_fn(param)`` runs once per managed parameter inside ``fully_shard()``
    (``param.dtype`` is the dtype at that moment) and returns ``None`` (use ``param_dtype``),
    ``param_dtype`` or the parameter's own dtype (no cast: it is all-gathered and computed in its
    own dtype); anything else raises ``ValueError`` from ``fully_shard()``. It must answer the same
    on every rank, or ranks build different collective buffers. Forward inputs are still cast to
    ``param_dtype``; storage dtypes stay uniform per ``fully_shard`` group; still one all-gather
    per group.
    """

    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def _resolve_for_param(self, param: nn.Parameter) -> MixedPrecisionPolicy:
        """This parameter's policy: ``param_dtype`` resolved, the override function dropped."""
        if self.param_dtype_override_fn is None:
            return self
        dtype = self.param_dtype_override_fn(param)
        if dtype is None:
            dtype = self.param_dtype
        elif not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return a torch.dtype or None but got {type(dtype)}"
            )
        elif dtype not in (self.param_dtype, param.dtype):
            raise ValueError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's "
                f"original dtype but got {dtype} for a parameter with dtype {param.dtype} and "
                f"param_dtype {self.param_dtype}"
            )
        return dataclasses.replace(self, param_dtype=dtype, param_dtype_override_fn=None)


def resolve_for_param(policy: _TorchPolicy, param: nn.Parameter) -> _TorchPolicy:
    """``policy._resolve_for_param(param)`` for tether's policy; torch's plain one as it is."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy._resolve_for_param(param)
    return policy
