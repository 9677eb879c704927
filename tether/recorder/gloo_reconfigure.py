"""torch 2.14's gloo reconfigure, built for torch 2.13 (which has none) on the groups tether
records.

torch 2.14 reconfigures a gloo group in place (``ProcessGroupGlooReconfigure.cpp``): the new rank is
the local handle's position among the handles (a set is sorted first), the new rank 0 claims the
uuid under ``reconfigure/<uuid>`` in the group's store, a new communicator connects the handles'
holders, and the group's rank, size and sequence numbers become the new communicator's; a failure
leaves the group as it was. On 2.13 tether's recording layer (the native core's recording backend,
or the Python recorder's group) sits between the group and gloo, so it does the same: it connects a
new ``ProcessGroupGloo`` among the members through the group's store and forwards to it from then
on. The group object stays the one the caller holds (torchft keeps it).

torch 2.13 reads a group's rank and size from the group, not its backend: ``ProcessGroup.rank()``
and ``size()``, which torch's Python calls (``get_rank``, ``get_world_size``, argument checks), are
answered here for reconfigured groups. C++ that reads them (DDP's reducer, when it is built) still
sees the size the group was created with (docs/compat.md).

A group created with ``enable_reconfigure=True`` is connected as usual by torch 2.13, then kept
unready until its first reconfigure, as 2.14's gloo is.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo, TCPStore

from tether.recorder.group import RecordedGroup, RecordingProcessGroup

__all__ = [
    "NOT_READY",
    "ReconfigureOptions",
    "Regroupable",
    "handle_fields",
    "in_rank_order",
    "regroupable",
]

NOT_READY = (
    "ProcessGroupGloo has not been initialized. Call reconfigure() before issuing collectives "
    "when enable_reconfigure=True."
)


@dataclasses.dataclass
class ReconfigureOptions:
    """torch 2.14's ``ReconfigureOptions`` (a C++ struct there), for torch 2.13."""

    uuid: int = 0
    handles: set[str] | list[str] = dataclasses.field(default_factory=list)
    timeout: timedelta | None = None
    hints: dict[str, str] = dataclasses.field(default_factory=dict)


def handle_fields(handle: str) -> tuple[int, int, int, str] | None:
    """``gloo:<rank>:<uuid>:<stable rank>:<store host:port>`` -> its fields; None if malformed."""
    kind, _, rest = str(handle).partition(":")
    fields = rest.split(":", 3)
    if kind != "gloo" or len(fields) != 4:
        return None
    try:
        return int(fields[0]), int(fields[1]), int(fields[2]), fields[3]
    except ValueError:
        return None


class _NotReady:
    """The Python recorder's group forwards to this until its first reconfigure."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(NOT_READY)


@dataclasses.dataclass
class Regroupable:
    """A recorded gloo group that tether can reconfigure, and where it stands."""

    pg: Any
    group: RecordedGroup
    layer: Any
    """What forwards the group's operations: the core's recording backend, or the group itself
    (the Python recorder's)."""
    stable_rank: int
    store: Any
    address: str
    rank: int
    size: int
    uuid: int = -1
    answers: bool = False
    """Whether ``rank`` and ``size`` are the group's answers to torch (once swapped, or told
    what a later regroup will connect it as: :func:`~tether.recorder.reconfigure.answer_as`)."""

    def handle(self) -> str:
        return f"gloo:{self.rank}:{self.uuid}:{self.stable_rank}:{self.address}"

    def set_ready(self, ready: bool) -> None:
        if type(self.layer) is RecordingProcessGroup:
            if not ready:
                self.layer._inner = _NotReady()  # type: ignore[assignment]
        else:
            self.layer.set_ready(ready)

    def reconfigure(self, opts: Any) -> Any:
        handles = _ordered(opts.handles)
        local = self.handle()
        if local not in handles:
            raise RuntimeError("Local Gloo reconfigure handle is not part of the new communicator")
        uuid, rank, size = int(opts.uuid), handles.index(local), len(handles)
        claims = PrefixStore(f"reconfigure/{uuid}", self.store)
        if rank == 0 and _claim(claims, local) != local:
            raise RuntimeError(
                f"Gloo reconfigure uuid {uuid} was already used; each reconfigure() requires a "
                "unique uuid"
            )
        timeout = opts.timeout or timedelta(milliseconds=self.group.timeout_ms)
        # Connects to every member, or raises (a member missing past the timeout): nothing here
        # has changed yet, so the group is as it was.
        gloo = ProcessGroupGloo(PrefixStore("gloo", claims), rank, size, timeout)
        self.swap(gloo, store=claims, rank=rank, size=size, uuid=uuid)
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result([])
        return _c10d._create_work_from_future(future)  # type: ignore[attr-defined]

    def swap(self, gloo: Any, *, store: Any, rank: int, size: int, uuid: int) -> None:
        """Forward the group's operations to ``gloo``, a connected communicator of ``size``
        ranks in which this process is ``rank`` (the previous one is released)."""
        if type(self.layer) is RecordingProcessGroup:
            inner = ProcessGroup(store, rank, size)
            inner._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
            inner._set_default_backend(ProcessGroup.BackendType.GLOO)
            inner._set_group_name(self.pg.group_name)
            inner._set_group_desc(self.pg.group_desc)
            self.layer._inner = inner
        else:
            self.layer.replace(gloo, rank, size)
        self.rank, self.size, self.uuid = rank, size, uuid
        self.answers = True


def regroupable(pg: Any, group: RecordedGroup, layer: Any) -> Regroupable | None:
    """The group as tether reconfigures it, or None where it cannot (not gloo alone)."""
    if set(group.backends.values()) != {"gloo"}:
        return None
    store = c10d._world.pg_map[pg][1]
    return Regroupable(
        pg=pg,
        group=group,
        layer=layer,
        stable_rank=group.ranks[group.group_rank],
        store=store,
        address=_address(store),
        rank=group.group_rank,
        size=len(group.ranks),
    )


def in_rank_order(handles: Any) -> list[str]:
    """The handles by new rank: a list by position, a set sorted (as gloo orders them)."""
    return list(handles) if isinstance(handles, (list, tuple)) else sorted(handles)


def _ordered(handles: Any) -> list[str]:
    """:func:`in_rank_order`, after torch's checks in its order."""
    ordered = in_rank_order(handles)
    if not ordered:
        raise RuntimeError("Reconfigure requires at least one handle")
    if len(set(ordered)) != len(ordered):
        raise RuntimeError("Reconfigure handles must be unique")
    for handle in ordered:
        if handle_fields(handle) is None:
            raise RuntimeError(f"Invalid Gloo reconfigure handle: {handle}")
    return ordered


def _claim(store: Any, handle: str) -> str:
    got = store.compare_set("claimed", "", handle)
    return got.decode() if isinstance(got, bytes) else str(got)


def _address(store: Any) -> str:
    """``host:port`` of the TCPStore under ``store``'s prefixes; "" for another kind of store."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if isinstance(store, TCPStore):
        return f"{store.host}:{store.port}"
    return ""
