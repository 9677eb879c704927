"""Reduce-scatter of a group whose gradients have more than one dtype (torch 2.15's path).

torch 2.13/2.14's ``foreach_reduce`` asserts one gradient dtype per group and casts the reduced
shard back to the group's original dtype. A group with per-parameter compute or gradient dtypes
needs torch 2.15's: one reduce-scatter per group in the promoted dtype (fp32 for bf16 + fp32) or
``reduce_dtype`` if set, the copy-in casting while it concatenates (``chunk_cat_mixed_dtype``),
and the output cast back once per contiguous run of parameters sharing a gradient dtype.

:func:`install` puts a dispatcher in place of ``foreach_reduce`` in torch's param-group module:
groups of tether's parameters with mixed dtypes take :func:`foreach_reduce_mixed`; every other
group (torch's own, or tether's with one dtype) calls torch's function unchanged.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tether.fsdp import _torch
from tether.fsdp.params import TetherFSDPParam

__all__ = ["chunk_cat_mixed_dtype", "foreach_reduce_mixed", "install"]

_library: torch.library.Library | None = None


def chunk_cat_mixed_dtype(
    tensors: list[torch.Tensor], dim: int, num_chunks: int, *, out: torch.Tensor
) -> None:
    """torch 2.15's CPU composite of ``fsdp::chunk_cat_mixed_dtype``: cast each input to
    ``out``'s dtype where it differs, then ``_chunk_cat`` into ``out``."""
    same = [t if t.dtype == out.dtype else t.to(out.dtype) for t in tensors]
    torch._chunk_cat(same, dim, num_chunks, out=out)


def _register_op() -> None:
    """``torch.ops.fsdp.chunk_cat_mixed_dtype``, registered only where torch has none (<2.15)."""
    global _library
    if _library is not None or hasattr(torch.ops.fsdp, "chunk_cat_mixed_dtype"):
        return
    library = torch.library.Library("fsdp", "FRAGMENT")
    library.define(
        "chunk_cat_mixed_dtype(Tensor[] tensors, int dim, int num_chunks, *, Tensor(a!) out) -> ()"
    )
    library.impl("chunk_cat_mixed_dtype", chunk_cat_mixed_dtype, "CompositeExplicitAutograd")
    _library = library


