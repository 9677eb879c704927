"""Turning recording on for every process group torch creates in this process.

torch builds every group (``init_process_group``, ``new_group``, subgroups, DeviceMesh) in
``distributed_c10d._new_process_group_helper``, which constructs the group through the
module-level name ``ProcessGroup``. We point that name at :class:`RecordingProcessGroup` and wrap
the helper to register each new group with the recorder and run the formation handshake. Both are
undone by :func:`uninstall`.
"""

from __future__ import annotations

import atexit
import inspect
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed.distributed_c10d as c10d

from tether._log import get_logger, set_rank
from tether.config import Config, load_config
from tether.recorder.formation import form_group
from tether.recorder.group import RecordingProcessGroup
from tether.recorder.recorder import Recorder

__all__ = ["current", "install", "is_installed", "uninstall"]

logger = get_logger(__name__)

_lock = threading.Lock()
_recorder: Recorder | None = None
_original_pg_class: Any = None
_original_helper: Any = None
_generations: Counter[str] = Counter()


def current() -> Recorder | None:
    """The recorder of this process, or None before :func:`install`."""
    return _recorder


def is_installed() -> bool:
    return _original_helper is not None


def install(config: Config | None = None) -> Recorder:
    """Record every process group created from now on in this process. Idempotent."""
    global _recorder, _original_pg_class, _original_helper
    with _lock:
        if _recorder is None:
            config = config or load_config()
            config.check_dump_dir()
            _recorder = Recorder(config)
            atexit.register(_at_exit)
        if _original_helper is None:
            _original_pg_class = c10d.ProcessGroup
            _original_helper = c10d._new_process_group_helper
            c10d.ProcessGroup = RecordingProcessGroup  # type: ignore[misc]
            c10d._new_process_group_helper = _recording_helper  # type: ignore[assignment]
        return _recorder


def uninstall() -> None:
    """Stop recording groups created from now on; existing groups keep recording."""
    global _original_pg_class, _original_helper
    with _lock:
        if _original_helper is not None:
            c10d.ProcessGroup = _original_pg_class  # type: ignore[misc]
            c10d._new_process_group_helper = _original_helper  # type: ignore[assignment]
            _original_pg_class = _original_helper = None


def _recording_helper(*args: Any, **kwargs: Any) -> Any:
    assert _original_helper is not None and _recorder is not None
    call = inspect.signature(_original_helper).bind(*args, **kwargs)
    pg, prefix_store = _original_helper(*args, **kwargs)
    if type(pg) is RecordingProcessGroup and prefix_store is not None:
        _attach(pg, prefix_store, call.arguments)
    return pg, prefix_store


def _attach(pg: RecordingProcessGroup, store: Any, arguments: dict[str, Any]) -> None:
    assert _recorder is not None
    if not isinstance(pg._tether, type(RecordingProcessGroup._tether)):
        return  # an existing group returned again (same pg_tag and ranks)
    size = int(arguments["group_size"])
    ranks = list(arguments["global_ranks_in_group"]) or list(range(size))
    group_rank = pg.rank()
    name, desc = pg.group_name, pg.group_desc
    timeout = arguments.get("timeout") or timedelta(minutes=30)
    _generations[name] += 1
    formation = form_group(
        store,
        name=name,
        desc=desc,
        generation=_generations[name],
        group_rank=group_rank,
        ranks=ranks,
        timeout=timeout,
    )
    is_default = not arguments["global_ranks_in_group"]
    if is_default:
        _recorder.global_rank = group_rank
        _recorder.world_size = size
        _recorder.store = store
        _recorder.clock_offset_ns = formation.clock_offset_ns
        _recorder.clock_error_ns = formation.clock_error_ns
        set_rank(group_rank)
    pg._tether = _recorder.add_group(
        name=name,
        desc=desc,
        ranks=ranks,
        group_rank=group_rank,
        backends=_backends(str(arguments["backend"]), pg),
    )
    logger.debug("recording process group %s (%s) ranks=%s", name, desc, ranks)


def _backends(backend: str, pg: Any) -> dict[str, str]:
    """Backend name per device type, as torch's ``BackendConfig`` resolved it."""
    try:
        mapping = c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map()
        return {str(device): str(name) for device, name in mapping.items()}
    except Exception:
        return {"cpu": pg.name()}


def _at_exit() -> None:
    recorder = _recorder
    if recorder is None:
        return
    if recorder.config.dump_on_exit and recorder.groups:
        from tether.recorder.dump import dump

        try:
            path = dump(reason="exit")
            logger.info("wrote exit dump %s", path)
        except Exception:
            logger.exception("exit dump failed")
    recorder.close()

