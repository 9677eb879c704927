"""Simulated ranks for rank 0's cluster view at scale: the debug servers of a job of many ranks
(``/health`` and ``/metrics``, each rank on a port of its own, as a real rank serves them), all
in one child process on asyncio, so that 1,024 of them cost one process and no torch.

The job they describe has hung: every rank waits in collective #4 of the world group except the
``culprit``, whose last collective is #3; a rank of ``silent`` accepts connections and never
answers, as a rank stuck holding the GIL. Ranks are ``per_node`` to a host named
``sim-node<k>``. The reports have the shape and size of a real rank's (the world group lists its
1,024 members in every rank's report).

Run as ``python -m tether.testing.fleet '<json config>'``: it prints one line, the JSON list of
each rank's port (rank 0 excluded: that is the process under test), and serves until stdin
closes. :class:`RankFleet` does that for a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = [
    "FleetSpec",
    "RankFleet",
    "RankSource",
    "host_of",
    "synthetic_health",
    "synthetic_metrics",
]

HANG_SEQ = 4
"""The collective every rank but the culprit waits in."""
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "barrier")
START_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSpec:
    world: int
    per_node: int = 16
    culprit: int | None = None
    silent: tuple[int, ...] = ()


def host_of(rank: int, per_node: int) -> str:
    return f"sim-node{rank // per_node:04d}"


def synthetic_health(spec: FleetSpec, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ``/health`` in the hung job ``spec`` describes."""
    late = rank == spec.culprit
    waiting = [
        {
            "record_id": 40 + rank % 7,
            "op": "gloo:all_reduce",
            "group": "0",
            "group_desc": "default_pg",
            "collective_seq_id": HANG_SEQ,
            "state": "started",
            "age_s": 42.0,
        }
    ]
    return {
        "rank": rank,
        "world_size": spec.world,
        "host": host_of(rank, spec.per_node),
        "pid": 10_000 + rank,
        "healthy": late,
        "hung": None if late else waiting[0],
        "hang_timeout_s": 30.0,
        "watchdog_heartbeat_age_s": 0.05,
        "in_flight": [] if late else waiting,
        "groups": {
            "0": {
                "desc": "default_pg",
                "ranks": list(range(spec.world)),
                "last_enqueued_collective": HANG_SEQ - 1 if late else HANG_SEQ,
                "last_completed_collective": HANG_SEQ - 1,
            }
        },
    }


class _Metrics(Collector):
    def __init__(self, spec: FleetSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank

    def collect(self) -> Iterator[Metric]:
        rank, late = str(self.rank), self.rank == self.spec.culprit
        recorded = CounterMetricFamily(
            "tether_operations_recorded",
            "Operations recorded, by group and op.",
            labels=["rank", "group", "group_desc", "op"],
        )
        for group, desc in (("0", "default_pg"), (f"{self.rank // 8 + 1}", "tp")):
            for op in OPS:
                recorded.add_metric([rank, group, desc, op], 1000 + self.rank % 3)
        yield recorded
        for name, value in (
            ("tether_operations_in_flight", 0 if late else 1),
            ("tether_oldest_in_flight_seconds", 0.0 if late else 42.0 + self.rank % 5),
            ("tether_healthy", int(late)),
        ):
            gauge = GaugeMetricFamily(name, f"{name}.", labels=["rank"])
            gauge.add_metric([rank], value)
            yield gauge


def synthetic_metrics(spec: FleetSpec, rank: int) -> bytes:
    """Rank ``rank``'s ``/metrics``: the families a real rank serves, a few of each."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Metrics(spec, rank))
    return generate_latest(registry)


def _answer(spec: FleetSpec, rank: int, target: bytes) -> bytes:
    if target.startswith(b"/health"):
        body, kind = json.dumps(synthetic_health(spec, rank)).encode(), b"application/json"
    elif target.startswith(b"/metrics"):
        body, kind = synthetic_metrics(spec, rank), b"text/plain; version=0.0.4"
    else:
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close"
    return head % (kind, len(body)) + b"\r\n\r\n" + body


async def _serve(spec: FleetSpec) -> None:
    # A socket per rank and one per connection: past the usual soft limit of 1,024 files.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ports = []
    for rank in range(1, spec.world):

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rank: int = rank
        ) -> None:
            try:
                request = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                if rank in spec.silent:
                    await reader.read()  # until the client gives up
                    return
                parts = request.split()
                writer.write(_answer(spec, rank, parts[1] if len(parts) > 1 else b""))
                await writer.drain()
            except OSError:
                pass  # the client hung up
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=128)
        ports.append(server.sockets[0].getsockname()[1])
    print(json.dumps(ports), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    # At once: ending the loop would cancel every open connection's task, each with a traceback.
    os._exit(0)


class RankSource:
    """What rank ``rank`` of ``spec``'s job gives its debug server (rank 0: the process under
    test serves it, the fleet the others)."""

    def __init__(self, spec: FleetSpec, rank: int = 0) -> None:
        self.spec, self.rank = spec, rank

    def health(self) -> dict[str, Any]:
        return synthetic_health(self.spec, self.rank)

    def metrics(self) -> str:
        return synthetic_metrics(self.spec, self.rank).decode()


class RankFleet:
    """Ranks 1..world-1 of a simulated hung job, served by a child process; a context
    manager. :attr:`urls` maps each rank to its debug server."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.urls: dict[int, str] = {}
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> RankFleet:
        config = json.dumps(dataclasses.asdict(self.spec))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tether.testing.fleet", config],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = _read_line(self._proc, START_TIMEOUT_S)
            ports = json.loads(line)
        except Exception:
            self.close()
            raise
        self.urls = {rank: f"http://127.0.0.1:{port}" for rank, port in enumerate(ports, 1)}
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line, or why there is none within ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""  # the child prints it whole, at once
    if not line:
        raise RuntimeError(f"the simulated ranks did not start within {timeout:.0f} s")
    return line


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    spec = FleetSpec(**{**fields, "silent": tuple(fields.get("silent", ()))})
    asyncio.run(_serve(spec))
