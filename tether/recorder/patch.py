"""Turning recording on for every process group torch creates in this process.

torch builds every group (``init_process_group``, ``new_group``, subgroups, DeviceMesh) in
``distributed_c10d._new_process_group_helper``. We wrap the helper to run the formation handshake
and register each new group with the recorder. With the native core
(:mod:`tether.recorder.native`) the group torch built stays torch's own, and its backends are
wrapped in a recording one; with the Python recorder the helper constructs the group through the
module-level name ``ProcessGroup``, which we point at :class:`RecordingProcessGroup`. Both are
undone by :func:`unpatch`.

With the Python recorder, while patched, that module's two ``type(pg) is ProcessGroup`` checks
(NCCL-style coalescing in ``batch_isend_irecv``, and waiting on hooks at destroy) hold for
recorded groups, not for plain groups created before :func:`patch`: those fall back to torch's
uncoalesced path. The native core's groups are plain ones, so it leaves both checks alone.

A group torch derives from an existing one without its helper (``split_group``, ``shrink_group``,
``merge_remote_group``: the parent's backend builds the child's) is recorded when torch registers
it (``_register_pg_in_world``), like any other.

torch 2.15 attaches a recorder of its own (``FlightRecorderHook``) to new groups of backends that
do not record themselves; a group tether records is not recorded a second time (see
:func:`_one_recorder`). Its health-check hook is left alone.

What happens once the default group exists (the job's alarms, the debug server), and when a
creation outlives the hang timeout (the job's hang alarm), is not the recorder's business:
:func:`patch` takes both as callbacks, from :mod:`tether.runtime`.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup as PlainProcessGroup

from tether._log import get_logger
from tether._versions import TORCH_FR_AUTO_ATTACH
from tether.recorder import reconfigure
from tether.recorder.formation import Formation, Late, form_group
from tether.recorder.group import RecordingProcessGroup, is_recording
from tether.recorder.recorder import Recorder

__all__ = ["OnDefaultGroup", "OnLate", "is_patched", "patch", "unpatch"]

logger = get_logger(__name__)

OnDefaultGroup = Callable[[Any, Formation], None]
"""Called with the default group's (prefix) store and its formation, once it exists."""
OnLate = Callable[[Any, Late | None], None]
"""Called with the group's store and a :class:`Late` when a creation outlives the hang timeout
on this rank, and with None once that creation is over (formed or failed)."""

INIT_LATE_MIN_S = 10.0
"""The least a rank waits in ``init_process_group`` for the others before that is a hang."""
_originals: dict[str, Any] = {}
"""What :func:`patch` replaced in ``distributed_c10d``, by name; empty when not patched."""
_generations: Counter[str] = Counter()
_IN_PROCESS = frozenset({"fake", "threaded"})
"""torch's test backends whose ranks are not processes of a job ("fake": one process stands in
for a rank of a larger world; "threaded": every rank a thread of one process): they get no
formation handshake, which would wait on ranks that never come or on a store that is empty."""
_told: set[str] = set()
_building = threading.local()
"""``depth`` > 0 while this thread is inside torch's group helper, which records its group."""
_recorder: Recorder | None = None
_on_default_group: OnDefaultGroup | None = None
_on_late: OnLate | None = None


def patch(
    recorder: Recorder, on_default_group: OnDefaultGroup, on_late: OnLate | None = None
) -> None:
    """Record every group created from now on into ``recorder`` (idempotent)."""
    global _recorder, _on_default_group, _on_late
    _recorder, _on_default_group, _on_late = recorder, on_default_group, on_late
    if _originals:
        return
    patches: dict[str, Any] = {
        "_new_process_group_helper": _helper,
        "_register_pg_in_world": _register_pg_in_world,
    }
    if recorder.native:  # the core wraps the backends of torch's own groups
        patches["_set_pg_timeout"] = _set_pg_timeout
    else:
        patches["ProcessGroup"] = RecordingProcessGroup
    if hasattr(c10d, TORCH_FR_AUTO_ATTACH):  # torch 2.15+
        patches[TORCH_FR_AUTO_ATTACH] = _one_recorder
    for name, replacement in patches.items():
        _originals[name] = getattr(c10d, name)
        setattr(c10d, name, replacement)
    reconfigure.patch(recorder)


