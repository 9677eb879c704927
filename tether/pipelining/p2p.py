"""One process group per directed edge of the schedule, for its point-to-point traffic.

torch 2.15's ``torch.distributed.config.pipeline_per_edge_p2p``
(``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P``): the sends from stage rank a to rank b go on a
group of their own, not on the pipeline group shared with every other edge, so that one edge's
traffic never queues behind another's (nccl runs each communicator's operations in order).
2.15 builds the groups with ``split_group`` over the pipeline group; torch 2.13 cannot split a
gloo group ("No device associated with the default pg"), and a ``new_group`` with
``use_local_synchronization`` names a group after the count of groups its process already has,
which differs between the two ranks of an edge as soon as one has more edges than the other. So
on 2.13 and 2.14 tether builds them with plain ``new_group``, which every rank of the job calls
in the same order: building a schedule with per-edge groups is collective over the default
group (every rank builds its schedule, as every rank builds the job's groups), and the ranks
first agree on the job's edges (one all-gather of each rank's edges). They are ordinary groups:
tether's flight recorder records them like any other (named ``pipeline_p2p:a->b``), and they
show in dumps and in ``tether analyze``.

Groups are cached for the job (a schedule rebuilt later reuses them: every rank built the same
ones) and warmed with one tiny send on each edge when built, so the first step does not pay for
connecting.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tether._versions import backend_family
from tether.config import pipeline_per_edge_p2p_default
from tether.pipelining import _torch

__all__ = [
    "PipelineConfig",
    "batch_by_group",
    "config",
    "edge_groups",
    "on_edges",
    "use_edge_groups",
]

Edge = tuple[int, int]
"""(sender, receiver), global ranks."""


@dataclasses.dataclass
class PipelineConfig:
    """tether's stand-in for torch 2.15's ``torch.distributed.config`` pipelining flag."""

    pipeline_per_edge_p2p: bool = dataclasses.field(default_factory=pipeline_per_edge_p2p_default)
    """Give each directed edge of a schedule its own P2P group (module text). Default from
    ``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P``; read when a schedule is built."""


config = PipelineConfig()

_CACHE: weakref.WeakKeyDictionary[Any, dict[Edge, Any]] = weakref.WeakKeyDictionary()


def edge_groups(parent: Any, stage_to_group_rank: Mapping[int, int]) -> dict[Edge, Any]:
    """This rank's edge groups for a schedule whose stage ``s`` runs on group rank
    ``stage_to_group_rank[s]`` of ``parent`` (a forward and a backward group per pair of
    neighbouring stages on different ranks), built on first use and cached. Collective over the
    default group (module text)."""
    parent = parent if parent is not None else dist.group.WORLD
    indices = sorted(stage_to_group_rank)
    if indices != list(range(len(indices))):
        raise ValueError(
            f"Pipeline P2P edge groups need stages 0..n-1 mapped to ranks; got {indices}"
        )
    me = dist.get_rank()
    mine: set[Edge] = set()
    for stage in indices[:-1]:
        a = dist.get_global_rank(parent, stage_to_group_rank[stage])
        b = dist.get_global_rank(parent, stage_to_group_rank[stage + 1])
        if a != b and me in (a, b):
            mine |= {(a, b), (b, a)}
    cache = _CACHE.setdefault(dist.group.WORLD, {})
    built = [edge for edge in _job_edges(mine) if edge not in cache]  # the same on every rank
    for a, b in built:
        cache[(a, b)] = dist.new_group(
            [a, b],
            backend=dist.get_backend(parent),
            timeout=_timeout(parent),
            group_desc=f"pipeline_p2p:{a}->{b}",
        )
    _warm([edge for edge in built if me in edge], cache)
    return {edge: cache[edge] for edge in mine}


def _job_edges(mine: set[Edge]) -> list[Edge]:
    """Every rank's edges, sorted: one all-gather of counts, one of the padded edge lists (plain
    integers, so nothing is unpickled)."""
    device = _device(dist.group.WORLD)
    count = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    longest = max(int(c.item()) for c in counts)
    if longest == 0:
        return []
    padded = torch.full((longest, 2), -1, dtype=torch.int64, device=device)
    if mine:
        padded[: len(mine)] = torch.tensor(sorted(mine), dtype=torch.int64)
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, padded)
    edges = {(int(a), int(b)) for t in gathered for a, b in t.tolist() if a >= 0}
    return sorted(edges)


def use_edge_groups(stages: list[Any], stage_to_group_rank: dict[int, int]) -> None:
    """Point every local stage's P2P at its edge's group (:mod:`tether.pipelining.p2p`)."""
    if not all(hasattr(s, "_tether_edges") for s in stages):
        raise ValueError("Per-edge pipeline P2P needs tether.pipelining.PipelineStage stages")
    if len({id(s.group) for s in stages}) > 1 or len({str(s.device) for s in stages}) > 1:
        raise ValueError(
            "Per-edge pipeline P2P needs all local stages on one device and one pipeline group"
        )
    edges = edge_groups(stages[0].group, stage_to_group_rank)
    for stage in stages:
        stage._tether_edges = edges


def on_edges(ops: Iterable[Any], edges: Mapping[Edge, Any]) -> list[Any]:
    """``ops`` (torch's ``P2POp``s on the pipeline group) moved to their edge's group."""
    me = dist.get_rank()
    moved = []
    for op in ops:
        edge = (me, op.peer) if op.op is dist.isend else (op.peer, me)
        moved.append(dist.P2POp(op.op, op.tensor, op.peer, edges[edge], op.tag))
    return moved


def batch_by_group(ops: list[Any]) -> list[Any]:
    """Issue ``ops`` as one batch per group, groups in name order (the same on every rank): a
    batch of torch's cannot span groups, and a single-stage loop batches a send and a receive of
    opposite directions, which per-edge groups put on two."""
    if len({id(op.group) for op in ops}) < 2:  # no per-edge groups: torch's one batch
        return list(_torch.batch_p2p(ops))
    groups: dict[str, list[Any]] = {}
    for op in ops:
        group: Any = op.group or dist.group.WORLD
        name = group.group_name
        groups.setdefault(name, []).append(op)
    return [work for name in sorted(groups) for work in _torch.batch_p2p(groups[name])]


def _timeout(parent: Any) -> Any:
    """The parent's timeout, which 2.15's child groups inherit (None: the backend's default)."""
    try:
        return parent._get_backend(_device(parent) or torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _device(group: Any) -> torch.device | None:
    """Where this group's tensors live: the current GPU for nccl, else the CPU (None)."""
    if backend_family(dist.get_backend(group)) == "nccl":  # nccl2, nccl-legacy too (2.15)
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _warm(built: list[Edge], cache: Mapping[Edge, Any]) -> None:
    """One element over each new edge of this rank, so that connecting is not part of the
    first step."""
    me = dist.get_rank()
    works: list[Any] = []
    for a, b in built:
        group = cache[(a, b)]
        token = torch.zeros(1, device=_device(group))
        if a == me:
            works.append(dist.isend(token, b, group=group))
        else:
            works.append(dist.irecv(token, a, group=group))
    for work in works:
        work.wait()
