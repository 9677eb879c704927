"""The recording process group.

torch calls a ``ProcessGroup``'s collectives through virtual methods that a Python subclass can
override (torch's C++ trampoline ``PyProcessGroup``). So one Python subclass sees every operation,
whoever issues it: user code, DDP's C++ reducer, FSDP2, functional collectives and DTensor,
pipelining's p2p. Each override records the call and hands it, unchanged, to an inner plain
``ProcessGroup`` that shares the same backends (gloo, nccl or a third-party one).

Why an inner group rather than ``super()``: the trampoline calls the base implementation with
the GIL held, and gloo's worker thread can need the GIL (to free a finished operation's tensors)
while holding the queue lock that the base implementation waits for: a deadlock. The inner
group's bindings release the GIL, exactly as for an unrecorded group.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch._C._distributed_c10d import ProcessGroup

from tether._log import get_logger
from tether.events.schema import P2P_SEQ_BASE
from tether.recorder import frames
from tether.recorder.ops import OPS, OpSpec, tensors_of
from tether.recorder.ring import COMPLETED, STARTED, Entry, Ring
from tether.recorder.work import WaitReportingWork, reports_completion

__all__ = [
    "GroupRecorder",
    "RecordedGroup",
    "RecordingProcessGroup",
    "backend_type",
    "is_recording",
]


_COALESCED = OpSpec("_end_coalescing", "coalesced", outputs=None, inputs=None)

logger = get_logger(__name__)

_get_ident = threading.get_ident
_time_ns = time.time_ns


class GroupRecorder(Protocol):
    """What a group needs of the recorder that made it (:class:`~tether.recorder.recorder.
    Recorder`, which imports this module to make its groups): where an entry goes as it is
    issued, started and finished."""

    @property
    def stack_depth(self) -> int: ...

    @property
    def ring(self) -> Ring: ...

    @property
    def dirty(self) -> deque[Entry] | None:
        """Entries whose state advanced since the ring file was last written; None where
        nothing needs telling (no ring file, or the native core writes it)."""
        ...

    def save(self, e: Entry) -> None: ...

    def track(self, entry: Entry) -> None: ...

    def finish(self, entry: Entry) -> None: ...


class RecordedGroup:
    """What the recorder knows of one process group, and its sequence counters."""

    def __init__(
        self,
        recorder: GroupRecorder,
        *,
        uid: int,
        name: str,
        desc: str,
        ranks: list[int],
        group_rank: int,
        backends: dict[str, str],
        timeout_ms: int,
    ) -> None:
        self.recorder = recorder
        self.uid = uid
        self.name = name
        self.desc = desc
        self.ranks = ranks
        """Global ranks of the members, in group-rank order."""
        self.group_rank = group_rank
        self.timeout_ms = timeout_ms
        self.backends = backends
        """Backend name per device type ("cpu" -> "gloo")."""
        names = set(backends.values())
        self._single_backend = names.pop() if len(names) == 1 else None
        self.seq = 0
        self.p2p_seq = P2P_SEQ_BASE
        self.op_id = 0
        self.last_started = 0
        self.last_completed = 0
        self.coalescing = False
        self.coalesced_ops: list[Entry] = []
        self.inflight: deque[Entry] = deque()
        """Issued and not yet seen completed, in issue order; drained by ``Recorder.reap``."""
        self.last_done: tuple[Entry, Any] | None = None
        """The operation that finished last, with its work: whether it failed is asked only
        when a dump is written (see ``Recorder.find_failures``)."""
        self.slot = -1
        """The group's slot in the ring file: its creation order among this process's groups."""
        self._reports: dict[str, bool] = {}
        """Per method: whether its works report completion when polled (see ``work.py``)."""
        self.reconfigures: list[dict[str, Any]] = []
        """Each reconfigure of the group (torch 2.14+), oldest first: its ``uuid``, the members'
        global ``ranks``, this process's ``rank`` and when it took effect (``time_ns``): an
        entry created after one and before the next ran on that one's communicator."""

    def regroup(self, *, uuid: int, ranks: list[int], rank: int) -> None:
        """The group was reconfigured: ``rank`` of the members ``ranks``, sequence numbers
        restarting as torch's do. Operations still in flight belong to the communicator before."""
        self.ranks, self.group_rank = ranks, rank
        self.seq = self.op_id = self.last_started = self.last_completed = 0
        self.p2p_seq = P2P_SEQ_BASE
        made = {"uuid": uuid, "ranks": ranks, "rank": rank, "time_ns": _time_ns()}
        self.reconfigures.append(made)

    def _backend_for(self, args: tuple[Any, ...]) -> str:
        """The backend serving this call's device, for groups with one backend per device."""
        device = "cpu"
        for arg in args:
            first = arg if isinstance(arg, torch.Tensor) else None
            while first is None and isinstance(arg, (list, tuple)) and arg:
                arg = arg[0]
                first = arg if isinstance(arg, torch.Tensor) else None
            if first is not None:
                device = first.device.type
                break
        return self.backends.get(device) or next(iter(self.backends.values()), "unknown")

    def begin(self, spec: OpSpec, args: tuple[Any, ...]) -> Entry | None:
        """Record an operation as it is issued (state "scheduled"); None where recording it
        failed (a recorder bug must never fail the user's collective: logged once)."""
        try:  # free when nothing is raised (zero-cost exceptions, CPython 3.11+); no extra call
            if spec.outputs is None or not args:
                outs: tuple[list[Any], list[Any]] = ([], [])
            else:
                outs = tensors_of(args[spec.outputs])
            ins = outs if spec.inputs == spec.outputs else tensors_of(args[spec.inputs])  # type: ignore[index]
            self.op_id += 1
            name = spec.name
            # Inside a coalescing block only its first operation advances a counter: torch numbers
            # the block's operations, and the "coalesced" entry that ends it, alike.
            advance = not self.coalescing or not self.coalesced_ops
            if spec.p2p is None:
                self.seq += advance
            else:
                peer = int(args[1]) if spec.method != "recv_anysource" and len(args) > 1 else -1
                self.p2p_seq += advance
                me = self.group_rank
                name = f"send {me}->{peer}" if spec.p2p == "send" else f"recv {me}<-{peer}"
            entry = Entry(
                self,
                spec,
                f"{self._single_backend or self._backend_for(args)}:{name}",
                self.seq,
                self.p2p_seq,
                self.op_id,
                spec.p2p is not None,
                ins[0],
                ins[1],
                outs[0] if outs is not ins else None,
                outs[1] if outs is not ins else None,
                frames.capture(self.recorder.stack_depth),
                _get_ident(),
                _time_ns(),
            )
            self.recorder.ring.add(entry)
            self.recorder.save(entry)
            if self.coalescing:
                self.coalesced_ops.append(entry)
            return entry
        except Exception as exc:
            _recorder_bug("recording an operation", exc)
            return None

    def start_coalescing(self) -> None:
        self.coalescing = True
        self.coalesced_ops = []

    def end_coalescing(self) -> Entry | None:
        """The entry closing a coalescing block ("<backend>:coalesced"), None if it was empty."""
        ops, self.coalescing, self.coalesced_ops = self.coalesced_ops, False, []
        if not ops:
            return None
        first = ops[0]
        self.op_id += 1
        entry = Entry(
            self,
            _COALESCED,
            f"{first.profiling_name.split(':', 1)[0]}:coalesced",
            first.collective_seq_id,
            first.p2p_seq_id,
            self.op_id,
            first.is_p2p,
            [],
            [],
            None,
            None,
            first.frames,
            _get_ident(),
            _time_ns(),
        )
        self.recorder.ring.add(entry)
        self.recorder.save(entry)
        return entry

    def issued(self, entry: Entry | None, work: Any) -> Any:
        """The backend accepted the operation (state "started"); completion is discovered later.
        Returns the work to hand the user: the backend's own where recording it failed."""
        if entry is None or work is None:
            return work
        try:
            entry.time_started_ns = _time_ns()
            entry.state = STARTED
            if not entry.is_p2p:
                self.last_started = entry.collective_seq_id
            method = entry.spec.method
            reports = self._reports.get(method)
            if reports is None:
                reports = self._reports[method] = reports_completion(work)
            if not reports:
                work = WaitReportingWork(work, lambda: self.recorder.finish(entry))
            entry.work = work
            self.recorder.track(entry)
            dirty = self.recorder.dirty
            if dirty is not None:  # the ring file learns "started" at the watchdog's next pass
                dirty.append(entry)
            return work
        except Exception as exc:
            _recorder_bug("tracking an operation's completion", exc)
            return work

    def refused(self, entry: Entry | None, exc: BaseException) -> None:
        """The backend raised as the operation was issued: it never ran. Its record stays
        "scheduled", with the error, and counts as retired (the dump's ``failed``)."""
        if entry is not None:
            entry.error = f"{type(exc).__name__}: {str(exc)[:300]}"

    def ran(self, entry: Entry | None, call: Any) -> Any:
        """Run ``call``, a synchronous operation with no work (``monitored_barrier``): started as
        it is called, completed when it returns; one that raises stays started."""
        if entry is not None:
            entry.time_started_ns = _time_ns()
            entry.state = STARTED
            if not entry.is_p2p:
                self.last_started = entry.collective_seq_id
            if self.recorder.dirty is not None:
                self.recorder.dirty.append(entry)
        result = call()
        if entry is not None:
            self.completed(entry, _time_ns())
        return result

    def completed(self, entry: Entry, now_ns: int) -> None:
        entry.time_completed_ns = now_ns  # first: a ring-file write reading "completed" has it
        entry.state = COMPLETED
        self.last_done = (entry, entry.work)
        entry.work = None
        if not entry.is_p2p and entry.collective_seq_id > self.last_completed:
            self.last_completed = entry.collective_seq_id
        dirty = self.recorder.dirty
        if dirty is not None:  # the ring file learns it at the watchdog's next pass
            dirty.append(entry)

    def config(self) -> dict[str, str]:
        return {"name": self.name, "desc": self.desc, "ranks": str(self.ranks)}

    def status(self) -> dict[str, int]:
        return {
            "last_enqueued_collective": self.seq,
            "last_started_collective": self.last_started,
            "last_completed_collective": self.last_completed,
        }


