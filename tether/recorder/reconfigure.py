"""torch's reconfigure on the groups tether records, on every torch tether supports.

torch 2.14 reconfigures a group in place: ``ProcessGroup.reconfigure(opts)`` has gloo build a new
communicator among the holders of ``opts.handles``; the group's rank and size become the new ones
and its sequence numbers restart. Here:

- torch 2.14+: the native core registers its recording backend beside the group's own (torch
  keeps one backend per type and ignores a second of the same type), so torch's ``ProcessGroup``
  methods see two backends and refuse ("... do not support process groups with multiple
  backends."). For a group the core wraps, the three methods go to the recording backend, which
  forwards them to the backend it wraps; a group that really has several backends still gets
  torch's refusal.
- torch 2.13 has none of it: :mod:`tether.recorder.gloo_reconfigure` builds gloo's, and this
  module gives torch 2.14's API for it (``init_process_group(enable_reconfigure=True)``,
  ``_supports_reconfigure``, ``_get_reconfigure_handle``, ``_reconfigure``,
  ``ReconfigureOptions``, the three ``ProcessGroup`` methods, and what 2.14's gloo backend object
  answers: ``supports_reconfigure``, ``get_error()``).
- Either way the recorder learns each new membership: this process's rank, the members (the
  handles' stable global ranks), the restarted counters, and when each reconfigure happened, so
  that a dump says which communicator each entry ran on (``RecordedGroup.reconfigures``).

A reconfigure that raises changes nothing (gloo's rolls its state back; the backport swaps
nothing before the new communicator is connected).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ErrorType, ProcessGroup, ProcessGroupGloo

from tether._log import get_logger
from tether._versions import TORCH_RECONFIGURE
from tether.recorder.gloo_reconfigure import (
    ReconfigureOptions,
    Regroupable,
    handle_fields,
    in_rank_order,
    regroupable,
)
from tether.recorder.group import RecordedGroup, RecordingProcessGroup
from tether.recorder.recorder import Recorder

__all__ = ["MULTIPLE_BACKENDS", "group_timeout", "members_of", "patch", "swap_backend", "unpatch"]

logger = get_logger(__name__)

MULTIPLE_BACKENDS = (
    "ProcessGroup reconfigure APIs do not support process groups with multiple backends."
)
"""torch's refusal for a group such as ``cpu:gloo,cuda:nccl``."""

_originals: dict[tuple[Any, str], Any] = {}
"""What :func:`patch` replaced, by (owner, name); None for what it added."""
_recorder: Recorder | None = None
_regroupables: dict[int, Regroupable] = {}
"""The torch 2.13 backport's groups, by ``id`` of the group (each holds its group)."""


def patch(recorder: Recorder) -> None:
    """torch's reconfigure through the recorder (idempotent)."""
    global _recorder
    _recorder = recorder
    if _originals:
        return
    methods: dict[str, Any] = {
        "supports_reconfigure": property(_supports),
        "get_reconfigure_handle": _handle,
        "reconfigure": _reconfigure,
    }
    if TORCH_RECONFIGURE:
        _replace({ProcessGroup: methods})
        return
    functions = {  # where torch 2.14 has them: its options only in distributed_c10d
        "_supports_reconfigure": _supports_reconfigure,
        "_get_reconfigure_handle": _get_reconfigure_handle,
        "_reconfigure": _reconfigure_group,
        "init_process_group": _init_process_group,
    }
    options = {"ReconfigureOptions": ReconfigureOptions}
    # What torch 2.14's gloo backend answers, asked of the backend object (torch's own reconfigure
    # tests ask ``group._get_backend(cpu)``); the core's recording backend passes these to it.
    gloo = {"supports_reconfigure": property(_gloo_supports), "get_error": _gloo_error}
    _replace(
        {ProcessGroup: methods, ProcessGroupGloo: gloo, c10d: functions | options, dist: functions}
    )


def unpatch() -> None:
    """Undo :func:`patch`, unless the torch 2.13 backport has reconfigured a group: the group
    goes on asking this module its rank and size (groups keep recording after an uninstall)."""
    if (ProcessGroup, "rank") in _originals:  # patched once a group was reconfigured
        return
    for (owner, name), original in _originals.items():
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _originals.clear()


