"""Eager group formation: a handshake through the group's store when a group is created.

Backends connect lazily, so a rank that never arrives normally shows up as a hang at the first
collective, with nothing naming it. Here every member announces itself and waits for the others
within the group's timeout; the error names the ranks that did not come. The default group's
handshake also estimates each rank's clock offset to rank 0.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Any

from tether._exceptions import GroupFormationError

__all__ = ["Formation", "form_group"]


@dataclasses.dataclass(frozen=True, slots=True)
class Formation:
    clock_offset_ns: int
    """Rank 0's clock minus ours, estimated; 0 on rank 0."""
    clock_error_ns: int
    """Half the store round trip that bounds the estimate's error."""


def form_group(
    store: Any,
    *,
    key: str,
    name: str,
    desc: str,
    group_rank: int,
    ranks: list[int],
    timeout: timedelta,
) -> Formation:
    """Announce this rank and wait for every member of the group (raises on timeout).

    ``key`` must be unique to this creation of this group and the same on every member."""
    arrive = [f"{key}/arrive/{r}" for r in range(len(ranks))]
    store.set(arrive[group_rank], str(ranks[group_rank]))
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store.wait(arrive, timeout)
    except Exception as exc:  # TCPStore raises DistStoreError (a RuntimeError) on timeout
        missing = [r for r, key in enumerate(arrive) if not _present(store, key)]
        if not missing:
            raise
        missing_global = [ranks[r] for r in missing]
        raise GroupFormationError(
            f"process group {name!r} ({desc}) was not formed within {timeout}: "
            f"rank(s) {missing_global} never arrived (group ranks {missing}); those processes "
            "did not call the group's creation, or died",
            group_name=name,
            missing_ranks=missing_global,
        ) from exc

    clock = f"{key}/clock"
    if group_rank == 0:
        store.set(clock, str(time.time_ns()))
        return Formation(0, 0)
    remaining = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
    store.wait([clock], remaining)
    t_notified = time.time_ns()
    rank0_ns = int(store.get(clock))
    half_rtt = (time.time_ns() - t_notified) // 2
    return Formation(rank0_ns - t_notified + half_rtt, half_rtt)


def _present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
