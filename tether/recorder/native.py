"""The native recording core: the recorder for a C++ backend that records every operation.

``tether/csrc/`` (the extension ``tether._native_<torch release>``, built against the installed
torch when tether is installed; typed in :mod:`tether.recorder.native_core`) wraps each real backend
of a *plain* torch process group in a recording ``c10d::Backend``. An operation is recorded in C++
whoever issues it (Python, DDP's reducer, functional collectives), without the GIL; the GIL is taken
only to capture the issuing thread's Python stack, where it has one. Completion is tracked there
too, as the Python recorder does it (:mod:`tether.recorder.recorder`): the next operation of a group
polls the previous one, the watchdog the rest.

Everything else reads the core through the same objects as the Python recorder's (a
:class:`~tether.recorder.recorder.Recorder`, its groups, :class:`~tether.recorder.ring.Entry`
snapshots), so dumps, the watchdog and the debug server cannot tell the paths apart.

:func:`load` says whether the core can be used, and why not: not built (no compiler at install
time), built against another torch than the one installed, or writing ring-file records in
another layout than :mod:`tether.events.ringfile` reads.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, cast

import torch

from tether._exceptions import ConfigError
from tether._log import get_logger
from tether._versions import native_module
from tether.config import Config
from tether.events.frames import is_library
from tether.events.ringfile import RECORD_LAYOUT, RECORDS_AT
from tether.events.schema import P2P_SEQ_BASE
from tether.recorder import frames
from tether.recorder.group import _COALESCED, RecordedGroup, backend_type
from tether.recorder.native_core import Core, NativeModule, RecordingBackend, Row
from tether.recorder.ops import OPS
from tether.recorder.recorder import Recorder
from tether.recorder.ring import COMPLETED, SCHEDULED, STARTED, Entry, Ring

__all__ = ["NativeRecorder", "choose", "load", "new_recorder"]

logger = get_logger(__name__)

ABI = 7
"""The core's interface version this module speaks (its module's ``ABI``)."""

_STATES = {"scheduled": SCHEDULED, "started": STARTED, "completed": COMPLETED}

_OTHER_LAYOUT = "the native core writes ring-file records in another layout than tether reads"
"""Why a core is refused whose record layout is not ringfile.RECORD_LAYOUT (the start of it)."""


def _layout_difference(layout: object) -> str:
    """What differs between a core's record layout and :data:`RECORD_LAYOUT` ("" if nothing)."""
    if not isinstance(layout, dict):
        return "it declares none"
    for key in ("version", "record_size"):
        if layout.get(key) != RECORD_LAYOUT[key]:
            return f"{key} {layout.get(key)!r}, not {RECORD_LAYOUT[key]!r}"
    theirs = [tuple(f) for f in layout.get("fields", [])]
    for mine, other in zip(RECORD_LAYOUT["fields"], theirs, strict=False):
        if mine != other:
            return f"field {other!r}, not {mine!r}"
    if len(theirs) != len(RECORD_LAYOUT["fields"]):
        return f"{len(theirs)} fields, not {len(RECORD_LAYOUT['fields'])}"
    return ""


def load() -> tuple[NativeModule | None, str]:
    """The native core's module, or None and why it cannot be used."""
    try:
        module = importlib.import_module(native_module())
    except ImportError as exc:
        text = str(exc)
        if "No module named" in text:
            return None, "the native core was not built (see `make native`)"
        return None, f"the native core does not load ({text.splitlines()[0]}): rebuild it"
    built = getattr(module, "TORCH_VERSION", "?")
    if built != torch.__version__.split("+")[0]:
        return None, f"the native core was built for torch {built}, not {torch.__version__}"
    if getattr(module, "ABI", None) != ABI:
        return None, "the native core is out of date with this tether: rebuild it"
    # The core writes ring-file records that ringfile.read_ring reads after a death: a core
    # writing another layout would leave records no one can read, found only at a crash.
    difference = _layout_difference(getattr(module, "RECORD_LAYOUT", None))
    if difference:
        return None, f"{_OTHER_LAYOUT} ({difference}): rebuild it"
    return cast(NativeModule, module), ""


def choose(config: Config) -> tuple[NativeModule | None, str]:
    """The native core's module if ``config.recorder`` asks for it and it loads; else None and
    why the Python recorder records. :class:`ConfigError` where it is required and cannot load."""
    if config.recorder == "python":
        return None, "TETHER_RECORDER=python asks for it"
    module, why = load()
    if module is None and config.recorder == "native":
        raise ConfigError(f"TETHER_RECORDER=native, but {why}")
    return module, why


