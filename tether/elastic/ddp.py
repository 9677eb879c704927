"""``tether.elastic.DistributedDataParallel``: torch's DDP whose gradients are averaged over the
members of an elastic job's world group, as they change.

torch's DDP is built over a group of this process alone, so its own collectives (the shape check
and parameter broadcast of its constructor, the bucket-order broadcast after its first step) are
local: a replacement builds it on its own while the survivors are mid-job. The gradient buckets
are averaged over the world group by a comm hook, divided by the group's size as it is now.
Every rank lays its buckets out in the parameters' order from its first step: DDP otherwise
re-orders them after the first step, as that step's gradients came, and a replacement, on its
first step, would disagree with the survivors on which gradient sits where. The order is handed
to DDP before that step (the reducer's own call for a rank that joins late, as ``Join`` makes it),
not kept by ``find_unused_parameters=True``, which walks the autograd graph at every step
(torchft's DDP does that).
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
        super().__init__(module, process_group=_solo(), **kwargs)
        self.reducer._push_all_rebuilt_params()  # rebuilt at the first forward, in index order
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