def unpatch() -> None:
    """Stop recording groups created from now on; existing groups keep recording."""
    for name, original in _originals.items():
        setattr(c10d, name, original)
    _originals.clear()
    reconfigure.unpatch()


def is_patched() -> bool:
    return bool(_originals)


def _helper(*args: Any, **kwargs: Any) -> Any:
    helper = _originals["_new_process_group_helper"]
    recorder = _recorder
    assert recorder is not None
    arguments = inspect.signature(helper).bind(*args, **kwargs).arguments
    members = list(arguments["global_ranks_in_group"])
    is_default = not members
    size = int(arguments["group_size"])
    ranks = members or list(range(size))
    me = int(arguments["group_rank"]) if is_default else c10d.get_rank()
    name = str(arguments["group_name"])
    timeout = arguments.get("timeout") or timedelta(minutes=30)
    formation = None
    in_process = _IN_PROCESS & set(_backends(str(arguments["backend"])).values())
    for backend in in_process - _told:
        _told.add(backend)
        logger.info(
            "backend %r: its ranks are not processes of a job; groups form unchecked", backend
        )
    if me in ranks and not in_process:
        # Before the backend exists: gloo and nccl connect to every peer while being built and
        # would fail there, on their own terms, without naming who is missing.
        _generations[name] += 1
        desc = str(arguments.get("group_desc") or "undefined")
        store, on_late = arguments["store"], _on_late
        arrived = time.time_ns()
        late = None
        if on_late is not None:
            report = on_late

            def late(missing: list[int] | None, waited_s: float) -> None:
                op = "init_process_group" if is_default else "new_group"
                if is_default and recorder.global_rank < 0:
                    # Its dump is named by its rank, which the recorder learns once the group
                    # forms.
                    recorder.global_rank, recorder.world_size = me, size
                report(store, Late(op, name, desc, ranks, missing, me, arrived, waited_s))

        try:
            formation = form_group(
                store,
                key=f"tether/form/{name}/{_generations[name]}",
                desc=desc,
                name=name,
                group_rank=ranks.index(me),
                ranks=ranks,
                timeout=timeout,
                host=recorder.host,
                clock=is_default,
                late_after=_late_after(recorder.config.hang_timeout, is_default),
                on_late=late,
            )
        finally:
            if on_late is not None:
                on_late(store, None)
    _building.depth = _depth() + 1
    try:
        pg, prefix_store = helper(*args, **kwargs)
    finally:
        _building.depth -= 1
    recorded = _attach(
        recorder, pg, ranks=ranks, backend=str(arguments["backend"]), timeout=timeout
    )
    if recorded and is_default and formation is not None:
        recorder.global_rank, recorder.world_size = me, size
        recorder.store = prefix_store
        recorder.clock_offset_ns = formation.clock_offset_ns
        recorder.clock_error_ns = formation.clock_error_ns
        recorder.identify()
        if _on_default_group is not None:
            _on_default_group(prefix_store, formation)
    return pg, prefix_store


def _late_after(hang_timeout: float, is_default: bool) -> float:
    """How long this rank waits in a creation before it is a hang: the hang timeout; for the
    default group, at least :data:`INIT_LATE_MIN_S` (the job's processes start it at different
    times: imports, data loading before ``init_process_group``)."""
    return max(hang_timeout, INIT_LATE_MIN_S) if is_default else hang_timeout


def _depth() -> int:
    return int(getattr(_building, "depth", 0))


def _register_pg_in_world(*args: Any, **kwargs: Any) -> Any:
    """torch's registration of a new group; one it derived from a recorded group outside its
    helper (a split, a shrink, a merge: the parent's backend built the child's) is recorded
    here. Its members form no handshake: torch's derivation is collective on the parent."""
    register = _originals["_register_pg_in_world"]
    result = register(*args, **kwargs)
    recorder = _recorder
    if recorder is None or _depth():
        return result
    arguments = inspect.signature(register).bind(*args, **kwargs).arguments
    pg, mapping = arguments["pg"], arguments.get("rank_mapping")
    if isinstance(pg, PlainProcessGroup) and mapping:
        ranks = sorted(mapping, key=mapping.__getitem__)  # global ranks by group rank
        _attach(recorder, pg, ranks=ranks, backend=str(arguments["backend_name"]), timeout=None)
    return result


