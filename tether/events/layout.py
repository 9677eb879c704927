"""Where an event's files live and how they are named and written (docs/dump-format.md).

``DUMP_DIR/<event-id>/rank_<global rank>`` for a rank's dump, ``stacks_<rank>.txt`` beside it
for the threads of a rank that could not dump itself, ``DUMP_DIR/.jobs/`` for the running jobs.
Event ids sort by time and end with the reason (``20261130T101500.123456Z-manual``). Every file
appears complete or not at all: it is written under a name no other writer uses, then moved (or
linked) into place.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import re
import threading
from pathlib import Path

from tether._exceptions import ConfigError

__all__ = [
    "FILE_PREFIX",
    "JOBS_DIR",
    "MAX_EVENT_ID",
    "check_event_id",
    "dump_root",
    "new_event_id",
    "rank_file",
    "rank_of",
    "stacks_file",
    "temp_name",
    "write_atomic",
]

FILE_PREFIX = "rank_"
"""A rank's dump file is ``rank_<global rank>``: pass it to torch's analyzer as ``-p rank_``."""
JOBS_DIR = ".jobs"
"""Hidden, like ``.stacks``: never taken for an event."""
MAX_EVENT_ID = 128

_REASON = re.compile(r"[^a-z0-9_]+")
_EVENT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_temp_serial = itertools.count()


def dump_root(dump_dir: Path) -> Path:
    """The dump directory as every writer and reader names it (``~`` expanded, absolute)."""
    return dump_dir.expanduser().resolve()


def rank_file(event_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s dump in an event directory."""
    return event_dir / f"{FILE_PREFIX}{rank}"


def rank_of(path: Path) -> int | None:
    """The rank a dump file's name says (``rank_3`` -> 3); None for any other name."""
    suffix = path.name[len(FILE_PREFIX) :]
    if path.name.startswith(FILE_PREFIX) and suffix.isascii() and suffix.isdigit():
        return int(suffix)
    return None


def stacks_file(event_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s stacks file in an event directory (:mod:`tether.events.stacks`)."""
    return event_dir / f"stacks_{rank}.txt"


def elastic_timeline_file(event_dir: Path) -> Path:
    """What an elastic job went through after the deaths of this event (``tether run --elastic``
    writes it, ``tether analyze`` reads it): JSON, ``{"world_size": n, "epochs": [...]}``."""
    return event_dir / "elastic.json"


def nodes_file(event_dir: Path) -> Path:
    """Where each node's part of an event came from, on a job of several nodes (the node that
    assembles it writes it, ``tether analyze`` reads it): JSON, ``{"nodes": [{"node", "host",
    "ranks", "part": "here" | "brought" | "missing", "why", "last_heard_ns"}]}``."""
    return event_dir / "nodes.json"


def new_event_id(reason: str, now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    tag = _REASON.sub("_", reason.lower()).strip("_") or "dump"
    return f"{now.strftime('%Y%m%dT%H%M%S.%f')}Z-{tag}"


def clock(time_ns: int) -> str:
    """A wall-clock time as the event's lines and verdicts say it: ``19:51:01.7`` (UTC)."""
    moment = _dt.datetime.fromtimestamp(time_ns / 1e9, tz=_dt.timezone.utc)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 100_000}"


def check_event_id(event_id: object) -> str:
    """``event_id`` if it is a plain file name that stays inside the dump directory: not
    hidden (``.jobs``, ``.stacks`` live there), no separators, no ``..``, bounded length."""
    if (
        not isinstance(event_id, str)
        or len(event_id) > MAX_EVENT_ID
        or not _EVENT_ID.fullmatch(event_id)
        or ".." in event_id
    ):
        raise ConfigError(
            f"event id {event_id!r} is not a plain file name of at most {MAX_EVENT_ID} "
            "characters (letters, digits, '.', '_', '-'; no '..', not starting with '.')"
        )
    return event_id


def temp_name(final: Path) -> Path:
    """A temporary name next to ``final`` that no other writer in any thread or process uses:
    two writers of one file must not truncate or delete each other's half-written copy."""
    serial = next(_temp_serial)  # atomic under the GIL
    return final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.{serial}.tmp")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` in one step: a reader (``tether analyze``, ``tether dump``,
    Prometheus) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the replace; left behind by a failed write
