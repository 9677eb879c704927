"""Healing a new member from a survivor's memory with :mod:`tether.transport` (no checkpoint).

The survivor packs its registered state (model, optimizer, step, data position, ...) into one
byte buffer plus a JSON description, registers the buffer with a transport connected to the new
member through the job's store, and waits until the new member has read it in one transfer and
rebuilt the same state. Nothing is pickled: tensors travel as raw bytes described by dtype and
shape; everything else is JSON-encoded, tagged so that tuples, non-string keys and tensors
survive the trip. A DTensor (an FSDP2 parameter, its optimizer state) travels as its local shard
and is rebuilt on the receiver's own mesh with the sender's placements: under HSDP the healer
holds the same shard as the one it heals.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore

from tether._log import get_logger
from tether.job.elastic import key

__all__ = ["Healing", "pack", "receive", "send", "unpack"]

logger = get_logger(__name__)

_POLL_S = 0.01


class Healing:
    """What one heal moved, for the timeline and the benchmark."""

    def __init__(self, nbytes: int, seconds: float, over: str = "") -> None:
        self.nbytes, self.seconds = nbytes, seconds
        self.over = over
        """The transport's backend ("tcp" across hosts, "local" on one)."""


# -- state <-> (description, bytes) ---------------------------------------------------------------
def pack(state: Any) -> tuple[str, torch.Tensor]:
    """``state`` (nested dicts, lists, tuples, tensors, JSON scalars) as a JSON description and
    one contiguous uint8 tensor holding every tensor's bytes."""
    tensors: list[torch.Tensor] = []

    from torch.distributed.tensor import DTensor

    def enc(value: Any) -> Any:
        if isinstance(value, DTensor):
            local = enc(value.to_local())["T"]
            where = [_placement(p) for p in value.placements]
            return {"D": [*local, where, list(value.shape), list(value.stride())]}
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            tensors.append(t)
            return {"T": [len(tensors) - 1, str(t.dtype).removeprefix("torch."), list(t.shape)]}
        if isinstance(value, dict):
            return {"d": [[enc(k), enc(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"t": [enc(v) for v in value]}
        if isinstance(value, list):
            return {"l": [enc(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise TypeError(f"cannot heal a {type(value).__name__} (tensors and plain data only)")

    description = json.dumps(enc(state))
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    data = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    return description, data


def _placement(placement: Any) -> str:
    """A DTensor placement as text: "R" (replicated) or "S<dim>" (sharded)."""
    if placement.is_replicate():
        return "R"
    if placement.is_shard():
        return f"S{placement.dim}"
    raise TypeError(f"cannot heal a DTensor placed {placement} (Replicate and Shard only)")


def _placed(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def unpack(description: str, data: torch.Tensor, *, mesh: Any = None) -> Any:
    """The state :func:`pack` described; its DTensors rebuilt on ``mesh``."""
    offset = 0
    specs: dict[int, tuple[torch.dtype, list[int]]] = {}

    def collect(node: Any) -> None:
        ((tag, body),) = node.items()
        if tag in ("T", "D"):
            specs[int(body[0])] = (getattr(torch, body[1]), [int(n) for n in body[2]])
        elif tag == "d":
            for k, v in body:
                collect(k)
                collect(v)
        elif tag in ("t", "l"):
            for v in body:
                collect(v)

    tree = json.loads(description)
    collect(tree)
    tensors: dict[int, torch.Tensor] = {}
    for index in sorted(specs):
        dtype, shape = specs[index]
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        if n:
            t.reshape(-1).view(torch.uint8).copy_(data[offset : offset + n])
        offset += n
        tensors[index] = t

    def dec(node: Any) -> Any:
        ((tag, body),) = node.items()
        if tag == "T":
            return tensors[int(body[0])]
        if tag == "D":
            from torch.distributed.tensor import DTensor

            if mesh is None:
                raise ValueError("the state holds DTensors and this rank has no mesh to place them")
            return DTensor.from_local(
                tensors[int(body[0])],
                mesh,
                [_placed(p) for p in body[3]],
                run_check=False,
                shape=torch.Size(body[4]),
                stride=tuple(body[5]),
            )
        if tag == "d":
            return {dec(k): dec(v) for k, v in body}
        if tag == "t":
            return tuple(dec(v) for v in body)
        if tag == "l":
            return [dec(v) for v in body]
        return body

    return dec(tree)


# -- over the transport ---------------------------------------------------------------------------
def own_address(toward: str) -> str:
    """This host's address on the network that reaches ``toward`` (the job's store host, which
    every node reaches): where a survivor on another node can read from; loopback on one host."""
    try:
        family, kind, _, _, where = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(where)  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _transport(where: Any, *, rank: int, host: str, timeout_s: float) -> Any:
    """The healer (rank 0) and the healed (rank 1) connected through ``where``: shared memory
    on one host, tcp on ``host``'s address across hosts."""
    import tether.transport as tt

    return tt.new_transport_rank(
        "auto",
        "cpu",
        store=where,
        rank=rank,
        peer_rank=1 - rank,
        bootstrap_timeout=timeout_s,
        config=tt.TransportConfig(host=host),
    )


def send(
    store: Any,
    *,
    host: str,
    epoch: int,
    to: int,
    state: Any,
    timeout_s: float,
    abandoned: Callable[[], bool],
) -> Healing | None:
    """Serve ``state`` to stable rank ``to`` until it has read it (None: abandoned first);
    ``host``: this host's address (:func:`own_address`)."""
    start = time.perf_counter()
    description, data = pack(state)
    where = PrefixStore(key("heal", epoch, to), store)
    with _transport(where, rank=0, host=host, timeout_s=timeout_s) as transport:
        memory = transport.register_memory(data)
        remote = memory.to_remote_buffer().serialize()
        where.set("offer", json.dumps({"state": description, "remote": bytes(remote).decode()}))
        if not _wait(where, "taken", abandoned, timeout_s):
            return None
    return Healing(int(data.numel()), time.perf_counter() - start, transport.name)


def receive(
    store: Any,
    *,
    host: str,
    epoch: int,
    me: int,
    timeout_s: float,
    abandoned: Callable[[], bool],
    mesh: Any = None,
) -> tuple[Any, Healing] | None:
    """Read the state a survivor serves this rank (None: abandoned first); its DTensors placed
    on ``mesh``."""
    import tether.transport as tt

    start = time.perf_counter()
    where = PrefixStore(key("heal", epoch, me), store)
    with _transport(where, rank=1, host=host, timeout_s=timeout_s) as transport:
        if not _wait(where, "offer", abandoned, timeout_s):
            return None
        offer = json.loads(where.get("offer"))
        remote = tt.RemoteRange.deserialize(offer["remote"].encode())
        data = torch.empty(remote.length, dtype=torch.uint8)
        if data.numel():
            transport.read(transport.register_memory(data).to_mutable_view(), remote)
        state = unpack(offer["state"], data, mesh=mesh)
        where.set("taken", "1")
    return state, Healing(int(data.numel()), time.perf_counter() - start, transport.name)


def _wait(store: Any, name: str, abandoned: Callable[[], bool], timeout_s: float) -> bool:
    """Wait for ``name`` in ``store``; False as soon as ``abandoned()`` says so; TimeoutError
    after ``timeout_s`` (the peer neither did its part nor was declared dead)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([name]):  # polled: a TCPStore wait that times out logs warnings
        if abandoned():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"healing: {name!r} did not come within {timeout_s:g}s")
        time.sleep(_POLL_S)
    return True
