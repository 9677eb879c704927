"""Receive buffers allocated just before their receive and handed to the stage's compute, as in
torch 2.15 (``_recv_buffers.py``), instead of one per microbatch allocated at the first step and
kept for the life of the stage (2.13, 2.14: 16 per stage for 1F1B with 16 microbatches).

A descriptor holds only metadata between steps. Its buffer is *held* from allocation (a receive
about to be posted) until the stage takes it (the compute that consumes it); from then on it is
an ordinary tensor autograd keeps for as long as it needs it. A buffer still held when its
descriptor is allocated again belongs to a step that never finished: a receive may still write
into it, so reusing it silently is what corrupted pytorch#185331, and it is an error here.

On CPU the memory comes from a :class:`RecvCache`, which does what the caching allocator does on a
GPU: a storage that nothing uses any more is handed to the next receive of the same layout.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from tether.pipelining import _torch
from tether.pipelining.stats import Tally

__all__ = ["RecvCache", "make_jit"]


class RecvCache:
    """Storages of a stage's CPU receive buffers, reused once nothing else uses them.

    A fresh buffer per receive costs page faults on CPU, where malloc returns freed memory to the
    system: +2 % step time for Interleaved1F1B with 512 KiB activations, none with the cache
    (bench/pipeline_memory.py's job at 128x1024). A storage is reused only when the cache holds
    its one reference: never while autograd, a view, a user's reference or a pending receive
    still uses it. So it keeps at most as many storages per layout as were in use at once, and
    none of another device (GPUs have their caching allocator)."""

    LIMIT = 64
    """Storages tracked per layout; beyond it those still in use are forgotten (their users keep
    them), so a caller that keeps every received tensor does not grow the cache."""

    def __init__(self) -> None:
        self._storages: dict[tuple[Any, ...], list[torch.UntypedStorage]] = {}

    def empty(self, meta: Any, device: torch.device | str) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return cast(torch.Tensor, _torch.make_tensor_from_meta(meta, device))
        key = (tuple(meta.shape), tuple(meta.stride), meta.dtype)
        storages = self._storages.setdefault(key, [])
        for storage in storages:
            if _free(storage):
                return torch.empty(0, dtype=meta.dtype, device="cpu").set_(
                    storage, 0, meta.shape, meta.stride
                )
        tensor: torch.Tensor = _torch.make_tensor_from_meta(meta, device)
        storages.append(tensor.untyped_storage())
        if len(storages) > self.LIMIT:
            storages[:] = [s for s in storages if _free(s)][-self.LIMIT :]
        return tensor


def _free(storage: torch.UntypedStorage) -> bool:
    """Nothing but this reference uses the storage."""
    return bool(_torch.storage_use_count(storage._cdata) == 1)


class _JitRecvInfo(_torch.RecvInfo):
    """torch's ``_RecvInfo`` whose ``buffer`` exists only while it is held (module text).

    torch's stage code reads and assigns ``info.buffer``; the property keeps its meaning."""

    _held: torch.Tensor | None
    _counted: bool
    """The held buffer was allocated here (a same-rank stage's hand-off is its output itself)."""
    _stats: Tally
    _cache: RecvCache

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

    def allocate_buffer(self, device: torch.device | str) -> torch.Tensor:
        self._refuse_if_held()
        if self.tensor_meta is None:
            raise _torch.PipeliningMetadataError(
                f"Receive buffer for {self.input_name!r} has no metadata to allocate from"
            )
        tensor = self.set_buffer(self._cache.empty(self.tensor_meta, device))
        self._counted = True
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
