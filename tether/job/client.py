"""Reaching a running job from outside its workers: its store, and one alarm round trip.

The job's store is torchrun's TCPStore (on node 0), or, with ``--store etcd://...``, the job's
keys in an etcd cluster (:class:`StoreAddress` says which). The launcher (before it tears the
workers down) and ``tether dump`` both connect to it as plain clients, raise an alarm
(:meth:`~tether.job.alarm.AlarmBoard.raise_alarm`) that every rank's responder answers by
dumping, and wait, bounded, for the ranks' done keys.
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tether._exceptions import StoreUnreachableError
from tether.job.alarm import DUMPED, Alarm, AlarmBoard, first_line, raw_store
from tether.job.etcd import etcd_store, parse_endpoints

__all__ = [
    "CONNECT_TIMEOUT_S",
    "AlarmRound",
    "StoreAddress",
    "await_answers",
    "connect",
    "live_ranks",
    "mark_exited",
]

CONNECT_TIMEOUT_S = 5.0
"""How long a client keeps trying to reach the job's store (also bounds each store call)."""
_POLL_S = 0.1


def connect(host: str, port: int, *, timeout: float = CONNECT_TIMEOUT_S) -> Any:
    """A client of the job's TCPStore at ``host:port``."""
    import torch.distributed as dist

    # A plain TCP connection first: the TCPStore client retries a refused connection until its
    # timeout, twice, logging a C++ backtrace each time; an ended job should fail at once.
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise StoreUnreachableError(
            f"nothing answers at the job's store address {host}:{port} "
            f"({exc.strerror or exc}); the job has ended, or this host cannot reach it"
        ) from exc
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]  # not re-exported in the stubs
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError, DistStoreError
        raise StoreUnreachableError(
            f"the job's store at {host}:{port} did not answer within {timeout:g}s "
            f"({first_line(exc)}); the job has ended, or this host cannot reach it"
        ) from exc


@dataclasses.dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a job's store is: torchrun's TCPStore at ``host:port``, unless ``etcd`` names an
    etcd cluster (``etcd://h1:2379,...``) that keeps the job's keys under ``prefix`` (the TCPStore
    then serves only the start: torchrun's rendezvous, and agreeing on that prefix)."""

    host: str
    port: int
    etcd: str = ""
    prefix: str = ""

    def __str__(self) -> str:
        return self.etcd or f"{self.host}:{self.port}"

    @property
    def ports(self) -> set[int]:
        """The ports a client of the job's store connects to (a communicator's connections are
        told apart from the store's by them)."""
        return (
            {self.port, *(port for _, port in parse_endpoints(self.etcd))}
            if self.etcd
            else {self.port}
        )

    def connect(self, *, timeout: float = CONNECT_TIMEOUT_S) -> Any:
        """A client of the job's store; ``timeout`` bounds each call."""
        if self.etcd:
            return etcd_store(self.etcd, prefix=self.prefix, timeout=timeout)
        return connect(self.host, self.port, timeout=timeout)

    @classmethod
    def agree(
        cls, tcp: Any, *, host: str, port: int, etcd: str, job_id: str, attempt: int
    ) -> StoreAddress:
        """The job's store, with everyone who asks through the same TCPStore (``tcp``: the
        launchers and the workers of one start) agreeing on one fresh etcd prefix: the first
        to ask draws it. A job's keys never meet an earlier job's of the same name."""
        if not etcd:
            return cls(host, port)
        drawn = f"/tether/{job_id or 'job'}/{secrets.token_hex(6)}/"
        got = raw_store(tcp).compare_set(f"tether/etcd_prefix/{attempt}", "", drawn)
        return cls(host, port, etcd=etcd, prefix=got.decode() if isinstance(got, bytes) else got)


@dataclasses.dataclass(frozen=True, slots=True)
class AlarmRound:
    """What one alarm achieved: who answered (rank -> what it did) and who did not."""

    alarm: Alarm
    answered: dict[int, str]
    missing: list[int]


def await_answers(
    store: Any,
    alarm: Alarm,
    ranks: list[int],
    timeout: float,
    *,
    running: Callable[[int], bool] | None = None,
) -> AlarmRound:
    """Wait up to ``timeout`` seconds for ``ranks`` to answer ``alarm``.

    A rank is settled once it wrote its own dump, or once ``running`` says it is gone. A done key
    that a peer set after collecting the rank's stacks (it looked stuck) does not settle it: a
    slow rank is not a stuck one, and the launcher stops it as soon as we return."""
    board = AlarmBoard(store)
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            # Returns once every rank has a done key (or at the deadline), without polling.
            answered = board.wait_done(alarm.epoch, ranks, max(left, 0.0))
            unsettled = [
                r for r in ranks if answered.get(r) != DUMPED and (running is None or running(r))
            ]
            if not unsettled or left <= 0:
                break
            if len(answered) == len(ranks):  # all keys set, some by a peer: poll for the rest
                time.sleep(min(_POLL_S, left))
    except RuntimeError as exc:  # the store went away mid-round (its server ended)
        raise StoreUnreachableError(
            f"lost the job's store while waiting for the ranks ({first_line(exc)})"
        ) from exc
    return AlarmRound(alarm, answered, [r for r in ranks if r not in answered])


def mark_exited(store: Any, alarm: Alarm, rank: int, what: str) -> None:
    """Settle ``rank``'s part of ``alarm`` for a rank that is gone, unless it answered."""
    # compare_set, not AlarmBoard.mark_done: a rank that dumped and then exited keeps "dump".
    # The key is the one alarm.py documents: tether/alarm/<n>/done/<rank>.
    board = AlarmBoard(store)
    board.store.compare_set(f"{board.key(alarm.epoch)}/done/{rank}", "", what)


def live_ranks(store: Any, world_size: int) -> dict[int, dict[str, Any]]:
    """Ranks that joined the job's alarms (published ``tether/proc/<rank>``), with what they
    published (host, pid, ...)."""
    try:
        return AlarmBoard(store).procs(world_size)
    except RuntimeError as exc:
        raise StoreUnreachableError(f"lost the job's store ({first_line(exc)})") from exc
