"""What :class:`~tether.transport.backend.Backend`'s calls check before they reach its backend:
the tensor handed to ``register_memory`` and the views and buffers of a transfer. Pure functions
of their arguments: the state they are checked against (the transport, its peer) is passed in,
and what changes state (in-flight accounting, the lifecycle) stays in ``backend``, which owns it.

Wrong arguments raise ``ValueError``/``TypeError``; a descriptor of another backend or peer a
:class:`DescriptorError`, a range that does not fit a :class:`RemoteAccessError`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tether._exceptions import BackendUnavailableError, DescriptorError, RemoteAccessError
from tether.transport.memory import ByteView, MutableByteView, Pair, RemoteRange

__all__ = ["VIEWS", "Op", "check_tensor", "pairs"]

Op = Literal["read", "write"]

VIEWS: dict[str, tuple[type, ...]] = {
    "write": (ByteView, MutableByteView),
    "read": (MutableByteView,),
}
"""The local view types each operation takes, as the transfer hot path checks them."""


def check_tensor(
    tensor: torch.Tensor, *, backend: str, supports_cuda: bool, device: torch.device | None
) -> None:
    """Raises unless ``backend`` (serving ``device``) can register ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"register_memory takes a tensor, not {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("register_memory needs a contiguous tensor (call .contiguous())")
    if tensor.device.type == "cuda" and not supports_cuda:
        raise BackendUnavailableError(
            f"the {backend} backend moves CPU memory only; use backend='nixl' for CUDA "
            "tensors, or register a CPU copy"
        )
    if device is not None and (
        tensor.device.type != device.type
        or (device.index is not None and tensor.device.index != device.index)
    ):
        raise ValueError(f"expected a tensor on {device}, got {tensor.device}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot register memory on device {tensor.device}")
    if tensor.numel() == 0:
        raise ValueError("cannot register an empty tensor")


def pairs(
    op: Op,
    local: Any,
    remote: Any,
    *,
    transport: object,
    peer: str | None,
    buffer_type: type[RemoteRange],
    backend: str,
) -> list[Pair]:
    """``local`` and ``remote`` (one of each, or lists of as many) as checked pairs: views of
    memory registered with ``transport``, buffers of ``buffer_type`` registered by ``peer``."""
    if isinstance(local, ByteView) and isinstance(remote, RemoteRange):
        found = [(local, remote)]
    else:
        locals_ = [local] if isinstance(local, ByteView) else list(local)
        remotes = [remote] if isinstance(remote, RemoteRange) else list(remote)
        if len(locals_) != len(remotes) or not locals_:
            raise ValueError(
                f"a batch needs as many local views as remote buffers (got {len(locals_)} "
                f"and {len(remotes)}), at least one"
            )
        found = list(zip(locals_, remotes, strict=True))
    for view, buf in found:
        if not isinstance(view, ByteView) or not isinstance(buf, RemoteRange):
            raise TypeError("transfers take views of registered memory and remote buffers")
        if op == "read" and not isinstance(view, MutableByteView):
            raise TypeError("read() writes into local memory: pass memory.to_mutable_view()")
        if view.memory.transport is not transport:
            raise ValueError("the local view's memory is registered with another transport")
        if not isinstance(buf, buffer_type):  # the backend relies on its own fields
            raise DescriptorError(f"remote buffer is for backend {buf.backend!r}, not {backend!r}")
        if buf.peer != peer:
            raise DescriptorError(
                "remote buffer belongs to a transport this one is not connected to"
            )
        if view.length > buf.length:
            raise RemoteAccessError(
                f"{op} of {view.length} bytes does not fit the remote range of {buf.length}"
            )
    return found