def _one_recorder(*args: Any, **kwargs: Any) -> Any:
    """torch's auto-attach of its own recorder, except to a group tether records: each group has
    one recorder. Which argument is the group is found by type, not position (the function is
    private to torch 2.15 and not run here; see docs/compat.md)."""
    recorder = _recorder
    groups = [a for a in (*args, *kwargs.values()) if isinstance(a, PlainProcessGroup)]
    recorded_type = (
        PlainProcessGroup if recorder is not None and recorder.native else RecordingProcessGroup
    )
    if recorder is not None and groups and all(type(g) is recorded_type for g in groups):
        if "fr-hook" not in _told:
            _told.add("fr-hook")
            logger.info("torch's flight recorder is not attached to groups tether records")
        return None
    return _originals[TORCH_FR_AUTO_ATTACH](*args, **kwargs)


def _set_pg_timeout(timeout: timedelta, group: Any = None) -> None:
    """torch's, which sets a timeout only on backends that are gloo's or nccl's own class: a
    recording backend passes it to the backend it wraps."""
    _originals["_set_pg_timeout"](timeout, group)
    group = group if group is not None else c10d._get_default_group()
    for device in group._device_types:
        inner = getattr(group._get_backend(device), "inner", None)
        if inner is not None and hasattr(inner(device.type), "_set_default_timeout"):
            inner(device.type)._set_default_timeout(timeout)


def _attach(
    recorder: Recorder, pg: Any, *, ranks: list[int], backend: str, timeout: timedelta | None
) -> bool:
    """Record ``pg`` from now on; False if it is not this process's to record (a group this
    rank is not a member of, or one recorded already). ``timeout`` None: the group's backend's
    own."""
    if type(pg) is not (PlainProcessGroup if recorder.native else RecordingProcessGroup):
        if isinstance(pg, PlainProcessGroup):
            # A third-party backend may hand torch a Python ProcessGroup of its own (torch then
            # uses it as the group, unnamed): it has no backend to wrap or forward to.
            logger.info("not recording a group of backend %r: a Python ProcessGroup", backend)
        return False
    if recorder.native:
        recorder.prepare_derived(pg)  # type: ignore[attr-defined]
    recorded = recorder.is_wrapped(pg) if recorder.native else is_recording(pg)  # type: ignore[attr-defined]
    if recorded:  # already
        return False
    backends = _backends(backend, pg)
    if timeout is None:
        timeout = _backend_timeout(pg)
    group = recorder.add_group(
        name=pg.group_name,
        desc=pg.group_desc,
        ranks=ranks,
        group_rank=pg.rank(),
        backends=backends,
        timeout_ms=int(timeout.total_seconds() * 1000),
    )
    if recorder.native:
        devices = {str(d.type): pg._get_backend(d) for d in pg._device_types}
        recorder.wrap(pg, group, devices)  # type: ignore[attr-defined]
    else:
        pg._tether = group  # type: ignore[attr-defined]
    logger.debug("recording process group %s (%s) ranks=%s", pg.group_name, pg.group_desc, ranks)
    return True


def _backend_timeout(pg: Any) -> timedelta:
    """The timeout ``pg``'s backend was built with (gloo's and nccl's options carry it); torch's
    default of 30 minutes when it does not say."""
    for device in pg._device_types:
        try:
            found = pg._get_backend(device).options._timeout
        except Exception:  # a backend without options, or options without a timeout
            continue
        if isinstance(found, timedelta):
            return found
    return timedelta(minutes=30)


def _backends(backend: str, pg: Any = None) -> dict[str, str]:
    """Backend name per device type, as torch's ``BackendConfig`` resolved it (else ``pg``'s,
    on the CPU; else none)."""
    try:
        mapping = c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map()
        return {str(device): str(name) for device, name in mapping.items()}
    except Exception:
        return {"cpu": pg.name()} if pg is not None else {}
