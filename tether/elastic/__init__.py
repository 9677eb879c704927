"""Elastic training: the job goes on when a rank dies (``tether run --elastic``).

    import tether.elastic
    ddp = tether.elastic.DistributedDataParallel(model)
    manager = tether.elastic.Manager(state={"model": model, "optimizer": opt})
    for step in manager.steps(total):
        with manager.attempt():
            ...
            if manager.should_commit():
                opt.step()

:mod:`tether.elastic.world` holds a worker's membership (heartbeat, decisions, regroups),
:mod:`tether.elastic.manager` the training loop's API, :mod:`tether.elastic.heal` how a new member
takes a survivor's state, :mod:`tether.elastic.ddp` the DDP that averages over the members alive,
:mod:`tether.elastic.hsdp` the mesh of FSDP2 sharded within a node, replicated across nodes.
"""

from __future__ import annotations

from tether._exceptions import RankFailedError, WorldTooSmallError
from tether.elastic.ddp import DistributedDataParallel
from tether.elastic.hsdp import hsdp_mesh
from tether.elastic.manager import Manager, current_world

__all__ = [
    "DistributedDataParallel",
    "Manager",
    "RankFailedError",
    "WorldTooSmallError",
    "current_world",
    "hsdp_mesh",
]
