"""Recorded groups through torch's reconfigure (torch 2.14+).

torch 2.14 reconfigures a group in place: ``ProcessGroup.reconfigure(opts)`` has gloo build a new
communicator among the holders of ``opts.handles``; the group's rank and size become the new ones
(torch reads them from the backend) and its sequence numbers restart. Two things stand between
that and a recorded group:

- The native core registers its recording backend beside the group's own (torch keeps one backend
  per type and ignores a second of the same type), so torch's ``ProcessGroup``-level methods see
  two backends and refuse ("... do not support process groups with multiple backends."). For a
  group the core wraps, the three methods go to the recording backend, which forwards them to the
  backend it wraps; a group that really has several backends still gets torch's refusal.
- The recorder must learn the new membership: this process's rank, the members (the handles'
  stable global ranks), the restarted counters, and when each reconfigure happened, so that a dump
  says which communicator each entry ran on (``RecordedGroup.reconfigures``).

A reconfigure that raises changes nothing here (gloo rolls its own state back). Python recorder
groups are torch's class too, so the same three methods serve both recorders.
"""

from __future__ import annotations

from typing import Any

from torch._C._distributed_c10d import ProcessGroup

from tether._log import get_logger
from tether.recorder.group import RecordedGroup
from tether.recorder.recorder import Recorder

__all__ = ["MULTIPLE_BACKENDS", "members_of", "patch", "unpatch"]

logger = get_logger(__name__)

MULTIPLE_BACKENDS = (
    "ProcessGroup reconfigure APIs do not support process groups with multiple backends."
)
"""torch's refusal for a group such as ``cpu:gloo,cuda:nccl``."""

_originals: dict[str, Any] = {}
_recorder: Recorder | None = None


def patch(recorder: Recorder) -> None:
    """Route torch's reconfigure methods through the recorder (idempotent; torch 2.14+ only)."""
    global _recorder
    _recorder = recorder
    if _originals:
        return
    replacements = {
        "supports_reconfigure": property(_supports),
        "get_reconfigure_handle": _handle,
        "reconfigure": _reconfigure,
    }
    for name, replacement in replacements.items():
        _originals[name] = ProcessGroup.__dict__[name]
        setattr(ProcessGroup, name, replacement)


def unpatch() -> None:
    for name, original in _originals.items():
        setattr(ProcessGroup, name, original)
    _originals.clear()


def members_of(handles: Any, size: int) -> list[int]:
    """The members' global ranks in new-rank order: a list orders ranks by position, a set as
    gloo does (sorted); a gloo handle (``gloo:<rank>:<uuid>:<stable rank>:<store>``) names its
    holder's stable global rank. Handles of other backends are opaque: ranks 0..size-1."""
    ordered = list(handles) if isinstance(handles, (list, tuple)) else sorted(handles)
    ranks = []
    for handle in ordered:
        parts = str(handle).split(":")
        if len(parts) < 4 or parts[0] != "gloo" or not parts[3].lstrip("-").isdigit():
            return list(range(size))
        ranks.append(int(parts[3]))
    return ranks


def _wrapped(pg: ProcessGroup) -> Any:
    """The native core's recording backend over ``pg``, or None (torch's methods apply)."""
    recorder = _recorder
    if recorder is None or not recorder.native:
        return None
    backend = recorder.recording_backend(pg)
    if backend is not None:
        inners = {id(backend.inner(device.type)) for device in pg._device_types}
        if len(inners) > 1:
            raise RuntimeError(MULTIPLE_BACKENDS)
    return backend


def _supports(pg: ProcessGroup) -> bool:
    backend = _wrapped(pg)
    if backend is None:
        return bool(_originals["supports_reconfigure"].fget(pg))
    return bool(backend.supports_reconfigure)


def _handle(pg: ProcessGroup) -> str:
    backend = _wrapped(pg)
    if backend is None:
        return str(_originals["get_reconfigure_handle"](pg))
    return str(backend.get_reconfigure_handle())


def _reconfigure(pg: ProcessGroup, opts: Any) -> Any:
    backend = _wrapped(pg)
    work = _originals["reconfigure"](pg, opts) if backend is None else backend.reconfigure(opts)
    group = _group_of(pg)
    if group is not None:
        try:
            size = pg.size()
            group.regroup(uuid=int(opts.uuid), ranks=members_of(opts.handles, size), rank=pg.rank())
        except Exception as exc:  # the user's reconfigure succeeded: never fail it here
            logger.error("recording group %s's reconfigure failed: %s", pg.group_name, exc)
    return work


def _group_of(pg: ProcessGroup) -> RecordedGroup | None:
    recorder = _recorder
    if recorder is None:
        return None
    group = getattr(pg, "_tether", None)  # the Python recorder's groups carry theirs
    if group is None:
        group = recorder.groups.get(pg.group_name)
    return group if isinstance(group, RecordedGroup) else None