def new_recorder(config: Config, *, ring_path: Path | None = None) -> Recorder:
    """The recorder ``config.recorder`` asks for: the native core where it loads ("auto", saying
    once why not where it does not), or the Python recorder. ``ring_path``: the ring file."""
    module, why = choose(config)
    if module is not None:
        return NativeRecorder(config, module, ring_path=ring_path)
    if config.recorder == "auto":
        # A core refused for its layout is a broken build, not a choice: said where it shows.
        level = logging.WARNING if why.startswith(_OTHER_LAYOUT) else logging.INFO
        logger.log(level, "recording with the Python recorder: %s", why)
    return Recorder(config, ring_path=ring_path)


class NativeRing(Ring):
    """The core's ring, read as the Python ring is."""

    def __init__(self, recorder: NativeRecorder) -> None:  # no slots: the core holds them
        self.capacity = recorder.config.ring_size
        self._recorder = recorder

    def add(self, entry: Entry) -> None:
        raise TypeError("the native core records operations itself")

    def snapshot(self) -> list[Entry]:
        return self._recorder.entries()


def _counter(index: int) -> Any:
    """A counter of the core's: read from it; RecordedGroup's own writes (its zeroes at
    construction) go nowhere."""
    return property(
        lambda self: self.recorder.core.group_status(self.slot)[index],
        lambda self, value: None,
    )


class NativeGroup(RecordedGroup):
    """A group recorded by the core: its counters are the core's, under the group's slot (the
    core numbers groups in creation order too)."""

    seq = _counter(0)
    last_started = _counter(1)
    last_completed = _counter(2)

    @property
    def last_done(self) -> tuple[Entry, Any] | None:
        recorder: NativeRecorder = self.recorder  # type: ignore[assignment]
        rid, work = recorder.core.last_done(self.slot)
        if rid is None:
            return None
        found = recorder.entries(only=[rid])
        return (found[0], work) if found else None

    @last_done.setter
    def last_done(self, value: tuple[Entry, Any] | None) -> None:
        if value is None:
            return
        raise AttributeError("the native core keeps each group's last finished operation")

    def status(self) -> dict[str, int]:
        recorder: NativeRecorder = self.recorder  # type: ignore[assignment]
        seq, started, completed, _, _ = recorder.core.group_status(self.slot)
        return {
            "last_enqueued_collective": seq,
            "last_started_collective": started,
            "last_completed_collective": completed,
        }


