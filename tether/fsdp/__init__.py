"""torch 2.15's FSDP2 precision and gradient-accumulation controls, on torch 2.13 and 2.14.

``from tether.fsdp import fully_shard, MixedPrecisionPolicy, FSDPModule, GradientReductionHandle``
gives torch's own objects on torch 2.15 and later, and tether's backport (same names, signatures,
defaults and error messages) on 2.13 and 2.14, so code moves between them by changing one import:

- ``MixedPrecisionPolicy(param_dtype_override_fn=...)``: fp32 gates and norms in a bf16 group,
  still one all-gather per group;
- a parameter's ``grad_dtype`` survives ``fully_shard``; gradients accumulate in ``.grad`` at it;
- ``FSDPModule.set_manual_backward_finalization``, ``finalize_backward(async_op=)``,
  ``set_keep_unsharded_storage`` and ``GradientReductionHandle``.

tether's own helpers (on every torch): :func:`keep_original_dtype` (a name predicate as an
override function) and, before 2.15, :func:`reduce_dtype_none_follows_grad_dtype` (opt in to
2.15's ``reduce_dtype=None`` numerics). docs/fsdp.md has the torch-version matrix and what is
patched. On a torch before 2.15 other than 2.13 or 2.14, importing this raises
:class:`tether.UnsupportedTorchError`.
"""

from __future__ import annotations

from tether._versions import TORCH_FSDP_CONTROLS
from tether.fsdp.names import keep_original_dtype

if TORCH_FSDP_CONTROLS:
    from torch.distributed.fsdp import (  # type: ignore[attr-defined]
        FSDPModule,
        GradientReductionHandle,
        MixedPrecisionPolicy,
        fully_shard,
    )

    def reduce_dtype_none_follows_grad_dtype(enabled: bool = True) -> None:
        """torch 2.15 always follows ``grad_dtype`` when ``reduce_dtype=None``."""
        if not enabled:
            raise ValueError(
                "torch 2.15 reduces gradients in their grad_dtype when reduce_dtype=None; set "
                "MixedPrecisionPolicy(reduce_dtype=...) to choose another"
            )

else:
    from tether.fsdp import _torch

    _torch.require_tested_torch()

    from tether.fsdp.module import FSDPModule, fully_shard  # type: ignore[no-redef]
    from tether.fsdp.params import reduce_dtype_none_follows_grad_dtype
    from tether.fsdp.policy import MixedPrecisionPolicy
    from tether.fsdp.state import GradientReductionHandle

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "fully_shard",
    "keep_original_dtype",
    "reduce_dtype_none_follows_grad_dtype",
]