def _replace(replacements: dict[Any, dict[str, Any]]) -> None:
    for owner, names in replacements.items():
        for name, replacement in names.items():
            _originals[owner, name] = vars(owner).get(name)
            setattr(owner, name, replacement)


def _original(owner: Any, name: str) -> Any:
    return _originals[owner, name]


def members_of(handles: Any, size: int) -> list[int]:
    """The members' global ranks in new-rank order: a gloo handle names its holder's stable
    global rank. Handles of other backends are opaque: ranks 0..size-1."""
    fields = [handle_fields(handle) for handle in in_rank_order(handles)]
    if any(f is None for f in fields):
        return list(range(size))
    return [f[2] for f in fields if f is not None]


# -- ProcessGroup's methods ----------------------------------------------------------------------
def _supports(pg: ProcessGroup) -> bool:
    if not TORCH_RECONFIGURE:
        return _regroupable(pg) is not None
    backend = _wrapped(pg)
    if backend is None:
        return bool(_original(ProcessGroup, "supports_reconfigure").fget(_plain(pg)))
    return bool(backend.supports_reconfigure)


def _handle(pg: ProcessGroup) -> str:
    if not TORCH_RECONFIGURE:
        return _backported(pg, "get_reconfigure_handle").handle()
    backend = _wrapped(pg)
    if backend is None:
        return str(_original(ProcessGroup, "get_reconfigure_handle")(_plain(pg)))
    return str(backend.get_reconfigure_handle())


def _reconfigure(pg: ProcessGroup, opts: Any) -> Any:
    if not TORCH_RECONFIGURE:
        work = _backported(pg, "reconfigure").reconfigure(opts)
        _answer_rank_and_size()
    elif (backend := _wrapped(pg)) is not None:
        work = backend.reconfigure(opts)
    else:
        work = _original(ProcessGroup, "reconfigure")(_plain(pg), opts)
    group = _group_of(pg)
    if group is not None:
        try:
            size = pg.size()
            group.regroup(uuid=int(opts.uuid), ranks=members_of(opts.handles, size), rank=pg.rank())
        except Exception as exc:  # the user's reconfigure succeeded: never fail it here
            logger.error("recording group %s's reconfigure failed: %s", pg.group_name, exc)
    return work


def swap_backend(
    pg: ProcessGroup, gloo: Any, *, store: Any, rank: int, size: int, uuid: int, members: list[int]
) -> None:
    """Have the recorded gloo group ``pg`` forward to ``gloo``, a communicator that its caller
    connected among ``members`` (global ranks, in new-rank order): an elastic regroup, on every
    torch (torch's in-place reconfigure would reuse the group's gloo threads, one of which may
    wait on a dead peer). Raises RuntimeError for a group tether cannot regroup."""
    _backported(pg, "swap").swap(gloo, store=store, rank=rank, size=size, uuid=uuid)
    _answer_rank_and_size()
    group = _group_of(pg)
    if group is not None:
        group.regroup(uuid=uuid, ranks=members, rank=rank)


def answer_as(pg: ProcessGroup, *, rank: int, size: int) -> None:
    """Have ``pg``, a gloo group of this process alone that a regroup connects later
    (:func:`swap_backend`), answer ``rank`` and ``size`` until then: FSDP2 lays out its shards
    by the shard group's rank as it wraps a module, before the training loop connects it."""
    regrouped = _backported(pg, "answer_as")
    regrouped.rank, regrouped.size, regrouped.answers = rank, size, True
    _answer_rank_and_size()


def group_timeout(pg: ProcessGroup) -> timedelta | None:
    """The timeout ``pg`` was created with, as the recorder knows it (None: not recorded)."""
    group = _group_of(pg)
    return None if group is None else timedelta(milliseconds=group.timeout_ms)


def _answer_rank_and_size() -> None:
    if (ProcessGroup, "rank") not in _originals:
        # torch reads rank and size from the group itself, which has no setter: answered here
        # from the first regroup on, and only from then on (every rank() call of every group
        # pays a Python call then).
        _replace({ProcessGroup: {"rank": _rank, "size": _size}})


