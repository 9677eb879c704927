"""Eager group formation: a handshake through the group's store when a group is created.

Backends connect lazily, so a rank that never arrives normally shows up as a hang at the first
collective, with nothing naming it. Here every member announces itself and waits for the others
within the group's timeout; the error names the ranks that did not come.

The default group's handshake also estimates each rank's clock offset to rank 0, which the
analyzer needs to compare arrival times across hosts. Ranks on rank 0's host read the same clock:
their offset is exactly 0. Each rank on another host plays a few rounds of ping-pong with rank 0
through the store, in turn, and keeps the round with the shortest round trip: rank 0's reply time
lies inside that round trip, so half of it bounds the error honestly. (Taking rank 0's time when a
store wait wakes up instead was biased by the wake-up delay, tens of ms on a loaded host.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tether._exceptions import GroupFormationError
from tether._log import get_logger

__all__ = ["Formation", "Late", "form_group"]

logger = get_logger(__name__)

CLOCK_ROUNDS = 3
LOOK_UP_MAX = 64
"""In a group of more members, only its rank 0 looks up who has not arrived, once the creation
is late (one store call per member: at 16k ranks, every member looking would cost 16k**2)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Formation:
    clock_offset_ns: int
    """Rank 0's clock minus ours, estimated; 0 on rank 0."""
    clock_error_ns: int
    """Bound on the estimate's error: half the shortest store round trip; 0 on rank 0's host."""


@dataclasses.dataclass(frozen=True, slots=True)
class Late:
    """A group's creation that outlived the hang timeout on this rank, and who had not come."""

    op: str
    """``init_process_group`` or ``new_group``."""
    group: str
    group_desc: str
    ranks: list[int]
    """The group's global ranks."""
    missing: list[int] | None
    """Its global ranks that had not arrived; None where this rank did not look (a large
    group's members other than its rank 0: each look costs the store a call per member)."""
    rank: int
    """This rank's global rank."""
    since_ns: int
    """When this rank arrived (its clock)."""
    waited_s: float

    def describe(self) -> str:
        """The hang alarm's detail."""
        who = f"rank(s) {self.missing}" if self.missing is not None else "members"
        return (
            f"{self.op} of group {self.group} ({self.group_desc}) waits {self.waited_s:.1f}s on "
            f"rank {self.rank} for {who} that never arrived"
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def form_group(
    store: Any,
    *,
    key: str,
    name: str,
    desc: str,
    group_rank: int,
    ranks: list[int],
    timeout: timedelta,
    host: str,
    clock: bool = False,
    late_after: float = 0.0,
    on_late: Callable[[list[int] | None, float], None] | None = None,
) -> Formation:
    """Announce this rank and wait for every member of the group (raises on timeout); with
    ``clock``, also estimate this rank's clock offset to group rank 0. ``on_late``: called with
    the global ranks still missing (None where not looked up: see :data:`LOOK_UP_MAX`) and the
    seconds waited, once ``late_after`` seconds have passed without them (the wait goes on to
    the group's timeout).

    ``key`` must be unique to this creation of this group and the same on every member."""
    arrive = [f"{key}/arrive/{r}" for r in range(len(ranks))]
    store.set(arrive[group_rank], host)
    deadline = time.monotonic() + timeout.total_seconds()
    watch = None
    if on_late is not None and 0 < late_after < timeout.total_seconds():
        look = group_rank == 0 or len(ranks) <= LOOK_UP_MAX
        watch = _LateWatch(store, arrive, ranks, late_after, on_late, look=look)
        watch.start()
    try:
        # One wait for the whole timeout: a wait that times out makes torch's store print
        # warnings, so the watch, not a shorter wait, tells when the creation is late.
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
    finally:
        if watch is not None:
            watch.stop()

    if not clock:
        return Formation(0, 0)
    hosts = [bytes(v).decode() for v in store.multi_get(arrive)]
    remote = [r for r in range(len(ranks)) if hosts[r] != hosts[0]]
    if group_rank == 0:
        for r, i in ((r, i) for r in remote for i in range(CLOCK_ROUNDS)):
            store.set(f"{key}/turn/{r}/{i}", "")
            store.wait([f"{key}/ping/{r}/{i}"], _left(deadline))
            store.set(f"{key}/pong/{r}/{i}", str(time.time_ns()))
        return Formation(0, 0)
    if group_rank not in remote:
        return Formation(0, 0)  # rank 0's host: the very same clock
    best: Formation | None = None
    for i in range(CLOCK_ROUNDS):
        store.wait([f"{key}/turn/{group_rank}/{i}"], _left(deadline))
        t0 = time.time_ns()
        store.set(f"{key}/ping/{group_rank}/{i}", "")
        store.wait([f"{key}/pong/{group_rank}/{i}"], _left(deadline))
        t3 = time.time_ns()
        rank0_ns = int(store.get(f"{key}/pong/{group_rank}/{i}"))
        estimate = Formation(rank0_ns - (t0 + t3) // 2, (t3 - t0 + 1) // 2)
        if best is None or estimate.clock_error_ns < best.clock_error_ns:
            best = estimate
    assert best is not None
    return best


class _LateWatch:
    """Calls ``on_late`` once, from a thread of its own, if the creation is still waiting
    ``late_after`` seconds after it began; :meth:`stop` ends the watch (and waits out a call
    under way: the creation is over only once what it started has ended)."""

    def __init__(
        self,
        store: Any,
        arrive: list[str],
        ranks: list[int],
        late_after: float,
        on_late: Callable[[list[int] | None, float], None],
        *,
        look: bool,
    ) -> None:
        self._store, self._arrive, self._ranks = store, arrive, ranks
        self._late_after, self._on_late, self._look = late_after, on_late, look
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-formation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._over.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        start = time.monotonic()
        if self._over.wait(self._late_after):
            return
        missing: list[int] | None = None
        if self._look:
            try:
                missing = self._missing()
            except Exception:  # the store cannot say: late all the same, members unnamed
                logger.debug("could not look up who has not arrived", exc_info=True)
            if missing == []:
                return  # everyone came meanwhile
        if not self._over.is_set():
            try:
                self._on_late(missing, time.monotonic() - start)
            except Exception:
                logger.exception("a late creation could not be reported")

    def _missing(self) -> list[int]:
        # A connection of its own: the creating thread's waits on the store's (a TCPStore
        # client answers one call at a time).
        try:
            store = self._store.clone()
        except (AttributeError, RuntimeError):  # an in-process store: safe to share
            store = self._store
        return [self._ranks[r] for r, key in enumerate(self._arrive) if not _present(store, key)]


def _left(deadline: float) -> timedelta:
    """What is left of the group's timeout, never less than a second."""
    return timedelta(seconds=max(deadline - time.monotonic(), 1.0))


def _present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
