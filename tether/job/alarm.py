"""Job-wide alarms through the job's own store: "every rank, dump into this event, now".

Keys live in the store beneath every prefix (the TCPStore that torchrun or the user created), so
any process that can reach it can raise an alarm: a rank's watchdog, the launcher, ``tether dump``.

    tether/alarm/<n>            JSON payload of the n-th alarm (n = 1, 2, ...), set once with
                                compare_set: concurrent raisers of the same epoch share one event
    tether/alarm/<n>/done/<r>   set by rank r once its part of alarm n is on disk (DUMPED,
                                DUMP_FAILED: ...), or by whoever read its stacks instead
    tether/alarm/<n>/aborting/<r> set by rank r once it decided to abort on alarm n
    tether/alarm/<n>/leaving/<r>  set by rank r when it is about to exit after alarm n
    tether/proc/<r>             JSON: host, pid, its start time, torchrun attempt, stack file,
                                debug server address of rank r

Every rank waits on the key of the next alarm with its own store connection, so an alarm reaches
all ranks in one store round trip: no polling interval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from tether._exceptions import BadAlarmError, ConfigError, StoreUnreachableError
from tether.events.layout import check_event_id, new_event_id

__all__ = [
    "ABORTING",
    "DONE",
    "DUMPED",
    "DUMP_FAILED",
    "EXITED",
    "HANG_EXIT_CODE",
    "LEAVING",
    "NEWS_KEY",
    "Alarm",
    "AlarmBoard",
    "BadAlarmError",
    "HangSite",
    "answered_itself",
    "first_line",
    "raw_store",
]

_ALARM = "tether/alarm"
_PROC = "tether/proc"
NEWS_KEY = "tether/news"
"""A counter raised after each alarm and each membership decision is written: a node's agent
reads it alone (one request) to learn whether there is anything to read."""

HANG_EXIT_CODE = 75
"""Exit status of a rank aborted after a hang, and of ``tether run`` then (EX_TEMPFAIL: a
restart may succeed)."""
# The phases of an alarm's answer keys, in the order a rank goes through them.
DONE = "done"
"""Its part of the event is on disk (or someone else's word for it)."""
ABORTING = "aborting"
"""It decided to abort: a death from here on is that abort's teardown, not a new incident."""
LEAVING = "leaving"
"""It is about to exit."""
DUMPED = "dump"
"""What a rank's done key says once its own dump is on disk."""
DUMP_FAILED = "dump failed"
"""How a rank's done key starts when it answered but its dump could not be written."""
EXITED = "exited before answering"
"""A rank's done key, set by its launcher, when it exited before it answered."""


def _store_timeout() -> type[Exception]:
    """torch's store timeout error, imported only where a store is waited on: this module is
    read by tools that never load torch."""
    from torch.distributed import DistStoreError

    return DistStoreError


def answered_itself(what: str) -> bool:
    """A done key the rank set itself (it is alive and will leave), not one set for it (its
    stacks read by the launcher or a peer, its exit noted)."""
    return what == DUMPED or what.startswith(DUMP_FAILED)


def first_line(exc: BaseException) -> str:
    """An error's first line: torch's store errors carry a C++ backtrace after it."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def raw_store(store: Any) -> Any:
    """The store beneath any PrefixStore wrappers."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


@dataclasses.dataclass(frozen=True, slots=True)
class HangSite:
    """The operation a watchdog saw outlive the hang timeout: the fields a hang alarm adds, so
    that the analyzer knows which operation is in question and when it was seen."""

    group: str
    group_desc: str
    seq: int
    op: str
    seen_by: int
    age_s: float
    timeout_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Alarm:
    epoch: int
    event_id: str
    reason: str
    """"hang", "crash", "signal", "manual", ..."""
    origin: str
    """Who raised it: "rank 3", "launcher", "cli"."""
    detail: str = ""
    dead_ranks: dict[str, str] = dataclasses.field(default_factory=dict)
    """Rank -> how it died ("exit code 1", "signal SIGKILL"), for crashes."""
    time_ns: int = 0
    # -- a hang alarm's operation (optional: absent from other alarms and older raisers) --------
    group: str = ""
    """The process group whose operation outlived the hang timeout (its name)."""
    group_desc: str = ""
    seq: int = 0
    """The operation's collective sequence number in ``group`` (0: unknown, or a send/recv)."""
    op: str = ""
    """Its profiling name (``gloo:all_reduce``)."""
    seen_by: int = -1
    """The global rank whose watchdog saw it (-1: not a hang alarm)."""
    age_s: float = 0.0
    """How long it had been in flight on ``seen_by`` when the alarm was raised."""
    timeout_s: float = 0.0
    """That rank's hang timeout."""
    # -- a node fault's nodes (optional: absent from other alarms) ------------------------------
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    """Host -> what became of it: ``lost`` (its launcher and ranks are gone), ``unreachable``
    (nothing there answers: the host is down, or the link to it), ``frozen`` (its host answers,
    its launcher does not)."""
    heard: dict[str, str] = dataclasses.field(default_factory=dict)
    """Host -> when its launcher was last heard (Unix time in ns, as a decimal string)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Alarm:
        """Parse and check an alarm; :class:`BadAlarmError` says what is wrong with it."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bytes not UTF-8; arrays nested too deep
            raise BadAlarmError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise BadAlarmError(f"not a JSON object: {_short(raw)}")
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise BadAlarmError(f"missing {', '.join(missing)}: {_short(raw)}")
        for field in dataclasses.fields(cls):
            if field.name in data and not _has_type(data[field.name], _TYPES[field.name]):
                raise BadAlarmError(f"{field.name} is not a {_TYPES[field.name]}: {_short(raw)}")
        try:
            check_event_id(data["event_id"])  # every rank writes into DUMP_DIR/<event_id>
        except ConfigError as exc:
            raise BadAlarmError(str(exc)) from exc
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        for name in ("age_s", "timeout_s"):  # JSON writes 2.0 as 2.0, but a raiser may send 2
            if name in fields:
                fields[name] = float(fields[name])
        return cls(**fields)


_REQUIRED = ("epoch", "event_id", "reason", "origin")
_TYPES = {
    "epoch": "int",
    "event_id": "str",
    "reason": "str",
    "origin": "str",
    "detail": "str",
    "dead_ranks": "dict of str",
    "time_ns": "int",
    "group": "str",
    "group_desc": "str",
    "seq": "int",
    "op": "str",
    "seen_by": "int",
    "age_s": "float",
    "timeout_s": "float",
    "nodes": "dict of str",
    "heard": "dict of str",
}


def _has_type(value: object, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:  # inf (JSON's 1e999) is no duration; an int past a float's range fails float()
            return math.isfinite(value)
        except OverflowError:
            return False
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw


def _short(raw: bytes | str, limit: int = 200) -> str:
    text = _text(raw)
    return text if len(text) <= limit else text[:limit] + "..."


class AlarmBoard:
    """The alarm keys of one job's store. Safe to share between threads only for non-blocking
    calls; a thread that blocks in :meth:`wait` needs its own board (see :meth:`clone`)."""

    def __init__(self, store: Any) -> None:
        self.store = raw_store(store)

    def clone(self) -> AlarmBoard:
        """A board on a new connection to the same store, where the store supports that."""
        try:
            return AlarmBoard(self.store.clone())
        except (AttributeError, RuntimeError):
            return self

    def key(self, epoch: int) -> str:
        return f"{_ALARM}/{epoch}"

    def put(self, alarm: Alarm) -> Alarm:
        """Set ``alarm`` at its epoch, or return the alarm someone else set there first (the
        one store step :meth:`raise_alarm` is built of)."""
        payload = alarm.to_json()
        current = self.store.compare_set(self.key(alarm.epoch), "", payload)
        if _text(current) == payload:  # ours: the agents' next look reads it
            self.store.add(NEWS_KEY, 1)
        return self._parse(alarm.epoch, current)

    def raise_alarm(
        self,
        reason: str,
        *,
        origin: str,
        start: int = 1,
        detail: str = "",
        dead_ranks: Mapping[str, str] | None = None,
        site: HangSite | None = None,
        nodes: Mapping[str, str] | None = None,
        heard: Mapping[str, str] | None = None,
        event_id: str | None = None,
        join: bool = False,
        on_bad_key: Callable[[int, BadAlarmError], None] | None = None,
    ) -> Alarm:
        """Raise a job-wide alarm, so that every rank dumps into its event: the one way anyone
        (a rank's watchdog or debug server, the launcher, ``tether dump``) raises one.

        It takes the first free epoch from ``start``. ``join``: an alarm of the same reason
        found at one of those epochs is the same incident seen from elsewhere, and is returned
        instead of raising a second event (a hang every rank sees is one event). A key holding
        no valid alarm is passed over (``on_bad_key`` is told). ``site``: the operation a hang
        alarm is about. A store that fails is a :class:`StoreUnreachableError`."""
        alarm = Alarm(
            epoch=start,
            event_id=event_id or new_event_id(reason),
            reason=reason,
            origin=origin,
            detail=detail,
            dead_ranks=dict(dead_ranks or {}),
            time_ns=time.time_ns(),
            nodes=dict(nodes or {}),
            heard=dict(heard or {}),
        )
        if site is not None:
            alarm = dataclasses.replace(alarm, **dataclasses.asdict(site))
        try:
            while True:
                try:
                    got = self.put(alarm)
                except BadAlarmError as exc:
                    if on_bad_key is not None:
                        on_bad_key(alarm.epoch, exc)
                else:
                    if got == alarm or (join and got.reason == reason):
                        return got
                alarm = dataclasses.replace(alarm, epoch=alarm.epoch + 1)
        except RuntimeError as exc:  # DistNetworkError: the store's server is gone
            raise StoreUnreachableError(f"lost the job's store ({first_line(exc)})") from exc

    def get(self, epoch: int) -> Alarm | None:
        """Alarm ``epoch``; None if not raised yet, :class:`BadAlarmError` if its key holds
        something else."""
        if not self.store.check([self.key(epoch)]):
            return None
        return self._parse(epoch, self.store.get(self.key(epoch)))

    def _parse(self, epoch: int, raw: bytes | str) -> Alarm:
        alarm = Alarm.from_json(raw)
        if alarm.epoch != epoch:  # answering it would send a rank back to an old epoch
            raise BadAlarmError(f"{self.key(epoch)} holds an alarm of epoch {alarm.epoch}")
        return alarm

    def wait(self, epoch: int, timeout: float) -> Alarm | None:
        """Block up to ``timeout`` seconds for alarm ``epoch``."""
        try:
            self.store.wait([self.key(epoch)], timedelta(seconds=timeout))
        except _store_timeout():  # timed out; a DistNetworkError (store gone) propagates
            return None
        return self.get(epoch)

    def mark_done(self, epoch: int, rank: int, what: str, *, phase: str = DONE) -> None:
        self.store.set(f"{self.key(epoch)}/{phase}/{rank}", what)

    def done(self, epoch: int, world_size: int, *, phase: str = DONE) -> dict[int, str]:
        """The ranks that reached ``phase`` of alarm ``epoch``, with what they said."""
        out: dict[int, str] = {}
        for rank in range(world_size):
            key = f"{self.key(epoch)}/{phase}/{rank}"
            if self.store.check([key]):
                out[rank] = self.store.get(key).decode()
        return out

    def wait_done(
        self, epoch: int, ranks: list[int], timeout: float, *, phase: str = DONE
    ) -> dict[int, str]:
        """Wait up to ``timeout`` seconds for ``ranks`` to reach ``phase`` of alarm ``epoch``
        ("done": their part is on disk); returns who did, with what they said."""
        keys = [f"{self.key(epoch)}/{phase}/{rank}" for rank in ranks]
        if keys:
            with contextlib.suppress(_store_timeout()):  # timed out: report who made it
                self.store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
        return {
            rank: self.store.get(key).decode()
            for rank, key in zip(ranks, keys, strict=True)
            if self.store.check([key])
        }

    def publish_proc(self, rank: int, info: dict[str, Any]) -> None:
        self.store.set(f"{_PROC}/{rank}", json.dumps(info, sort_keys=True))

    def procs(self, world_size: int, *, attempt: int | None = None) -> dict[int, dict[str, Any]]:
        """What each rank published; with ``attempt``, only the ranks of that torchrun attempt
        (the store outlives restarts, and an entry of an earlier attempt names a dead pid)."""
        found = {rank: self.proc(rank, attempt=attempt) for rank in range(world_size)}
        return {rank: info for rank, info in found.items() if info is not None}

    def proc(self, rank: int, *, attempt: int | None = None) -> dict[str, Any] | None:
        """What ``rank`` published (of torchrun's ``attempt``, if given); None if nothing."""
        key = f"{_PROC}/{rank}"
        if not self.store.check([key]):
            return None
        info = _json_object(self.store.get(key))
        if info is None or (attempt is not None and info.get("attempt", 0) != attempt):
            return None
        return info
