"""What each ProcessGroup method means to the recorder: its name in torch's flight-recorder
schema and where its input and output tensors are among the call's arguments.

Names follow torch's own recorder (``profiling_name`` = ``"<backend>:<name>"``) so torch's analyzer
recognises them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["OPS", "OpSpec", "dtype_name", "tensors_of"]


@dataclasses.dataclass(frozen=True, slots=True)
class OpSpec:
    method: str
    """The ProcessGroup method that issues it."""
    name: str
    """Its name in flight-recorder dumps."""
    outputs: int | None
    """Index of the argument holding the outputs; None when there are none."""
    inputs: int | None
    """Index of the argument holding the inputs; None when there are none."""
    p2p: str | None = None
    """"send" or "recv" for point-to-point ops; the peer is argument 1."""


def _inplace(method: str, name: str, p2p: str | None = None) -> OpSpec:
    return OpSpec(method, name, outputs=0, inputs=0, p2p=p2p)


def _out_in(method: str, name: str) -> OpSpec:
    return OpSpec(method, name, outputs=0, inputs=1)


# Only the first name of each pair that torch's C++ trampoline treats as aliases is overridden
# (all_gather_single_coalesced / allgather_into_tensor_coalesced, all_to_all_single /
# alltoall_base, reduce_scatter_single_coalesced / reduce_scatter_tensor_coalesced): overriding
# both makes the base class call back into the other override forever.
OPS: dict[str, OpSpec] = {
    spec.method: spec
    for spec in (
        _inplace("allreduce", "all_reduce"),
        _inplace("allreduce_coalesced", "allreduce_coalesced"),
        _inplace("broadcast", "broadcast"),
        _inplace("reduce", "reduce"),
        _out_in("allgather", "all_gather"),
        _out_in("_allgather_base", "_all_gather_base"),
        _out_in("all_gather_single", "_all_gather_base"),
        _out_in("allgather_coalesced", "ALLGATHER_coalesced"),
        _out_in("all_gather_single_coalesced", "all_gather_into_tensor_coalesced"),
        _out_in("gather", "gather"),
        _out_in("scatter", "scatter"),
        _out_in("reduce_scatter", "reduce_scatter"),
        _out_in("_reduce_scatter_base", "_reduce_scatter_base"),
        _out_in("reduce_scatter_single", "_reduce_scatter_base"),
        _out_in("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
        _out_in("alltoall", "all_to_all"),
        _out_in("all_to_all_single", "all_to_all_single"),
        OpSpec("barrier", "barrier", outputs=None, inputs=None),
        OpSpec("monitored_barrier", "monitored_barrier", outputs=None, inputs=None),
        _inplace("send", "send", p2p="send"),
        _inplace("recv", "recv", p2p="recv"),
        _inplace("recv_anysource", "recv", p2p="recv"),
    )
}

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The c10 scalar-type name torch's recorder writes ("Float", "BFloat16", ...); the native
    core records that name already."""
    if isinstance(dtype, str):
        return dtype
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def tensors_of(arg: Any) -> tuple[list[Any], list[torch.dtype]]:
    """Shapes and dtypes of a tensor, a list of tensors, or a list of lists of tensors.

    An inner list (the per-rank buffers of ``allgather``, ``reduce_scatter``, ``gather``,
    ``scatter``) counts as one flat buffer of shape ``(len(list), *shape)``: that is what torch's
    recorder writes, and what its analyzer's size checks expect."""
    if isinstance(arg, torch.Tensor):
        return [arg.shape], [arg.dtype]
    shapes: list[Any] = []
    dtypes: list[torch.dtype] = []
    for item in arg or ():
        if isinstance(item, torch.Tensor):
            shapes.append(item.shape)
            dtypes.append(item.dtype)
        elif item:
            shapes.append((len(item), *item[0].shape))
            dtypes.append(item[0].dtype)
    return shapes, dtypes
