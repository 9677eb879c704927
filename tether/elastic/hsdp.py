"""HSDP in an elastic job: FSDP2 sharded within a node and replicated across nodes.

    mesh = tether.elastic.hsdp_mesh()               # ("replicate", "shard")
    fully_shard(model, mesh=mesh)                   # torch's, or tether.fsdp's on 2.13 and 2.14
    manager = tether.elastic.Manager(state={"model": model, "optimizer": opt})

A node's ranks hold one replica of the model between them (rank k of a node holds shard k), so
losing a node is losing one replica: the other nodes' replicate groups shrink at the regroup and
FSDP averages the gradients over the ranks left (it divides by the groups' sizes as they are). A
replacement node's rank k is healed from a survivor holding shard k, shard by shard. The two
groups are tether's elastic subgroups (:meth:`World.add_subgroup`): made as groups of this process
alone, connected at the training loop's first step boundary, and again at every regroup; the
mesh itself (its shape, each rank's coordinate) stays the launch's, which is what FSDP reads to
lay out its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tether._exceptions import ConfigError, TetherError
from tether.elastic.manager import current_world
from tether.elastic.world import World
from tether.job.elastic import Decision

__all__ = ["hsdp_mesh"]

MESH_DIM_NAMES = ("replicate", "shard")


def hsdp_mesh() -> Any:
    """The elastic job's 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` for HSDP:
    dimension "shard" over this node's ranks, "replicate" over the nodes. Call it once, on every
    rank (a replacement too), after ``init_process_group`` and before ``fully_shard``."""
    from torch.distributed.device_mesh import DeviceMesh

    world = current_world()
    if world.mesh is not None:
        return world.mesh
    per_node = world.per_node
    size = world.launched_size
    if per_node <= 0 or size % per_node:
        raise ConfigError(
            f"an HSDP mesh needs nodes of equal size (LOCAL_WORLD_SIZE={per_node}, "
            f"{size} ranks): launch with tether run --nproc-per-node"
        )
    me = world.stable_rank
    node, shard = divmod(me, per_node)
    world.shard_of = lambda rank: rank % per_node
    replicate_pg = _solo_group(rank=node, size=size // per_node)
    shard_pg = _solo_group(rank=shard, size=per_node)
    world.add_subgroup(f"replicate{shard}", replicate_pg, _replicas(world, shard))
    world.add_subgroup(f"shard{node}", shard_pg, _node(world, node))
    layout = torch.arange(size).view(size // per_node, per_node)
    world.mesh = DeviceMesh.from_group(
        [replicate_pg, shard_pg], "cpu", mesh=layout, mesh_dim_names=MESH_DIM_NAMES
    )
    return world.mesh


def _solo_group(*, rank: int, size: int) -> dist.ProcessGroup:
    """A recorded gloo group of this process alone, which the first regroup connects; meanwhile
    it answers the ``rank`` and ``size`` of the launch's layout."""
    from tether.recorder.reconfigure import answer_as

    group: dist.ProcessGroup = dist.new_group(
        [dist.get_rank()], backend="gloo", use_local_synchronization=True
    )
    answer_as(group, rank=rank, size=size)
    return group


def _replicas(world: World, shard: int) -> Callable[[Decision], list[int]]:
    def members(decision: Decision) -> list[int]:
        return [r for r in decision.members if world.shard_of(r) == shard]

    return members


def _node(world: World, node: int) -> Callable[[Decision], list[int]]:
    per_node = world.per_node

    def members(decision: Decision) -> list[int]:
        ranks = [r for r in decision.members if r // per_node == node]
        if len(ranks) != per_node:
            lost = sorted(set(range(node * per_node, (node + 1) * per_node)) - set(ranks))
            raise TetherError(
                f"HSDP: rank(s) {lost} of this node left its replica incomplete (epoch "
                f"{decision.epoch}); a node's ranks are lost and replaced together"
            )
        return ranks

    return members
