"""The one place where a process's tether is wired together.

``install()`` builds a :class:`Runtime`: the recorder (:mod:`tether.recorder`); the rank's link
to the job (:class:`~tether.watchdog.link.JobLink`: its watchdog, and once the default group
exists the job's alarms through its store, :mod:`tether.job`); what the rank reports
(:class:`~tether.watchdog.report.RankReport`, read-only); and the debug server
(:mod:`tether.server`), which reads the report and publishes itself through the link. No other
part builds or starts another: each is handed what it needs here.

    install(config)         Runtime(config).start()       recorder, watchdog, exit hooks
      the default group     Runtime.connect(store, ...)   rank, alarms, job file, debug server
    exit                    Runtime.close(clean=...)      threads stopped, clean files removed
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tether._exceptions import ConfigError, TetherError
from tether._log import get_logger, set_rank
from tether.config import Config, conflicts, load_config
from tether.elastic.manager import set_world
from tether.elastic.sockets import snapshot
from tether.elastic.world import World
from tether.events.layout import dump_root
from tether.events.ringfile import ring_file
from tether.job.alarm import raw_store
from tether.job.client import StoreAddress
from tether.job.torch_debug import follow_torch_debug_server, register_worker
from tether.recorder import patch as _patch
from tether.recorder.formation import Formation
from tether.recorder.native import choose, new_recorder
from tether.recorder.recorder import Recorder
from tether.recorder.writer import write_event
from tether.server import DebugServer, start_debug_server
from tether.watchdog.link import JobLink
from tether.watchdog.report import RankReport

__all__ = [
    "Runtime",
    "active",
    "current",
    "dump",
    "install",
    "install_with",
    "link",
    "monitor",
    "note_exception",
    "note_failed_exit",
    "recorder_status",
    "report",
    "uninstall",
]

logger = get_logger(__name__)

_lock = threading.Lock()
_runtime: Runtime | None = None
_died_of: BaseException | None = None
"""The uncaught exception (or failed ``sys.exit``) that is ending the main thread, if one is."""
_off_said = False
"""Whether "recording is off" was said (once a process: install may be called again)."""


JOB_STORE_TIMEOUT_S = 30.0
"""How long a call to an etcd job store keeps trying its members (a TCPStore's calls are bounded
by the default group's timeout)."""


class Runtime:
    """One process's recorder, link to the job (watchdog, responder), report and debug server."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.recorder = new_recorder(
            config,
            ring_path=ring_file(dump_root(config.dump_dir), socket.gethostname(), os.getpid()),
        )
        self.link = JobLink(self.recorder)
        self.report = RankReport.of(self.link)
        self.server: DebugServer | None = None
        self._torch_worker: tuple[str, int, int, str] | None = None
        """The store (host, port), rank and URL under which torch's frontend finds us."""
        self.elastic: World | None = None
        self._sockets_before: dict[int, str] = {}

    def start(self) -> None:
        if self.config.elastic:
            # The world group's connections are those that appear from here to its creation.
            self._sockets_before = snapshot()
            if self.config.replacement:
                # A replacement's world group must not connect to the launch-time world (most of
                # it is not there): gloo connects lazily, and the first regroup connects it.
                os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        self.link.start()
        atexit.register(self._at_exit)
        _chain_excepthook()

    def connect(self, store: Any, formation: Formation) -> None:
        """The default group has formed: this process knows its rank; join the job's alarms and
        serve it. A default group formed again (after ``destroy_process_group``) replaces the
        previous server (freeing a fixed port) and responder."""
        del formation  # its clock offset is already the recorder's
        set_rank(self.recorder.global_rank)
        self._close_server()
        tcp = raw_store(store)  # torch's frontend connects to the TCPStore itself
        host, port = getattr(tcp, "host", None), getattr(tcp, "port", None)
        address = None
        if host is not None and port is not None:
            address = StoreAddress.agree(
                tcp,
                host=str(host),
                port=int(port),
                etcd=self.config.store,
                job_id=self.link.job_id,
                attempt=self.config.attempt,
            )
        elif self.config.store:
            raise ConfigError("--store etcd://... needs the default group on torchrun's TCPStore")
        job_store = tcp  # the job's keys are the raw store's, beneath the group's prefixes
        if address is not None and address.etcd:
            job_store = address.connect(timeout=JOB_STORE_TIMEOUT_S)
        self.link.connect(job_store, address=address, attempt=self.config.attempt)
        self.server = start_debug_server(self.report, self.link)
        if self.server is not None and host is not None and port is not None:
            url = self.server.url(public_host=self.recorder.host)
            self._torch_worker = (host, port, self.recorder.global_rank, url)
            self.register_torch_worker()
            follow_torch_debug_server(self.register_torch_worker)
        if self.config.elastic:
            self._join_elastic(job_store, address)

    def _join_elastic(self, store: Any, address: StoreAddress | None) -> None:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)  # later groups connect as usual
        if address is None:
            raise ConfigError("an elastic job needs a TCPStore (torchrun's, or env://)")
        if self.elastic is not None:
            self.elastic.close(leaving=False)  # the new world beats on for this rank
        self.elastic = World(
            store=store,
            address=address,
            stable_rank=self.recorder.global_rank,
            world_size=self.recorder.world_size,
            heartbeat_timeout=self.config.heartbeat_timeout,
            replacement=self.config.replacement,
            sockets_before=self._sockets_before,
            per_node=self.config.local_world_size,
            in_flight=self.recorder.inflight,
            relay=self.config.agent_relay,
        )
        set_world(self.elastic)

    def register_torch_worker(self) -> None:
        """Be where torch's own debug frontend looks for this rank (it answers torch's worker
        routes): at group formation, and again after torch's ``start_debug_server`` has put
        its own worker there."""
        if self._torch_worker is None or self.server is None:
            return
        host, port, rank, url = self._torch_worker
        try:
            register_worker(host, port, rank, url)
        except Exception as exc:  # the job runs on; only torch's frontend misses this rank
            logger.warning("torch's debug frontend will not find this rank: %s", exc)

    def close(self, *, clean: bool = False, keep_record: bool = False) -> None:
        """Stop the server and threads. ``clean``: the interpreter exits normally, so the files
        this process wrote for the job (``.jobs/``, an empty stacks file) go too, and its ring
        file unless ``keep_record`` (the launcher recovers it if the job fails after it left)."""
        if self.elastic is not None:
            self.elastic.close()
        self._close_server()
        self.link.close(clean=clean)
        self.recorder.close(clean=clean and not keep_record)

    def _close_server(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()

    def _at_exit(self) -> None:
        self.link.exit_if_aborting()  # an abort after a hang keeps its own exit status
        died = _died_of
        if died is not None and not isinstance(died, KeyboardInterrupt):
            # Ctrl-C reaches every rank from the terminal: no rank is the crash's cause.
            linger = self.config.exit_linger
            logger.info(
                "exiting on %s; up to %.0fs for the crash's job-wide dump",
                type(died).__name__,
                linger,
            )
            self.link.report_exit(died, exit_code=_exit_code(died), timeout=linger)
        if self.config.dump_on_exit and self.recorder.groups:
            try:
                path = write_event(self.recorder, "exit", extra=self.link.dump_extra())
                logger.info("wrote exit dump %s", path)
            except Exception:
                logger.exception("exit dump failed")
        keep_record = died is None and _still_a_member() and self.link.leave()
        self.close(clean=died is None, keep_record=keep_record)


def _still_a_member() -> bool:
    """The default group still exists, with peers (the script did not destroy it)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _exit_code(exc: BaseException) -> int:
    """The status the interpreter exits with after ``exc`` ends the main thread."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def recorder_status(config: Config | None = None) -> tuple[str, str]:
    """Which recorder records in this process ("native" or "python"), and why the Python one
    where it does: the installed recorder, else the one ``config`` (or the environment's)
    would get (:class:`~tether.ConfigError` where that asks for a core that cannot load)."""
    if _runtime is not None:
        native = _runtime.recorder.native
        return ("native", "") if native else ("python", choose(_runtime.config)[1])
    module, why = choose(config or load_config())
    return ("native", "") if module is not None else ("python", why)


def active() -> Runtime | None:
    """This process's runtime, or None before :func:`install`."""
    return _runtime


def current() -> Recorder | None:
    """The recorder of this process, or None before :func:`install`."""
    return _runtime.recorder if _runtime is not None else None


def link() -> JobLink | None:
    """This process's link to the job (watchdog, alarm responder, the job's store), or None
    before :func:`install`."""
    return _runtime.link if _runtime is not None else None


def report() -> RankReport | None:
    """What this process reports (health, traces, metrics), or None before :func:`install`."""
    return _runtime.report if _runtime is not None else None


monitor = link
"""The name :func:`link` had while one object also held what :func:`report` reads."""


def install(config: Config | None = None) -> Recorder | None:
    """Record every process group created from now on in this process (and return the
    recorder; None where the configuration turns recording off).

    Idempotent: calling it again without a config, or with the config already installed,
    changes nothing (beyond undoing :func:`uninstall`). A different config raises
    :class:`~tether.ConfigError` naming the differences: the recorder's ring and the watchdog
    already run with the first one (``tether run`` installs it from its flags before the
    script starts)."""
    with _lock:
        if _runtime is not None and config is not None:
            everything = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
            _refuse(conflicts(_runtime.config, everything), "tether.install() was given")
        return _install(config)


def install_with(**settings: Any) -> Recorder | None:
    """:func:`install` with these settings (None: not given) over the environment's. When
    tether is already installed, settings that agree with its config are accepted and any
    other raises :class:`~tether.ConfigError` naming them."""
    config = load_config(**settings)  # checks the values even when they will not be used
    given = {field: getattr(config, field) for field, v in settings.items() if v is not None}
    with _lock:
        if _runtime is not None:
            _refuse(conflicts(_runtime.config, given), "tether.init_process_group() was given")
        return _install(config)


def uninstall() -> None:
    """Stop recording groups created from now on; existing groups keep recording."""
    with _lock:
        _patch.unpatch()


def dump(
    reason: str = "manual", *, event_id: str | None = None, extra: dict[str, Any] | None = None
) -> Path:
    """Write this rank's dump now and return its path.

    Call it on every rank, as a collective: the n-th call for a ``reason`` lands in the same
    event directory on every rank (agreed through the job's store), so a rank that calls it
    alone shifts the pairing of its later calls. To have every rank dump from one place, use
    ``tether dump`` or ``POST /dump`` on a rank's debug server, which raise a job-wide alarm;
    to dump one rank alone, give it an ``event_id`` of its own."""
    recorder = current()
    if recorder is None and _off_said:
        raise TetherError("nothing is recorded in this process: recording is off (a ring of 0)")
    if recorder is None:
        raise TetherError(
            "nothing is recorded in this process: call tether.init_process_group(...) or "
            "tether.install() first, or launch with `tether run`"
        )
    return write_event(recorder, reason, event_id=event_id, extra=extra)


def note_failed_exit(exc: SystemExit) -> None:
    """The program ends with ``sys.exit(n)``, n not 0: a failure, like an uncaught exception
    (``SystemExit`` never reaches the excepthook, and atexit handlers cannot read the status)."""
    if exc.code not in (None, 0):
        note_exception(exc)


def note_exception(exc: BaseException) -> None:
    """The main thread is dying of ``exc``: every dump of this rank from now on says so (a
    peer's alarm may come before this process's exit hooks run)."""
    global _died_of
    _died_of = exc
    if _runtime is not None and not isinstance(exc, KeyboardInterrupt):
        _runtime.link.note_exception(exc)


def _install(config: Config | None) -> Recorder | None:
    """Under ``_lock``: start the runtime once, and patch torch if unpatched. None where the
    configuration turns recording off (a ring of 0, as ``TORCH_FR_BUFFER_SIZE=0`` asks)."""
    global _runtime, _off_said
    if _runtime is None:
        config = config or load_config()
        if config.ring_size == 0:
            if not _off_said:
                _off_said = True
                logger.warning(
                    "recording is off (a ring of 0 entries: TETHER_RING_SIZE, or torch's "
                    "TORCH_FR_BUFFER_SIZE): no group is recorded, no hang is detected"
                )
            return None
        config.check_dump_dir()
        runtime = Runtime(config)
        runtime.start()
        _runtime = runtime
    _patch.patch(_runtime.recorder, _runtime.connect, _runtime.link.note_late)
    return _runtime.recorder


def _refuse(differences: list[str], what: str) -> None:
    if differences:
        raise ConfigError(
            f"{what} settings that differ from those tether was installed with (by `tether "
            f"run`, or an earlier tether.install()): {'; '.join(differences)}. The recorder and "
            "watchdog already run with the installed ones: set these through the `tether run` "
            "flag or environment variable named (or in the first tether.install()), and leave "
            "them out here"
        )


def _chain_excepthook() -> None:
    """Note the exception that kills the main thread (atexit handlers cannot see it)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        note_exception(value)
        previous(kind, value, tb)

    sys.excepthook = hook
