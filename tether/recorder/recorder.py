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
from pathlib import Path
from typing import Any

import torch

from tether._log import get_logger
from tether.config import Config
from tether.events.ringfile import STATES, Fixed, RingFile
from tether.events.ringfile import fixed as fixed_part
from tether.recorder.group import RecordedGroup
from tether.recorder.ops import dtype_name
from tether.recorder.ring import COMPLETED, SCHEDULED, STARTED, Entry, Ring
from tether.recorder.work import WaitReportingWork, failed, future_done

__all__ = ["Recorder"]

logger = get_logger(__name__)

PARK_AFTER = 32
"""Operations queued behind a stuck head before the head is parked."""
_FIXED_KINDS = 4096
"""Kinds of operation whose record parts are cached (a job has tens; the cache then restarts)."""
_STATE = {state: i for i, state in enumerate(STATES)}  # the ring file's state codes
_SETTLE_ROUNDS = 8


def _side(shapes: list[Any], dtypes: list[Any]) -> list[tuple[list[int], str]]:
    return [(list(s), dtype_name(d)) for s, d in zip(shapes, dtypes, strict=False)]


class Recorder:
    native = False
    """Whether the native core records (:class:`~tether.recorder.native.NativeRecorder`)."""
    _group_class = RecordedGroup

    def __init__(self, config: Config, *, ring_path: Path | None = None) -> None:
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
        self.by_slot: list[RecordedGroup] = []
        """Every group ever created, by its slot (its creation order)."""
        self._parked: list[Entry] = []
        self._reap_lock = threading.Lock()
        self.suspicion: dict[int, Entry] = {}
        """Entries kept past ring eviction because their group looked stuck."""
        self._lock = threading.Lock()
        self.ring_file = self._open_ring_file(ring_path, config.ring_size)
        """Where the ring outlives this process (:mod:`tether.events.ringfile`)."""
        own = self.ring_file if not self.native else None  # the native core writes its own
        self._file_write = own.write if own is not None else None
        self.dirty: deque[Entry] | None = (
            deque(maxlen=2 * config.ring_size) if own is not None else None
        )
        """Entries whose state advanced (started, completed) since :meth:`flush` last ran: the
        Python recorder writes each record as it is issued (:meth:`save`), the rest there."""
        self._flush_lock = threading.Lock()
        self._fixed: dict[tuple[Any, ...], Fixed] = {}
        """Each kind of operation's unchanging record part (names, shapes, dtypes), so a write
        packs only the counters and times (a record costs the issuing thread about 1 µs)."""

    def _open_ring_file(self, path: Path | None, capacity: int) -> RingFile | None:
        if path is None:
            return None
        try:
            return RingFile(path, capacity, host=self.host, pid=self.pid)
        except OSError as exc:  # a full disk, say: recording goes on, in memory only
            logger.warning(
                "no ring file at %s (%s): this process records, but a death by a signal will "
                "leave no record of it",
                path,
                exc.strerror or exc,
            )
            return None

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
            self._new_slot(group_rank, len(self.by_slot))
            group = self._group_class(
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
            group.slot = len(self._queues)
            self._queues.append(group.inflight)
            self.by_slot.append(group)
            self._describe_group(group)
        return group

    def _new_slot(self, group_rank: int, slot: int) -> None:
        """A group is being created in ``slot`` (the caller holds ``_lock``)."""

    def _describe_group(self, group: RecordedGroup) -> None:
        if self.ring_file is not None:
            self.ring_file.add_group(
                group.slot,
                uid=group.uid,
                name=group.name,
                desc=group.desc,
                ranks=str(group.ranks),
                group_rank=group.group_rank,
                timeout_ms=group.timeout_ms,
            )

    def identify(self) -> None:
        """The default group formed: the ring file learns this process's rank."""
        if self.ring_file is not None:
            self.ring_file.identify(
                rank=self.global_rank,
                world_size=self.world_size,
                clock_offset_ns=self.clock_offset_ns,
                job_id=self.config.job_id,
                torch_version=torch.__version__,
                hang_timeout_s=float(self.config.hang_timeout),
            )

    def recording_backend(self, pg: Any) -> Any:
        """The native core's recording backend over ``pg``; None here (the Python recorder's
        groups record in Python)."""
        return None

    def save(self, e: Entry) -> None:
        """Write ``e``'s record to the ring file now, on the thread issuing it and before the
        backend sees it: a backend that aborts the process inside the call leaves it behind."""
        write = self._file_write
        if write is None:  # no ring file, or the native core writes it
            return
        # A new record: scheduled, neither started nor completed. No lock: see flush().
        write(0, e.is_p2p, e.record_id, e.group.slot, e.collective_seq_id, e.p2p_seq_id,
              e.op_id, e.thread_id, e.time_created_ns, 0, 0, self._fixed_of(e))  # fmt: skip
        e.filed = SCHEDULED
        at = e.record_id % self.ring.capacity
        if self.ring._slots[at] is not e:  # other threads went round a small ring meanwhile
            self._settle(write, at)

    def flush(self) -> None:
        """Rewrite the records of entries whose state advanced since the last call. The
        watchdog calls it every pass, so a completion reaches the file within one pass."""
        dirty, write = self.dirty, self._file_write
        if dirty is None or write is None:
            return
        slots, capacity = self.ring._slots, self.ring.capacity
        # Flushes take turns: once one returns, every entry dirty when it was called is written.
        with self._flush_lock:
            while dirty:
                e = dirty.popleft()
                at = e.record_id % capacity
                # Queued once as started, once as completed: most are completed by now, and
                # written once. A slot holding a newer record had it written when issued.
                if slots[at] is e and e.filed is not e.state:
                    self._rewrite(write, e)
                    if slots[at] is not e:
                        self._settle(write, at)

    def _settle(self, write: Any, at: int) -> None:
        """A newer record took slot ``at`` while an older one was being written there, and may
        have been written before that store landed: write the slot's record again until it is
        still the slot's after the store (each store is one record whole, so the last one
        standing is the newest). Bounded: each round means another thread went round the ring."""
        slots = self.ring._slots
        for _ in range(_SETTLE_ROUNDS):
            now = slots[at]
            if now is None:
                return
            self._rewrite(write, now)
            if slots[at] is now:
                return

    def _rewrite(self, write: Any, e: Entry) -> None:
        state = e.state  # read once: a later change is queued again, for the next flush
        completed_ns = e.time_completed_ns
        # A failed operation is filed as still started, as a dump shows it: a rank that dies of
        # its failure (a peer's death) must not look, recovered, as if it had completed. Only a
        # group's last finished operation can have failed unnoticed, so only it is asked.
        last = e.group.last_done
        if state is COMPLETED and last is not None and last[0] is e and failed(last[1]):
            state, completed_ns = STARTED, 0
        write(
            _STATE[state], e.is_p2p, e.record_id, e.group.slot, e.collective_seq_id,
            e.p2p_seq_id, e.op_id, e.thread_id, e.time_created_ns, e.time_started_ns,
            completed_ns, self._fixed_of(e),
        )  # fmt: skip
        e.filed = e.state

    def _fixed_of(self, e: Entry) -> Fixed:
        if e.fixed is not None:
            return e.fixed
        # One flat tuple (shapes are torch.Size, dtypes torch.dtype: the split is unambiguous),
        # built in one step: half the cost of nesting tuples.
        outs = e.out_shapes
        if outs is None:
            key: tuple[Any, ...] = (e.profiling_name, *e.in_shapes, *e.in_dtypes)
        else:
            key = (e.profiling_name, *e.in_shapes, *e.in_dtypes, None, *outs, *(e.out_dtypes or ()))
        got = self._fixed.get(key)
        if got is None:
            if len(self._fixed) >= _FIXED_KINDS:
                self._fixed.clear()
            outputs = None if outs is None else _side(outs, e.out_dtypes or [])
            got = fixed_part(e.profiling_name, _side(e.in_shapes, e.in_dtypes), outputs)
            self._fixed[key] = got
        e.fixed = got
        return got

    def close(self, *, clean: bool) -> None:
        """Stop writing the ring file; a clean exit removes it (after a failure it stays, for
        the launcher to recover)."""
        if self.ring_file is not None:
            self.flush()
            self._file_write = None  # operations issued from now on (at exit) are not written
            self.ring_file.close(remove=clean)

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
            done = work is None or bool(work.is_completed()) or future_done(work)
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

    def entries(self) -> list[Entry]:
        """What a dump holds, oldest first: the ring's entries, the operations still in flight
        that newer ones pushed out of it (an operation leaves a dump only once it completed:
        the one a hang is about must be there however busy other groups are), and those kept
        past eviction because their group looked stuck."""
        entries = self.ring.snapshot()
        first = entries[0].record_id if entries else 0
        pending = [e for q in self._queues[:] for e in q.copy()] + self._parked[:]
        evicted = {e.record_id: e for e in pending if e.record_id < first}
        if self.suspicion or evicted:
            kept = {e.record_id: e for e in entries} | self.suspicion | evicted
            entries = sorted(kept.values(), key=lambda e: e.record_id)
        return entries

    def suspect(self, group: RecordedGroup) -> None:
        """Keep ``group``'s entries now in the ring, so traffic on other groups cannot push
        them out before a dump."""
        kept = {e.record_id: e for e in self.ring.snapshot() if e.group is group}
        self.suspicion.update(kept)