def install() -> None:
    """Route tether's mixed-dtype groups through :func:`foreach_reduce_mixed` (idempotent)."""
    _register_op()
    module = _torch.fsdp_param_group
    if getattr(module.foreach_reduce, "tether_dispatch", False):
        return
    original = module.foreach_reduce

    @functools.wraps(original)
    def dispatch(
        fsdp_params: list[Any], unsharded_grads: list[torch.Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        # All of a group's parameters are of one class: the first tells whose group this is.
        # torch's post_backward passes every argument by position (checked in _torch): args[3]
        # is orig_dtype, args[4] reduce_dtype.
        if fsdp_params and type(fsdp_params[0]) is TetherFSDPParam and not kwargs:
            given = list(args)
            given[4] = args[4] or reduce_dtype_of(fsdp_params, unsharded_grads)
            targets = {p.sharded_grad_dtype for p in fsdp_params}
            if (
                len(targets) == 1
                and None not in targets
                and len({g.dtype for g in unsharded_grads}) == 1
            ):
                # One gradient dtype, one shard dtype: torch's own path (CPU offload included),
                # told to cast the shards to that dtype.
                given[3] = next(iter(targets))
                return original(fsdp_params, unsharded_grads, *given)
            return foreach_reduce_mixed(fsdp_params, unsharded_grads, *given)
        return original(fsdp_params, unsharded_grads, *args, **kwargs)

    dispatch.tether_dispatch = True  # type: ignore[attr-defined]
    module.foreach_reduce = dispatch


def reduce_dtype_of(
    fsdp_params: list[TetherFSDPParam], unsharded_grads: list[torch.Tensor]
) -> torch.dtype:
    """Without a ``reduce_dtype``, 2.15 reduces in the promotion of each parameter's
    accumulation dtype (its gradient's own where that is ``None``): a deferred bf16 gradient
    still reduces in the fp32 it accumulates in."""
    dtypes = {
        p.unsharded_grad_dtype or g.dtype for p, g in zip(fsdp_params, unsharded_grads, strict=True)
    }
    return functools.reduce(torch.promote_types, dtypes)


def refuse_offload(names: str) -> NotImplementedError:
    """The error for CPU offload of a group with several gradient dtypes (refused at lazy init
    where the dtypes already differ, here where only the gradients do)."""
    return NotImplementedError(
        "tether.fsdp: CPU offload of a group whose gradients have several dtypes is not "
        f"supported ({names}); give the group one gradient dtype or shard those "
        "parameters apart"
    )


@torch.no_grad()
def foreach_reduce_mixed(
    fsdp_params: list[TetherFSDPParam],
    unsharded_grads: list[torch.Tensor],
    reduce_scatter_group: dist.ProcessGroup | None,
    reduce_scatter_stream: torch.Stream,
    reduce_scatter_comm: Any,
    orig_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    device: torch.device,
    gradient_divide_factor: float | None,
    all_reduce_group: dist.ProcessGroup | None,
    all_reduce_stream: torch.Stream,
    all_reduce_grads: bool,
    partial_reduce_output: torch.Tensor | None,
    all_reduce_hook: Callable[[torch.Tensor], None] | None,
    force_sum_reduction_for_comms: bool = False,
) -> tuple[Any, ...]:
    """torch's ``foreach_reduce`` (same arguments, same 7 results) for gradients of several
    dtypes: reduced in ``reduce_dtype`` (:func:`reduce_dtype_of` if None), cast back per run."""
    collectives = _torch.collectives
    if any(p.offload_to_cpu for p in fsdp_params):
        raise refuse_offload(", ".join(p._param_fqn or "?" for p in fsdp_params))
    dtype = reduce_dtype or reduce_dtype_of(fsdp_params, unsharded_grads)
    predivide, postdivide, reduce_scatter_op, all_reduce_op = (
        collectives._get_gradient_divide_factors(
            reduce_scatter_group,
            all_reduce_group,
            dtype,
            device.type,
            gradient_divide_factor,
            force_sum_reduction_for_comms,
        )
    )
    world_size = 1 if reduce_scatter_group is None else reduce_scatter_group.size()
    handle = _torch.device_handle(device.type)
    current_stream = handle.current_stream()
    for i, (param, grad) in enumerate(zip(fsdp_params, unsharded_grads, strict=True)):
        shard_dim = param.fsdp_placement.dim
        if world_size > 1 and shard_dim != 0:  # Shard(d): rows of each rank's chunk, in order
            if grad.size(shard_dim) % world_size != 0:  # torch.chunk would return fewer chunks
                raise AssertionError(
                    f"Shard({shard_dim}) requires even sharding: {grad.size()=} {world_size=}"
                )
            unsharded_grads[i] = torch.cat(torch.chunk(grad, world_size, dim=shard_dim), dim=0)
    padded_sizes = [
        collectives._get_dim0_padded_size(g.size(), world_size) for g in unsharded_grads
    ]
    input_numel = sum(s.numel() for s in padded_sizes)
    reduce_scatter_input = reduce_scatter_comm.allocate((input_numel,), dtype=dtype, device=device)
    torch.ops.fsdp.chunk_cat_mixed_dtype(
        unsharded_grads, dim=0, num_chunks=world_size, out=reduce_scatter_input.view(world_size, -1)
    )
    unsharded_grads.clear()  # the copy-in holds them now: free autograd's gradients
    reduce_scatter_stream.wait_stream(current_stream)
    all_reduce_input = all_reduce_event = None
    with handle.stream(reduce_scatter_stream):
        output = reduce_scatter_comm.allocate(
            (input_numel // world_size,), dtype=dtype, device=device
        )
        collectives._div_if_needed(reduce_scatter_input, predivide)
        if world_size > 1:
            reduce_scatter_comm(
                output_tensor=output,
                input_tensor=reduce_scatter_input,
                group=reduce_scatter_group,
                op=reduce_scatter_op,
            )
        elif gradient_divide_factor is not None:
            output.copy_(reduce_scatter_input / gradient_divide_factor)
        else:
            output.copy_(reduce_scatter_input)
        reduce_scatter_event = reduce_scatter_stream.record_event()
        post_reduce_stream = reduce_scatter_stream
        if all_reduce_group is not None:  # HSDP
            if not all_reduce_grads:  # accumulate the reduce-scattered part for a later step
                if partial_reduce_output is not None:
                    partial_reduce_output += output
                else:
                    partial_reduce_output = output
                return (
                    reduce_scatter_input,
                    reduce_scatter_event,
                    post_reduce_stream,
                    post_reduce_stream.record_event(),
                    None,
                    None,
                    partial_reduce_output,
                )
            if partial_reduce_output is not None:
                output += partial_reduce_output
            post_reduce_stream = all_reduce_stream
            all_reduce_stream.wait_stream(reduce_scatter_stream)
            with handle.stream(all_reduce_stream):
                dist.all_reduce(output, group=all_reduce_group, op=all_reduce_op)
                # Held by the caller across groups so the allocator cannot hand this buffer to
                # the next group's reduce-scatter while the all-reduce still runs.
                all_reduce_input = output
                all_reduce_event = all_reduce_stream.record_event()
    if all_reduce_hook is not None:
        post_reduce_stream = all_reduce_stream
        all_reduce_stream.wait_stream(reduce_scatter_stream)
        with handle.stream(all_reduce_stream):
            all_reduce_hook(output)
    with handle.stream(post_reduce_stream):
        collectives._div_if_needed(output, postdivide)
        _write_sharded_grads(fsdp_params, padded_sizes, output, world_size)
        post_reduce_event = post_reduce_stream.record_event()
    return (
        reduce_scatter_input,
        reduce_scatter_event,
        post_reduce_stream,
        post_reduce_event,
        all_reduce_input,
        all_reduce_event,
        None,
    )


def _write_sharded_grads(
    fsdp_params: list[TetherFSDPParam],
    padded_sizes: list[torch.Size],
    output: torch.Tensor,
    world_size: int,
) -> None:
    """View each parameter's shard of ``output`` as its gradient: one cast per run of parameters
    sharing a gradient dtype, then accumulate into or set ``.grad``, then the grad hooks."""
    numels = [size.numel() // world_size for size in padded_sizes]
    offsets = list(itertools.accumulate(numels, initial=0))

    def grad_dtype(i: int) -> torch.dtype | None:
        return fsdp_params[i].sharded_grad_dtype

    for target, members in itertools.groupby(range(len(fsdp_params)), key=grad_dtype):
        indices = list(members)
        start, end = offsets[indices[0]], offsets[indices[-1] + 1]
        flat = output.narrow(0, start, end - start)
        if target is not None and target != flat.dtype:
            flat = flat.to(target)
        for i in indices:
            param = fsdp_params[i]
            shard = torch.as_strided(
                flat,
                size=param.sharded_size,
                stride=param.contiguous_sharded_stride,
                storage_offset=flat.storage_offset() + offsets[i] - start,
            )
            sharded = param.sharded_param
            if sharded.grad is not None:
                sharded.grad._local_tensor += shard
            else:
                sharded.grad = param.to_sharded_dtensor(shard)
            for hook in (getattr(sharded, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(sharded)
