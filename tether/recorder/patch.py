"""Turning recording on for every process group torch creates in this process.

torch builds every group (``init_process_group``, ``new_group``, subgroups, DeviceMesh) in
``distributed_c10d._new_process_group_helper``, which constructs the group through the
module-level name ``ProcessGroup``. We point that name at :class:`RecordingProcessGroup` and wrap
the helper to register each new group with the recorder and run the formation handshake. Both are
undone by :func:`uninstall`.

While installed, that module's two ``type(pg) is ProcessGroup`` checks (NCCL-style coalescing in
``batch_isend_irecv``, and waiting on hooks at destroy) hold for recorded groups, not for plain
groups created before :func:`install`: those fall back to torch's uncoalesced path.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import sys
import threading
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed.distributed_c10d as c10d

from tether._exceptions import ConfigError
from tether._log import get_logger, set_rank
from tether.config import Config, conflicts, load_config
from tether.recorder.formation import form_group
from tether.recorder.group import RecordingProcessGroup, is_recording
from tether.recorder.recorder import Recorder

if TYPE_CHECKING:
    from tether.watchdog.monitor import Monitor

__all__ = ["current", "install", "install_with", "monitor", "note_failed_exit", "uninstall"]

logger = get_logger(__name__)

_lock = threading.Lock()
_recorder: Recorder | None = None
_monitor: Monitor | None = None
_originals: dict[str, Any] = {}
"""What :func:`install` replaced in ``distributed_c10d``, by name; empty when not installed."""
_generations: Counter[str] = Counter()
_died_of: BaseException | None = None
"""The uncaught exception that is ending the main thread, if one is."""


def current() -> Recorder | None:
    """The recorder of this process, or None before :func:`install`."""
    return _recorder


def monitor() -> Monitor | None:
    """This process's watchdog and alarm responder, or None before :func:`install`."""
    return _monitor


def install(config: Config | None = None) -> Recorder:
    """Record every process group created from now on in this process.

    Idempotent: calling it again without a config, or with the config already installed,
    changes nothing (beyond undoing :func:`uninstall`). A different config raises
    :class:`~tether.ConfigError` naming the differences: the recorder's ring and the watchdog
    already run with the first one (``tether run`` installs it from its flags before the
    script starts)."""
    with _lock:
        if _recorder is not None and config is not None:
            everything = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
            _refuse(conflicts(_recorder.config, everything), "tether.install() was given")
        return _install(config)


def install_with(**settings: Any) -> Recorder:
    """:func:`install` with these settings (None: not given) over the environment's. When
    tether is already installed, settings that agree with its config are accepted and any
    other raises :class:`~tether.ConfigError` naming them."""
    config = load_config(**settings)  # checks the values even when they will not be used
    given = {field: getattr(config, field) for field, v in settings.items() if v is not None}
    with _lock:
        if _recorder is not None:
            _refuse(conflicts(_recorder.config, given), "tether.init_process_group() was given")
        return _install(config)


def _refuse(differences: list[str], what: str) -> None:
    if differences:
        raise ConfigError(
            f"{what} settings that differ from those tether was installed with (by `tether "
            f"run`, or an earlier tether.install()): {'; '.join(differences)}. The recorder and "
            "watchdog already run with the installed ones: set these through the `tether run` "
            "flag or environment variable named (or in the first tether.install()), and leave "
            "them out here"
        )


def _install(config: Config | None) -> Recorder:
    """Under ``_lock``: start the recorder and monitor once, and patch torch if unpatched."""
    global _recorder, _monitor
    if _recorder is None:
        from tether.watchdog.monitor import Monitor

        config = config or load_config()
        config.check_dump_dir()
        _recorder = Recorder(config)
        _monitor = Monitor(_recorder)
        _monitor.start()
        atexit.register(_at_exit)
        _chain_excepthook()
    if not _originals:
        patches = {
            "ProcessGroup": RecordingProcessGroup,
            "_new_process_group_helper": _recording_helper,
        }
        for name, replacement in patches.items():
            _originals[name] = getattr(c10d, name)
            setattr(c10d, name, replacement)
    return _recorder


def uninstall() -> None:
    """Stop recording groups created from now on; existing groups keep recording."""
    with _lock:
        for name, original in _originals.items():
            setattr(c10d, name, original)
        _originals.clear()


def _recording_helper(*args: Any, **kwargs: Any) -> Any:
    helper = _originals["_new_process_group_helper"]
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
            host=_recorder.host if _recorder is not None else "",
            clock=is_default,
        )
    pg, prefix_store = helper(*args, **kwargs)
    if type(pg) is RecordingProcessGroup and not is_recording(pg):
        _attach(pg, ranks=ranks, backend=str(arguments["backend"]), timeout=timeout)
        if is_default and formation is not None:
            recorder = _recorder
            assert recorder is not None
            recorder.global_rank, recorder.world_size = me, size
            recorder.store = prefix_store
            recorder.clock_offset_ns = formation.clock_offset_ns
            recorder.clock_error_ns = formation.clock_error_ns
            set_rank(me)
            assert _monitor is not None
            _monitor.connect(prefix_store, attempt=recorder.config.attempt)
    return pg, prefix_store


def _attach(
    pg: RecordingProcessGroup, *, ranks: list[int], backend: str, timeout: timedelta
) -> None:
    assert _recorder is not None
    pg._tether = _recorder.add_group(
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


def note_failed_exit(exc: SystemExit) -> None:
    """The program ends with ``sys.exit(n)``, n not 0: a failure, like an uncaught exception
    (``SystemExit`` never reaches the excepthook, and atexit handlers cannot read the status)."""
    global _died_of
    if exc.code not in (None, 0):
        _died_of = exc


def _chain_excepthook() -> None:
    """Note the exception that kills the main thread (atexit handlers cannot see it)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        global _died_of
        _died_of = value
        previous(kind, value, tb)

    sys.excepthook = hook


def _at_exit() -> None:
    recorder = _recorder
    if recorder is None:
        return
    if _monitor is not None:
        _monitor.exit_if_aborting()  # an abort after a hang keeps its own exit status
        linger = recorder.config.exit_linger
        if linger > 0 and _died_of is not None and not isinstance(_died_of, KeyboardInterrupt):
            logger.info(
                "exiting on %s; waiting up to %.0fs for a job-wide alarm to dump into",
                type(_died_of).__name__,
                linger,
            )
            _monitor.linger(linger)
    if recorder.config.dump_on_exit and recorder.groups:
        from tether.recorder.dump import dump

        try:
            path = dump(reason="exit")
            logger.info("wrote exit dump %s", path)
        except Exception:
            logger.exception("exit dump failed")
    if _monitor is not None:
        _monitor.close(clean=_died_of is None)  # a clean exit leaves no job or stacks file
