"""The one place ``tether.fsdp`` reaches into torch's private FSDP2 modules, and the gate that
refuses a torch it was not tested with.

tether backports torch 2.15's FSDP2 controls to 2.13 and 2.14 by extending torch's own classes
(``FSDPParam``, ``FSDPParamGroup``, ``FSDPState``, ``FSDPModule``) rather than forking FSDP2: the
all-gather, streams, prefetching and state dicts stay torch's. Those classes are private and change
between releases, so every name used is imported here and checked on first use; a torch outside
:data:`tether._versions.FSDP_BACKPORT_TESTED` raises :class:`~tether.UnsupportedTorchError`
naming its version instead of computing something subtly wrong.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tether._exceptions import UnsupportedTorchError
from tether._versions import FSDP_BACKPORT_TESTED, TORCH


def _refuse_untested_release() -> None:
    if TORCH[:2] not in FSDP_BACKPORT_TESTED:
        tested = ", ".join(f"{major}.{minor}" for major, minor in FSDP_BACKPORT_TESTED)
        raise UnsupportedTorchError(
            f"tether.fsdp backports torch 2.15's FSDP2 controls by extending torch's private FSDP2 "
            f"classes, and was tested with torch {tested}; this is torch {torch.__version__}. Use "
            "torch 2.15 or later (tether.fsdp then hands out torch's own objects) or a tested "
            "release."
        )


_refuse_untested_release()  # before the private imports, which an older torch may not have

from torch.distributed.device_mesh import _get_device_handle  # noqa: E402
from torch.distributed.fsdp._fully_shard import (  # noqa: E402
    _fsdp_collectives,
    _fsdp_init,
    _fsdp_param,
    _fsdp_param_group,
    _fsdp_state,
    _fully_shard,
)

__all__ = [
    "TrainingState",
    "collectives",
    "device_handle",
    "fsdp_init",
    "fsdp_param",
    "fsdp_param_group",
    "fsdp_state",
    "fully_shard_module",
    "original_class",
    "require_tested_torch",
]

# Typed Any: private, partly untyped, and not the same from one release to the next.
collectives: Any = _fsdp_collectives
device_handle: Any = _get_device_handle
fsdp_init: Any = _fsdp_init
fsdp_param: Any = _fsdp_param
fsdp_param_group: Any = _fsdp_param_group
fsdp_state: Any = _fsdp_state
fully_shard_module: Any = _fully_shard
TrainingState: Any = fsdp_state.TrainingState


def original_class(fsdp_class: type) -> type:
    """The user's class that ``fully_shard`` made ``fsdp_class`` (``FSDP<Orig>``) from: torch
    keeps its place in the MRO (``_orig_cls_mro_index``, checked below)."""
    index: int = getattr(fsdp_class, "_orig_cls_mro_index")  # noqa: B009  (private, untyped)
    return fsdp_class.__mro__[index]


# What the backport overrides or calls, by module: a release that renamed one of them is refused
# even if its version were allowed.
_EXPECTED = {
    _fsdp_param: ("FSDPParam",),
    _fsdp_param_group: ("FSDPParamGroup", "foreach_reduce", "TrainingState"),
    _fsdp_init: ("_init_param_group",),
    _fsdp_state: ("FSDPState", "FSDPStateContext"),
    _fully_shard: ("FSDPModule", "fully_shard"),
    _fsdp_collectives: (
        "foreach_reduce",
        "_get_gradient_divide_factors",
        "_div_if_needed",
        "_get_dim0_padded_size",
    ),
}
_MEMBERS = {
    "FSDPParam": (
        "init_dtype_attrs",
        "init_unsharded_param",
        "reset_sharded_param",
        "to_accumulated_grad_if_needed",
        "accumulate_unsharded_grad_if_needed",
        "free_unsharded_param",
        "_get_grad_inner_tensor",
        "to_sharded_dtensor",
    ),
    "FSDPParamGroup": (
        "lazy_init",
        "_init_mp_dtypes",
        "post_backward",
        "finalize_backward",
        "reshard",
    ),
    "FSDPState": (
        "_lazy_init",
        "_register_root_post_backward_final_callback",
        "_root_post_backward_final_callback",
        "_reset_iter_state",
    ),
    "FSDPModule": ("_orig_cls_mro_index", "_apply", "reset_iter_state"),
}
# foreach_reduce's parameters, in the order torch's post_backward passes them by position: the
# dispatcher in reduce.py reads orig_dtype and reduce_dtype by index.
_FOREACH_REDUCE = (
    "fsdp_params",
    "unsharded_grads",
    "reduce_scatter_group",
    "reduce_scatter_stream",
    "reduce_scatter_comm",
    "orig_dtype",
    "reduce_dtype",
)


def require_tested_torch() -> None:
    """Raise :class:`UnsupportedTorchError` unless this torch's FSDP2 is one tether extends."""
    version = str(torch.__version__)
    _refuse_untested_release()
    for module, names in _EXPECTED.items():
        for name in names:
            found = getattr(module, name, None)
            if found is None or not all(hasattr(found, m) for m in _MEMBERS.get(name, ())):
                raise UnsupportedTorchError(
                    f"tether.fsdp: torch {version} has no {module.__name__}.{name} as tether "
                    "knows it (its private FSDP2 classes changed); refusing to run"
                )
    # The group swap works because _init_param_group imports FSDPParamGroup at each call.
    if "FSDPParamGroup" not in _fsdp_init._init_param_group.__code__.co_varnames:
        raise UnsupportedTorchError(
            f"tether.fsdp: torch {version}'s _init_param_group no longer imports FSDPParamGroup "
            "when called; refusing to run"
        )
    reduce_params = tuple(inspect.signature(_fsdp_collectives.foreach_reduce).parameters)
    if reduce_params[: len(_FOREACH_REDUCE)] != _FOREACH_REDUCE:
        raise UnsupportedTorchError(
            f"tether.fsdp: torch {version}'s foreach_reduce takes {reduce_params}; refusing to run"
        )
