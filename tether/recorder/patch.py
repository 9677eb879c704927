"""Turning recording on for every process group torch creates in this process.

torch builds every group (``init_process_group``, ``new_group``, subgroups, DeviceMesh) in
``distributed_c10d._new_process_group_helper``, which constructs the group through the
module-level name ``ProcessGroup``. We point that name at :class:`RecordingProcessGroup` and wrap
the helper to register each new group with the recorder and run the formation handshake. Both are
undone by :func:`unpatch`.

While patched, that module's two ``type(pg) is ProcessGroup`` checks (NCCL-style coalescing in
``batch_isend_irecv``, and waiting on hooks at destroy) hold for recorded groups, not for plain
groups created before :func:`patch`: those fall back to torch's uncoalesced path.

What happens once the default group exists (the job's alarms, the debug server) is not the
recorder's business: :func:`patch` takes it as a callback, from :mod:`tether.runtime`.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed.distributed_c10d as c10d

from tether._log import get_logger
from tether.recorder.formation import Formation, form_group
from tether.recorder.group import RecordingProcessGroup, is_recording
from tether.recorder.recorder import Recorder

__all__ = ["OnDefaultGroup", "is_patched", "patch", "unpatch"]

logger = get_logger(__name__)

OnDefaultGroup = Callable[[Any, Formation], None]
"""Called with the default group's (prefix) store and its formation, once it exists."""

_originals: dict[str, Any] = {}
"""What :func:`patch` replaced in ``distributed_c10d``, by name; empty when not patched."""
_generations: Counter[str] = Counter()
_recorder: Recorder | None = None
_on_default_group: OnDefaultGroup | None = None


def patch(recorder: Recorder, on_default_group: OnDefaultGroup) -> None:
    """Record every group created from now on into ``recorder`` (idempotent)."""
    global _recorder, _on_default_group
    _recorder, _on_default_group = recorder, on_default_group
    if _originals:
        return
    patches = {"ProcessGroup": RecordingProcessGroup, "_new_process_group_helper": _helper}
    for name, replacement in patches.items():
        _originals[name] = getattr(c10d, name)
        setattr(c10d, name, replacement)


def unpatch() -> None:
    """Stop recording groups created from now on; existing groups keep recording."""
    for name, original in _originals.items():
        setattr(c10d, name, original)
    _originals.clear()


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
    if me in ranks:
        # Before the backend exists: gloo and nccl connect to every peer while being built and
        # would fail there, on their own terms, without naming who is missing.
        _generations[name] += 1
        formation = form_group(
            arguments["store"],
            key=f"tether/form/{name}/{_generations[name]}",
            desc=str(arguments.get("group_desc") or "undefined"),
            name=name,
            group_rank=ranks.index(me),
            ranks=ranks,
            timeout=timeout,
            host=recorder.host,
            clock=is_default,
        )
    pg, prefix_store = helper(*args, **kwargs)
    if type(pg) is RecordingProcessGroup and not is_recording(pg):
        _attach(recorder, pg, ranks=ranks, backend=str(arguments["backend"]), timeout=timeout)
        if is_default and formation is not None:
            recorder.global_rank, recorder.world_size = me, size
            recorder.store = prefix_store
            recorder.clock_offset_ns = formation.clock_offset_ns
            recorder.clock_error_ns = formation.clock_error_ns
            if _on_default_group is not None:
                _on_default_group(prefix_store, formation)
    return pg, prefix_store


def _attach(
    recorder: Recorder,
    pg: RecordingProcessGroup,
    *,
    ranks: list[int],
    backend: str,
    timeout: timedelta,
) -> None:
    pg._tether = recorder.add_group(
        name=pg.group_name,
        desc=pg.group_desc,
        ranks=ranks,
        group_rank=pg.rank(),
        backends=_backends(backend, pg),
        timeout_ms=int(timeout.total_seconds() * 1000),
    )
    logger.debug("recording process group %s (%s) ranks=%s", pg.group_name, pg.group_desc, ranks)


def _backends(backend: str, pg: Any) -> dict[str, str]:
    """Backend name per device type, as torch's ``BackendConfig`` resolved it."""
    try:
        mapping = c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map()
        return {str(device): str(name) for device, name in mapping.items()}
    except Exception:
        return {"cpu": pg.name()}