class NativeRecorder(Recorder):
    """The recorder whose ring, counters and completion tracking are the native core's."""

    native = True
    _group_class = NativeGroup

    def __init__(
        self, config: Config, module: NativeModule, *, ring_path: Path | None = None
    ) -> None:
        super().__init__(config, ring_path=ring_path)
        self.module = module
        self.core: Core = module.Core(
            config.ring_size,
            config.stack_depth,
            is_library,
            frames.WALK_ON,
            P2P_SEQ_BASE,
            str(ring_path) if self.ring_file is not None else "",
            RECORDS_AT,
        )
        self.ring = NativeRing(self)
        self._bugs_logged: set[str] = set()

    def _new_slot(self, group_rank: int, slot: int) -> None:
        # The core numbers its groups in creation order too: its id for the group is the slot.
        core_slot = self.core.add_group(group_rank)
        if core_slot != slot:
            raise AssertionError(f"the core's group {core_slot} is not slot {slot}")

    def prepare_derived(self, pg: Any) -> None:
        """Ready a group split or merged from a recorded one for :meth:`wrap` (a no-op for any
        other group).

        The core gave it a recording backend, not yet recording, which torch put in the slot of
        the parent's type for the device (the core's, CUSTOM), while the group's default type
        is the parent's own (gloo's), which the group lacks: its ``rank()`` would fail. The
        backend the recording one wraps takes that slot here, as in any recorded group."""
        backend = self.recording_backend(pg)
        if backend is None or backend.attached:
            return
        for device in pg._device_types:
            inner = backend.inner(device.type)
            pg._register_backend(device, backend_type(inner), inner)
            pg._register_backend(device, torch.distributed.ProcessGroup.BackendType.CUSTOM, backend)

    def wrap(self, pg: Any, group: RecordedGroup, devices: dict[str, Any]) -> Any:
        """Put a recording backend over ``devices`` (device type -> its real backend) of
        ``pg``, or have the one a split made record (:meth:`prepare_derived`); returns it."""
        assert isinstance(group, NativeGroup)
        derived = self.recording_backend(pg)
        if derived is not None and not derived.attached:
            derived.attach(group.slot)
            return derived
        inners = [
            (device, backend, group.backends.get(device) or backend.name())
            for device, backend in devices.items()
        ]
        default = next(iter(devices))
        recording = self.module.RecordingBackend(
            self.core, group.slot, pg.rank(), pg.size(), inners, default
        )
        for device in devices:
            pg._register_backend(
                torch.device(device), torch.distributed.ProcessGroup.BackendType.CUSTOM, recording
            )
        if not self.is_wrapped(pg):
            # torch keeps one backend per type in a group and ignores a second: a third-party
            # backend registered as CUSTOM already holds the slot the core needs.
            logger.warning(
                "group %s (%s) is not recorded: its backend %s is registered as CUSTOM, the "
                "slot the native core takes; TETHER_RECORDER=python records it",
                pg.group_name,
                pg.group_desc,
                ", ".join(sorted(set(group.backends.values()))),
            )
        return recording

    def is_wrapped(self, pg: Any) -> bool:
        backend = self.recording_backend(pg)
        return backend is not None and bool(backend.attached)

    def recording_backend(self, pg: Any) -> RecordingBackend | None:
        for device in pg._device_types:
            try:
                backend = pg._get_backend(device)
            except Exception:  # a device without a backend
                continue
            if isinstance(backend, self.module.RecordingBackend):
                return backend
        return None

    # -- what the Python recorder's readers ask -----------------------------------------------
    def entries(self, only: list[int] | None = None) -> list[Entry]:
        """The ring's entries and those kept past eviction (or the ``only`` record ids)."""
        if only is not None and not only:
            return []  # the core reads an empty list as "the whole ring"
        rows = self.core.snapshot(only or [])
        self._log_bugs()
        return [self._entry(row) for row in rows]

    def _entry(self, row: Row) -> Entry:
        (rid, gid, method, name, seq, p2p_seq, op_id, is_p2p, in_sizes, in_dtypes, out_sizes,
         out_dtypes, stack, thread_id, created, started, completed, state, error) = row  # fmt: skip
        entry = Entry(
            self.by_slot[gid],
            OPS.get(method, _COALESCED),
            name,
            seq,
            p2p_seq,
            op_id,
            is_p2p,
            in_sizes,
            in_dtypes,
            out_sizes,
            out_dtypes,
            stack,
            thread_id,
            created,
        )
        entry.record_id = rid
        entry.time_started_ns = started
        entry.time_completed_ns = completed
        entry.state = _STATES[state]
        entry.error = error
        return entry

    def track(self, entry: Entry) -> None:
        raise TypeError("the native core tracks completion itself")

    def finish(self, entry: Entry) -> None:
        self.core.finish(entry.record_id)

    def reap(self, *, min_age_ns: int = 0) -> None:
        self.core.reap(min_age_ns)
        self._log_bugs()

    def inflight(self) -> list[Entry]:
        return self.entries(only=self.core.inflight()) if self.groups else []

    def oldest_inflight(self) -> Entry | None:
        rid = self.core.oldest_inflight()
        if rid < 0:
            return None
        found = self.entries(only=[rid])
        return found[0] if found else None

    def suspect(self, group: RecordedGroup) -> None:
        assert isinstance(group, NativeGroup)
        kept = self.core.suspect(group.slot)
        self.suspicion.update({e.record_id: e for e in self.entries(only=kept)})

    def find_failures(self) -> None:
        for group in self.by_slot[:]:
            rid, work = self.core.last_done(group.slot)
            if rid is None:
                continue
            try:
                future = work.get_future()
                done = bool(future.done())
            except Exception:  # a backend without futures cannot say: leave it completed
                self.core.forget_last_done(group.slot, rid)
                continue
            if not done:
                continue
            self.core.forget_last_done(group.slot, rid)
            try:
                future.value()
            except Exception as exc:  # the operation's own error: what the dump should say
                self.core.mark_failed(rid, f"{type(exc).__name__}: {str(exc)[:300]}")

    def _log_bugs(self) -> None:
        """Log each kind of bug the core met once (it cannot log: no GIL on its hot path)."""
        for bug in self.core.bugs():
            what, _, why = bug.partition(": ")
            if what not in self._bugs_logged:
                self._bugs_logged.add(what)
                logger.error("%s failed; the operation runs on unrecorded (%s)", what, why)
