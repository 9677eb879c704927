"""The "keep these in full precision" one-liner: a ``param_dtype_override_fn`` from names."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["keep_original_dtype"]


def keep_original_dtype(
    model: nn.Module, predicate: Callable[[str], bool]
) -> Callable[[nn.Parameter], torch.dtype | None]:
    """A ``param_dtype_override_fn`` keeping every parameter of ``model`` whose name (as
    ``model.named_parameters()`` gives it) satisfies ``predicate`` in its own dtype, as
    Hugging Face's ``_keep_in_fp32_modules`` does::

        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            param_dtype_override_fn=keep_original_dtype(model, lambda n: "norm" in n),
        )

    Build it before the first ``fully_shard`` of ``model``: parameters are matched by identity,
    and sharding replaces them. It holds them weakly, so it keeps no unsharded copy alive."""
    kept: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary(
        {id(p): p for name, p in model.named_parameters() if predicate(name)}
    )

    def override(param: nn.Parameter) -> torch.dtype | None:
        return param.dtype if kept.get(id(param)) is param else None

    return override
