"""The per-process recorder: the ring, the groups, and what is in flight.

Completion is discovered by polling in-flight ``Work`` objects from the watchdog thread, the way
torch's NCCL watchdog polls CUDA events. A completion callback would run Python on the backend's
own worker threads and make them queue for the GIL behind the training loop.

Each group keeps its in-flight operations in a queue in issue order, drained from the front up to
the first operation still running. The thread that issues an operation first drains its group's
queue: by then the previous operation has usually finished (a synchronous one certainly has), and
that thread polls it with warm caches and without waiting for the GIL. The watchdog drains what is
left, but only heads older than its polling period, so a healthy job costs it nothing per
operation. The hang check needs only the heads, since a group's oldest operation is its queue's
front. A head that stays stuck while operations pile up behind it (an ``irecv`` posted early, say)
is parked on a short list polled whole, so the queue behind it still drains.

A finished work may have failed (a peer died mid-collective). Asking costs about 2 µs (the
backend's future must be read), too much for every operation, so each group keeps its last
finished work and a dump asks it: a failure that ends a rank is its group's last operation.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from typing import Any

from tether.config import Config
from tether.recorder.group import RecordedGroup
from tether.recorder.ring import COMPLETED, STARTED, Entry, Ring
from tether.recorder.work import WaitReportingWork

__all__ = ["Recorder"]

PARK_AFTER = 32
"""Operations queued behind a stuck head before the head is parked."""


class Recorder:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stack_depth = config.stack_depth
        self.ring = Ring(config.ring_size)
        self.groups: dict[str, RecordedGroup] = {}
        self.global_rank = -1
        self.world_size = -1
        self.clock_offset_ns = 0
        """Add to this process's ``time.time_ns()`` to get rank 0's clock (estimated at init)."""
        self.clock_error_ns = 0
        self.store: Any = None
        """The default group's store: where ranks agree on dump event ids."""
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._queues: list[deque[Entry]] = []
        """In-flight operations, one queue per group ever created, each in issue order."""
        self._parked: list[Entry] = []
        self._reap_lock = threading.Lock()
        self.suspicion: dict[int, Entry] = {}
        """Entries kept past ring eviction because their group looked stuck."""
        self._lock = threading.Lock()

    # -- groups -----------------------------------------------------------------------------
    def add_group(
        self,
        *,
        name: str,
        desc: str,
        ranks: list[int],
        group_rank: int,
        backends: dict[str, str],
        timeout_ms: int,
    ) -> RecordedGroup:
        with self._lock:
            group = RecordedGroup(
                self,
                uid=len(self.groups),
                name=name,
                desc=desc,
                ranks=ranks,
                group_rank=group_rank,
                backends=backends,
                timeout_ms=timeout_ms,
            )
            # A destroyed group's name can be reused by a new group; the old entries keep
            # pointing at the old object, so their metadata stays right.
            self.groups[name] = group
            self._queues.append(group.inflight)
        return group

    # -- completion tracking ----------------------------------------------------------------
    def track(self, entry: Entry) -> None:
        """Queue ``entry`` (just issued) after draining what finished before it in its group."""
        queue = entry.group.inflight
        # Never wait here: a watchdog pass holding the lock drains this queue anyway.
        if queue and self._reap_lock.acquire(blocking=False):
            try:
                self._drain(queue, entry.time_started_ns, min_age_ns=0)
            finally:
                self._reap_lock.release()
        queue.append(entry)  # deque.append is atomic

    def finish(self, entry: Entry) -> None:
        """Mark ``entry`` completed now (for works that report completion only through wait)."""
        if entry.state is not COMPLETED:
            entry.group.completed(entry, time.time_ns())

    def reap(self, *, min_age_ns: int = 0) -> None:
        """Mark finished operations completed: each group's queue up to its first running
        operation or its first one younger than ``min_age_ns``, and every parked one."""
        now = time.time_ns()
        with self._reap_lock:
            for queue in self._queues[:]:  # slicing is atomic; a group may be added meanwhile
                self._drain(queue, now, min_age_ns=min_age_ns)
            if self._parked:
                self._parked = [e for e in self._parked if not self._poll(e, now)]

    def _drain(self, queue: deque[Entry], now_ns: int, *, min_age_ns: int) -> None:
        """Pop ``queue``'s finished front (the caller holds ``_reap_lock``)."""
        while queue:
            head = queue[0]
            if now_ns - head.time_created_ns < min_age_ns:
                return
            if not self._poll(head, now_ns):
                if len(queue) <= PARK_AFTER:
                    return
                self._parked.append(head)
            queue.popleft()

    def inflight(self) -> list[Entry]:
        """Every operation still in flight, oldest record first; polls each of them."""
        now = time.time_ns()
        with self._reap_lock:
            pending = [e for q in self._queues[:] for e in q.copy()] + self._parked
            running = [e for e in pending if not self._poll(e, now)]
        return sorted(running, key=lambda e: e.record_id)

    def oldest_inflight(self) -> Entry | None:
        """The oldest operation not known to be completed (cheap: looks at queue heads only)."""
        oldest: Entry | None = None
        for queue in self._queues[:]:
            try:
                head = queue[0]
            except IndexError:  # emptied by a concurrent reap
                continue
            if oldest is None or head.time_created_ns < oldest.time_created_ns:
                oldest = head
        for entry in self._parked[:]:
            if oldest is None or entry.time_created_ns < oldest.time_created_ns:
                oldest = entry
        return oldest

    @staticmethod
    def _poll(entry: Entry, now_ns: int) -> bool:
        """Whether ``entry`` has finished; marks it completed the first time it is seen so."""
        if entry.state is COMPLETED:
            return True
        work = entry.work
        if type(work) is WaitReportingWork:
            return False  # finished by its wait()
        try:
            done = work is None or bool(work.is_completed())
        except Exception:  # a failed work is finished too; its error is the caller's
            done = True
        if done:
            entry.group.completed(entry, now_ns)
        return done

    def find_failures(self) -> None:
        """Mark each group's last finished operation failed if its backend says so."""
        for group in list(self.groups.values()):
            last = group.last_done
            if last is None or last[1] is None:
                continue
            entry, work = last
            try:
                future = work.get_future()
                done = bool(future.done())
            except Exception:  # a backend without futures cannot say: leave it completed
                group.last_done = None
                continue
            if not done:
                continue  # not settled yet: kept for the next dump to ask again
            if group.last_done is last:  # not replaced meanwhile by a newer finished one
                group.last_done = None
            try:
                future.value()
            except Exception as exc:  # the operation's own error: what the dump should say
                entry.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                entry.state = STARTED
                entry.time_completed_ns = 0

    def suspect(self, group: RecordedGroup) -> None:
        """Keep ``group``'s entries now in the ring, so traffic on other groups cannot push
        them out before a dump."""
        kept = {e.record_id: e for e in self.ring.snapshot() if e.group is group}
        self.suspicion.update(kept)
