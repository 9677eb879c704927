"""The nodes of a job that spans several hosts, through the job's store.

Each node's launcher (``tether run``'s agent) publishes where it can be reached and beats, so
that the others can bring its part of an event and tell when it is gone:

    tether/node/<attempt>/<k>        JSON :class:`NodeInfo` of node k (torchrun's node rank) in
                                     torchrun attempt <attempt>
    tether/node/<attempt>/<k>/beat   a counter node k's launcher adds to (store.add): a node
                                     whose counter stops moving has stopped answering
    tether/node/<attempt>/<k>/ended  how node k's workers ended ("succeeded", "failed"), set by
                                     its launcher as it stops beating

A beat is one store operation per node per :data:`BEAT_S`; only the node that watches reads the
others' (one operation each per beat).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
from typing import Any

__all__ = ["BEAT_S", "NodeBoard", "NodeInfo", "ping_state"]

_NODE = "tether/node"
BEAT_S = 0.25
"""How often a launcher beats: a node silent for a few of these is looked at more closely."""


def ping_state(address: str, port: int, token: str, timeout: float) -> str:
    """How the launcher listening at ``address:port`` answers a ``GET /ping`` now: ``alive``;
    ``gone`` (its host refuses the connection: nothing listens there, the host is up; or what
    answers is not a launcher of this job: the token is refused); ``frozen`` (its host takes the
    connection, the launcher does not answer within ``timeout``: stopped, or starved); or
    ``unreachable`` (nothing answers the connection within ``timeout``: the host is down, or the
    link to it). A stopped process's socket still takes connections (the kernel answers), so only
    the request's answer says that the launcher itself runs. At most ``2 * timeout``."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "unreachable"
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", "/ping", headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        reply.read()
    except ConnectionError:  # reset: the launcher died as it was asked
        return "gone"
    except (OSError, http.client.HTTPException):
        return "frozen"
    finally:
        conn.close()
    return "alive" if reply.status == 200 else "gone"


@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    node: int
    """torchrun's node rank (``--node-rank``)."""
    host: str
    address: str
    """Where the other nodes reach this node's launcher (the address it reaches node 0 from)."""
    port: int
    """Its launcher's event port (0: it receives nothing)."""
    token: str
    """What a request to that port must carry."""
    ranks: tuple[int, ...]
    """The global ranks this node runs."""
    pid: int
    dump_dir: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo | None:
        """The record, or None where the key holds anything else."""
        try:
            data = json.loads(raw)
            info = cls(
                node=int(data["node"]),
                host=str(data["host"]),
                address=str(data["address"]),
                port=int(data["port"]),
                token=str(data["token"]),
                ranks=tuple(int(r) for r in data["ranks"]),
                pid=int(data["pid"]),
                dump_dir=str(data["dump_dir"]),
            )
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        return info

    def describe(self) -> str:
        """``node1 (ranks 2-3)``."""
        return f"{self.host} ({span(self.ranks)})"


def span(ranks: Any) -> str:
    """``rank 3``, ``ranks 2-3``, ``ranks 0, 2``, ``ranks 0-516, 518-1023``: runs as ranges, so
    that 1,023 ranks are a few words."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return "ranks " + ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


class NodeBoard:
    """The node keys of one job's store (one torchrun attempt)."""

    def __init__(self, store: Any, attempt: int) -> None:
        self.store = store
        self.attempt = attempt

    def _key(self, node: int) -> str:
        return f"{_NODE}/{self.attempt}/{node}"

    def publish(self, info: NodeInfo) -> None:
        self.store.set(self._key(info.node), info.to_json())

    def nodes(self, count: int) -> dict[int, NodeInfo]:
        """The nodes of ``0..count-1`` that have published, by node rank."""
        out = {}
        for node in range(count):
            key = self._key(node)
            if self.store.check([key]):
                info = NodeInfo.from_json(self.store.get(key))
                if info is not None and info.node == node:
                    out[node] = info
        return out

    def beat(self, node: int) -> int:
        return int(self.store.add(f"{self._key(node)}/beat", 1))

    def end(self, node: int, how: str) -> None:
        self.store.set(f"{self._key(node)}/ended", how)

    def ended(self, node: int) -> bool:
        return bool(self.store.check([f"{self._key(node)}/ended"]))

    def beats(self, nodes: list[int]) -> dict[int, int]:
        """Each node's beat counter now (adding 0 reads it in one round trip)."""
        return {node: int(self.store.add(f"{self._key(node)}/beat", 0)) for node in nodes}