def _rank(pg: ProcessGroup) -> int:
    regrouped = _regroupables.get(id(pg))
    if regrouped is not None and regrouped.answers:
        return regrouped.rank
    return int(_original(ProcessGroup, "rank")(pg))


def _size(pg: ProcessGroup) -> int:
    regrouped = _regroupables.get(id(pg))
    if regrouped is not None and regrouped.answers:
        return regrouped.size
    return int(_original(ProcessGroup, "size")(pg))


# -- torch 2.14's functions, for torch 2.13 ------------------------------------------------------
def _gloo_supports(backend: ProcessGroupGloo) -> bool:
    return True  # 2.14's gloo: every gloo backend can be reconfigured


def _gloo_error(backend: ProcessGroupGloo) -> ErrorType:
    return ErrorType.SUCCESS  # 2.14's gloo: it reports no error state; a failed work raises


def _init_process_group(*args: Any, enable_reconfigure: bool = False, **kwargs: Any) -> None:
    _original(c10d, "init_process_group")(*args, **kwargs)
    if enable_reconfigure:  # backends that cannot reconfigure ignore the flag, as torch's do
        regrouped = _regroupable(c10d._get_default_group())
        if regrouped is not None:
            regrouped.set_ready(False)


def _supports_reconfigure(group: ProcessGroup | None = None) -> bool:
    return bool((group or c10d._get_default_group()).supports_reconfigure)  # type: ignore[attr-defined]


def _get_reconfigure_handle(group: ProcessGroup | None = None) -> str:
    return str((group or c10d._get_default_group()).get_reconfigure_handle())  # type: ignore[attr-defined]


def _reconfigure_group(
    uuid: int,
    handles: set[str] | list[str],
    group: ProcessGroup | None = None,
    timeout: timedelta | None = None,
    hints: dict[str, str] | None = None,
) -> Any:
    pg = group or c10d._get_default_group()
    opts = ReconfigureOptions(uuid=uuid, handles=handles, timeout=timeout, hints=hints or {})
    return pg.reconfigure(opts)  # type: ignore[attr-defined]


# -- which group is which ------------------------------------------------------------------------
def _plain(pg: ProcessGroup) -> ProcessGroup:
    """Where torch's own reconfigure methods run for ``pg``: the Python recorder's inner group,
    which shares its backend. torch 2.15 dispatches them to a Python subclass's overrides, so on
    the recording group itself torch's method would call this module's back, without end."""
    return pg._inner if type(pg) is RecordingProcessGroup else pg


def _wrapped(pg: ProcessGroup) -> Any:
    """The native core's recording backend over ``pg``, or None (torch's methods apply)."""
    recorder = _recorder
    if recorder is None or not recorder.native:
        return None
    backend = recorder.recording_backend(pg)
    if backend is not None:
        # Held together: a wrapper of one backend is one object only while it lives. The id of
        # a temporary is that of the next one when its memory is reused at once, and not when
        # another thread allocated meanwhile (2 false "multiple backends" in 200,000 checks).
        inners = [backend.inner(device.type) for device in pg._device_types]
        if len({id(inner) for inner in inners}) > 1:
            raise RuntimeError(MULTIPLE_BACKENDS)
    return backend


def _regroupable(pg: ProcessGroup) -> Regroupable | None:
    """torch 2.13: the group as the backport reconfigures it; None for a group it cannot
    (unrecorded, or not gloo alone)."""
    known = _regroupables.get(id(pg))
    if known is not None and known.pg is pg:
        return known
    group = _group_of(pg)
    layer = pg if type(pg) is RecordingProcessGroup else _wrapped(pg)
    if group is None or layer is None:
        return None
    made = regroupable(pg, group, layer)
    if made is not None:
        _regroupables[id(pg)] = made
    return made


def _backported(pg: ProcessGroup, what: str) -> Regroupable:
    regrouped = _regroupable(pg)
    if regrouped is None:
        raise RuntimeError(f"Backend {pg.name()} does not support {what}")
    return regrouped


def _group_of(pg: ProcessGroup) -> RecordedGroup | None:
    recorder = _recorder
    if recorder is None:
        return None
    group = getattr(pg, "_tether", None)  # the Python recorder's groups carry theirs
    if group is None:
        group = recorder.groups.get(pg.group_name)
    return group if isinstance(group, RecordedGroup) else None
