"""Receive buffers allocated just before their receive and handed to the stage's compute, as in
torch 2.15 (``_recv_buffers.py``), instead of one per microbatch allocated at the first step and
kept for the life of the stage (2.13, 2.14: 16 per stage for 1F1B with 16 microbatches).

A descriptor holds only metadata between steps. Its buffer is *held* from allocation (a receive
about to be posted) until the stage takes it (the compute that consumes it); from then on it is
an ordinary tensor autograd keeps for as long as it needs it. A buffer still held when its
descriptor is allocated again belongs to a step that never finished: a receive may still write
into it, so reusing it silently is what corrupted pytorch#185331, and it is an error here.

On CPU the buffers come from a :class:`RecvCache`, which does what the caching allocator does on a
GPU: a buffer that nothing uses any more is handed to the next receive of the same layout.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch

from tether.pipelining import _torch
from tether.pipelining.stats import Tally

__all__ = ["RecvCache", "make_jit"]


class RecvCache:
    """A stage's CPU receive buffers, handed out again once nothing else uses them.

    A fresh tensor per receive costs what torch's preallocated buffers do not: an allocation
    (page faults on CPU, where malloc returns freed memory to the system: +2 % step time for
    Interleaved1F1B at 512 KiB activations) and two tensor constructions that, on 2 cores shared by
    4 ranks, take about 50 us each (+3 % for 1F1B at 64 KiB; bench/pipeline_memory.py). So the
    cache keeps the tensors themselves and hands one out again only when it holds the sole
    reference to the tensor object, to the tensor, and to its memory: never while autograd, a view,
    a user's reference or a pending receive still uses it. It keeps at most as many per layout as
    were in use at once, and none of another device (GPUs have their caching allocator)."""

    LIMIT = 64
    """Buffers tracked per layout; beyond it those still in use are forgotten (their users keep
    them), so a caller that keeps every received tensor does not grow the cache."""

    def __init__(self, device: torch.device | str) -> None:
        self._device = device
        self._cpu = torch.device(device).type == "cpu"
        self._buffers: dict[tuple[Any, ...], list[_Entry]] = {}

    def empty(self, meta: Any, key: tuple[Any, ...] | None = None) -> torch.Tensor:
        """A tensor of ``meta``'s layout; ``key`` is :func:`layout` of it, when the caller keeps
        one."""
        if not self._cpu:
            return cast(torch.Tensor, _torch.make_tensor_from_meta(meta, self._device))
        entries = self._buffers.setdefault(layout(meta) if key is None else key, [])
        for entry in entries:
            if _free(entry):
                tensor = entry[0]
                tensor.grad = None  # torch's stage_backward leaves the input's gradient on it
                if tensor.requires_grad and not meta.requires_grad:
                    tensor.requires_grad_(False)
                return tensor
        tensor = cast(torch.Tensor, _torch.make_tensor_from_meta(meta, "cpu"))
        entries.append((tensor, tensor.untyped_storage()))
        if len(entries) > self.LIMIT:
            entries[:] = [e for e in entries if _free(e)][-self.LIMIT :]
        return tensor


_Entry = tuple[torch.Tensor, torch.UntypedStorage]
"""A cached buffer and the storage it was made with."""


def layout(meta: Any) -> tuple[Any, ...]:
    """What two receive buffers must share to be interchangeable."""
    return (tuple(meta.shape), tuple(meta.stride), meta.dtype, meta.requires_grad)


def _python_refs(entry: _Entry) -> int:
    return sys.getrefcount(entry[0])


_ONLY_ENTRY = _python_refs((torch.empty(0), torch.UntypedStorage(0)))
"""What :func:`_python_refs` reads for a tensor that only its entry references (measured: what
``sys.getrefcount`` counts besides differs between Python versions)."""


def _free(entry: _Entry) -> bool:
    """Nothing but the cache uses the tensor: no other Python reference to the object, no other
    holder of the tensor (autograd's saved tensors, a view's base), none of its memory (another
    tensor on the storage: a view, a ``detach()``), and nothing a user attached to the object
    (hooks, attributes), which a fresh tensor would not carry."""
    tensor = entry[0]
    return (
        _python_refs(entry) == _ONLY_ENTRY + 1  # + this function's local
        and _torch.tensor_use_count(tensor) == 1
        and _torch.storage_use_count(entry[1]._cdata) == 2  # the tensor's and the entry's
        and tensor._backward_hooks is None
        and tensor._post_accumulate_grad_hooks is None
        and not tensor.__dict__
    )


class _JitRecvInfo(_torch.RecvInfo):
    """torch's ``_RecvInfo`` whose ``buffer`` exists only while it is held (module text).

    torch's stage code reads and assigns ``info.buffer``; the property keeps its meaning."""

    _held: torch.Tensor | None
    _counted: bool
    """The held buffer was allocated here (a same-rank stage's hand-off is its output itself)."""
    _stats: Tally
    _cache: RecvCache
    _layout: tuple[Any, Any]
    """``tensor_meta`` and its :func:`layout`, computed once (torch may replace the meta)."""

    @property
    def buffer(self) -> torch.Tensor | None:
        return self._held

    @buffer.setter
    def buffer(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            self.take_buffer(missing_ok=True)
        else:
            self.set_buffer(tensor)

    def _refuse_if_held(self) -> None:
        if self._held is not None:
            raise _torch.PipeliningMetadataError(
                f"Receive buffer for {self.input_name!r} is still owned by an incomplete "
                "pipeline step; a receive may still write into it. Call "
                "dist.destroy_process_group(), then reconstruct the stages and schedule "
                "before running another step."
            )

    def allocate_buffer(self) -> torch.Tensor:
        """A buffer to receive into, on the stage's device (its cache's)."""
        self._refuse_if_held()
        meta = self.tensor_meta
        if meta is None:
            raise _torch.PipeliningMetadataError(
                f"Receive buffer for {self.input_name!r} has no metadata to allocate from"
            )
        if self._layout[0] is not meta:
            self._layout = (meta, layout(meta))
        tensor = self._cache.empty(meta, self._layout[1])
        self._held, self._counted = tensor, True
        self._stats.add(tensor.nbytes)
        return tensor

    def set_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        self._refuse_if_held()
        self._held, self._counted = tensor, False
        return tensor

    def take_buffer(self, *, missing_ok: bool = False) -> torch.Tensor | None:
        held = self._held
        if held is None:
            if missing_ok:
                return None
            raise _torch.PipeliningMetadataError(
                f"Receive buffer for {self.input_name!r} has not been set"
            )
        self._held = None
        if self._counted:
            self._stats.remove(held.nbytes)
        return held


def make_jit(infos: Any, stats: Tally, cache: RecvCache) -> None:
    """Turn torch's preallocated descriptors (a dict of tuples) into just-in-time ones, dropping
    their buffers."""
    for chunk in infos.values():
        for info in chunk:
            if info.is_root_arg or isinstance(info, _JitRecvInfo):
                continue
            info.__dict__.pop("buffer", None)
            info.__class__ = _JitRecvInfo
            info._held, info._counted, info._stats, info._cache = None, False, stats, cache
            info._layout = (None, ())
