"""``tether.elastic.DistributedDataParallel``: torch's DDP whose gradients are averaged over the
members of an elastic job's world group, as they change.

torch's DDP is built over a group of this process alone, so its own collectives (the shape check
and parameter broadcast of its constructor, the bucket-order broadcast after its first step) are
local: a replacement builds it on its own while the survivors are mid-job. The gradient buckets
are averaged over the world group by a comm hook, divided by the group's size as it is now.
``find_unused_parameters=True`` keeps every rank's buckets in construction order for good: DDP
otherwise re-orders them after the first step, and a replacement would then disagree with the
survivors on which gradient sits where (torchft's DDP does the same, for the same reason). It
costs a walk of the autograd graph a step. Handing DDP the parameters' order before the first
step instead (``reducer._push_all_rebuilt_params``, the call ``Join`` makes for a late rank) lays
the buckets out first parameter first: the bucket launched first would then hold the gradients
that come last, and no all_reduce would overlap the backward pass of a model used in the order
it is built.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import HashStore, ProcessGroup, ProcessGroupGloo
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(_TorchDDP):
    """torch's ``DistributedDataParallel`` (same arguments but ``process_group``), for an
    elastic job: gradients are averaged over the world group's members of the moment."""

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        if kwargs.pop("process_group", None) is not None:
            raise ValueError(
                "tether.elastic.DistributedDataParallel averages over the world group; "
                "it takes no process_group"
            )
        kwargs["find_unused_parameters"] = True
        super().__init__(module, process_group=_solo(), **kwargs)
        self.register_comm_hook(c10d._get_default_group(), _average)


def _solo() -> ProcessGroup:
    """A gloo group of this process alone (nothing else to connect to)."""
    store = HashStore()
    gloo = ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    group = ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    return group


def _average(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.div_(group.size())  # in Python: the size of the current membership
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda fut: fut.value()[0]
    )
    return averaged


# DDP checks a hook's annotations as objects; this module's are strings (postponed).
_average.__annotations__ = {
    "group": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