_bugs_seen: set[str] = set()


def _recorder_bug(what: str, exc: Exception) -> None:
    """Log a recorder failure once per kind; the operation goes on unrecorded."""
    if what not in _bugs_seen:
        _bugs_seen.add(what)
        logger.error("%s failed; the operation runs on unrecorded", what, exc_info=exc)


class _Unattached:
    """Stands in until the group is registered with the recorder (during its construction)."""

    def begin(self, spec: OpSpec, args: tuple[Any, ...]) -> Entry | None:
        return None

    def issued(self, entry: Entry | None, work: Any) -> Any:
        return work

    def refused(self, entry: Entry | None, exc: BaseException) -> None:
        pass

    def ran(self, entry: Entry | None, call: Any) -> Any:
        return call()

    def start_coalescing(self) -> None:
        pass

    def end_coalescing(self) -> None:
        return None


class _SameClassChecks(type(ProcessGroup)):  # type: ignore[misc]
    """``isinstance(x, RecordingProcessGroup)`` behaves like ``isinstance(x, ProcessGroup)``.

    torch's group-creation code names the class it constructs and the class it checks against
    with one module-level name; we point that name at our subclass, and its checks must still
    accept plain process groups (from ``split_group``, or from plugins that return one)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, ProcessGroup)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, ProcessGroup)


def is_recording(pg: Any) -> bool:
    return type(pg) is RecordingProcessGroup and not isinstance(pg._tether, _Unattached)


_O = OPS


class RecordingProcessGroup(ProcessGroup, metaclass=_SameClassChecks):
    """A ``ProcessGroup`` whose every collective and p2p operation is recorded."""

    _tether: RecordedGroup | _Unattached = _Unattached()

    def __init__(self, store: Any, rank: int, size: int) -> None:
        # torch's (store, rank, size) constructor cannot build a Python subclass; this one can.
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._tether_store = store
        self._inner = ProcessGroup(store, rank, size)

    def get_group_store(self) -> Any:
        return self._tether_store

    # torch configures the group it built through these; the inner group must match.
    def _register_backend(self, *args: Any) -> None:
        super()._register_backend(*args)
        self._inner._register_backend(*args)

    def _set_default_backend(self, *args: Any) -> None:
        super()._set_default_backend(*args)
        self._inner._set_default_backend(*args)

    def _set_group_name(self, *args: Any) -> None:
        super()._set_group_name(*args)
        self._inner._set_group_name(*args)

    def _set_group_desc(self, *args: Any) -> None:
        super()._set_group_desc(*args)
        self._inner._set_group_desc(*args)

    @property
    def bound_device_id(self) -> Any:
        return self._inner.bound_device_id

    @bound_device_id.setter
    def bound_device_id(self, device: Any) -> None:
        ProcessGroup.bound_device_id.fset(self, device)  # type: ignore[attr-defined]
        self._inner.bound_device_id = device

    # A group derived from this one (torch's split_group, merge_remote_group) is the inner
    # group's child: the inner group holds the store torch's C++ clones for it (the (rank, size)
    # constructor leaves this one's unset). The child is handed out recordable like any group
    # (tether/recorder/patch.py records it as torch registers it).
    def split_group(self, *args: Any, **kwargs: Any) -> Any:
        return RecordingProcessGroup.around(self._inner.split_group(*args, **kwargs))

    def merge_remote_group(self, *args: Any, **kwargs: Any) -> Any:
        return RecordingProcessGroup.around(self._inner.merge_remote_group(*args, **kwargs))

    @classmethod
    def around(cls, pg: Any) -> Any:
        """A recording group over ``pg``, a plain group torch built (None stays None: not a
        member)."""
        if pg is None:
            return None
        outer = cls.__new__(cls)
        ProcessGroup.__init__(outer, pg.rank(), pg.size())  # type: ignore[call-arg]
        outer._tether_store = pg.get_group_store()
        outer._inner = pg
        types = []
        for device in pg._device_types:
            backend = pg._get_backend(device)
            types.append(backend_type(backend))
            ProcessGroup._register_backend(outer, device, types[-1], backend)
        if types:
            ProcessGroup._set_default_backend(outer, types[0])
        ProcessGroup._set_group_name(outer, pg.group_name)
        ProcessGroup._set_group_desc(outer, pg.group_desc)
        return outer

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        e = self._tether.begin(_O["monitored_barrier"], args)
        call = self._inner.monitored_barrier  # type: ignore[attr-defined]
        return self._tether.ran(e, lambda: call(*args, **kwargs))

    def _start_coalescing(self, *args: Any, **kwargs: Any) -> Any:
        self._tether.start_coalescing()
        return self._inner._start_coalescing(*args, **kwargs)

    def _end_coalescing(self, *args: Any, **kwargs: Any) -> Any:
        e = self._tether.end_coalescing()
        return self._tether.issued(e, self._inner._end_coalescing(*args, **kwargs))


def backend_type(backend: Any) -> Any:
    """torch's ``BackendType`` for a backend object (by its name; CUSTOM for a third party's)."""
    types = ProcessGroup.BackendType.__members__
    return types.get(str(backend.name()).upper(), ProcessGroup.BackendType.CUSTOM)


def _recorded(name: str) -> Callable[..., Any]:
    """The recording override of ``ProcessGroup.<name>``: recorded as issued, handed to the inner
    group, its work tracked; an operation the backend refuses as it is issued (it raises) keeps
    its record, with the error. (A ``try`` costs nothing until something raises, CPython 3.11+.)"""
    spec = _O[name]

    def method(self: RecordingProcessGroup, *args: Any, **kwargs: Any) -> Any:
        e = self._tether.begin(spec, args)
        try:
            work = getattr(self._inner, name)(*args, **kwargs)
        except Exception as exc:
            self._tether.refused(e, exc)
            raise
        return self._tether.issued(e, work)

    method.__name__ = method.__qualname__ = name
    return method


# Every operation with a work to track, recorded alike (torch's trampoline finds them by name).
_RECORDED = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "all_gather_single", "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "alltoall", "all_to_all_single", "barrier", "send", "recv",
    "recv_anysource",
)  # fmt: skip
for _name in _RECORDED:
    setattr(RecordingProcessGroup, _name, _recorded(_name))
