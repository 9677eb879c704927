"""Dumps: torch's flight-recorder pickle (schema "2.10"), a file per rank, a directory per event.

Layout: ``DUMP_DIR/<event-id>/rank_<global rank>``. Event ids sort by time and end with the
reason (``20261130T101500.123456Z-manual``); every rank of the job writes into the same event id,
agreed through the job's store. A file appears only complete: it is written under a temporary
name, flushed to disk, then hard-linked to its final name, which also refuses to replace a file
that is already there.
"""

from __future__ import annotations

import errno
import os
import pickle
import platform
import threading
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from tether._exceptions import DumpError
from tether._log import get_logger
from tether.events.columns import write_columns
from tether.events.layout import (
    check_event_id,
    dump_root,
    new_event_id,
    rank_file,
    temp_name,
    write_atomic,
)
from tether.events.schema import SCHEMA_VERSION, TETHER_FORMAT, DumpEntry
from tether.recorder import frames
from tether.recorder.group import RecordedGroup
from tether.recorder.ops import dtype_name
from tether.recorder.recorder import Recorder
from tether.recorder.ring import Entry

__all__ = ["build_dump", "torch_dump", "write_dump", "write_event", "write_torch_file"]

logger = get_logger(__name__)

_dump_counts: Counter[str] = Counter()
_dump_lock = threading.Lock()


def _agree_event_id(recorder: Recorder, reason: str) -> str:
    """The n-th dump for ``reason`` on every rank goes to the same event: the first rank to
    get there names it, the others read the name from the store."""
    with _dump_lock:
        _dump_counts[reason] += 1
        n = _dump_counts[reason]
    proposal = new_event_id(reason)
    if recorder.store is None:
        return proposal
    try:
        agreed = recorder.store.compare_set(f"tether/event/{reason}/{n}", "", proposal)
        return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    except Exception as exc:  # the store may be gone at exit; a local id still loses nothing
        logger.warning("no event id agreed through the store (%s): using %s", exc, proposal)
        return proposal


def _sizes(shapes: list[Any] | None) -> list[list[int]]:
    return [list(s) for s in shapes or ()]


def _entry_dict(e: Entry, stack: list[frames.Frame], threads: dict[int, str]) -> DumpEntry:
    out_shapes = e.in_shapes if e.out_shapes is None else e.out_shapes
    out_dtypes = e.in_dtypes if e.out_dtypes is None else e.out_dtypes
    completed = e.time_completed_ns or None
    started = e.time_started_ns or None
    return {
        "record_id": e.record_id,
        "pg_id": e.group.uid,
        "process_group": (e.group.name, e.group.desc),
        "collective_seq_id": e.collective_seq_id,
        "p2p_seq_id": e.p2p_seq_id,
        "op_id": e.op_id,
        "profiling_name": e.profiling_name,
        "time_created_ns": e.time_created_ns,
        "duration_ms": (completed - started) / 1e6 if completed and started else None,
        "input_sizes": _sizes(e.in_shapes),
        "input_dtypes": [dtype_name(d) for d in e.in_dtypes],
        "output_sizes": _sizes(out_shapes),
        "output_dtypes": [dtype_name(d) for d in out_dtypes],
        "state": e.state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": completed is not None or e.error is not None,
        "timeout_ms": e.group.timeout_ms,
        "is_p2p": e.is_p2p,
        "thread_id": str(e.thread_id),
        "thread_name": threads.get(e.thread_id, ""),
        "frames": stack,
    }


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


def build_dump(
    recorder: Recorder, *, reason: str, event_id: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """This rank's dump as plain data, in torch's schema plus a ``tether`` section (to which
    ``extra`` is added)."""
    recorder.reap()
    recorder.find_failures()
    entries = recorder.entries()
    stacks = frames.symbolize([e.frames for e in entries], recorder.stack_depth)
    threads = _thread_names()
    groups = {e.group.name: e.group for e in entries} | recorder.groups
    return {
        "version": SCHEMA_VERSION,
        "comm_lib_version": f"torch {torch.__version__!s}",
        "pg_config": {name: g.config() for name, g in groups.items()},
        "pg_status": {str(g.uid): g.status() for g in groups.values()},
        "entries": [_entry_dict(e, s, threads) for e, s in zip(entries, stacks, strict=True)],
        # torch's analyzer reads only the keys above; everything tether adds lives here.
        "tether": {
            "format": TETHER_FORMAT,
            "event": event_id,
            "reason": reason,
            "global_rank": recorder.global_rank,
            "world_size": recorder.world_size,
            "host": recorder.host,
            "pid": recorder.pid,
            "job_id": recorder.config.job_id,
            "torch_version": str(torch.__version__),
            "python_version": platform.python_version(),
            "backends": sorted({b for g in groups.values() for b in g.backends.values()}),
            "clock_offset_ns": recorder.clock_offset_ns,
            "clock_error_ns": recorder.clock_error_ns,
            "ring_size": recorder.ring.capacity,
            # Completed entries the ring dropped for newer ones (never one still in flight).
            "dropped": _dropped(entries, recorder.ring.capacity),
            # What the watchdog calls a hang: the analyzer weighs operations' ages against it.
            "hang_timeout_s": float(recorder.config.hang_timeout),
            "dump_time_ns": time.time_ns(),
            "stacks": frames.python_stacks(),
            # Per reconfigured group, each reconfigure (torch 2.14+): which communicator an
            # entry ran on is the last one made before the entry was created.
            "reconfigures": {n: g.reconfigures for n, g in groups.items() if g.reconfigures},
            # Operations the backend failed (state "started", never completed): record id -> error.
            "failed": {str(e.record_id): e.error for e in entries if e.error is not None},
            **(extra or {}),
        },
    }


def _dropped(entries: list[Entry], capacity: int) -> int:
    """How many records older than the ring's window are not in ``entries`` (record ids count
    every operation issued, from 0)."""
    if not entries or capacity <= 0:
        return 0
    window = entries[-1].record_id + 1 - capacity
    return max(window, 0) - sum(1 for e in entries if e.record_id < window)


def torch_dump(
    data: dict[str, Any],
    *,
    stacks: bool,
    only_active: bool,
    groups: Collection[RecordedGroup] | None = None,
) -> dict[str, Any]:
    """A dump as torch's own single-rank dump would hold it: its ``TORCH_INCLUDE_STACK_TRACE``
    (``stacks``) and ``TORCH_INCLUDE_ONLY_ACTIVE`` (``only_active``: no completed entry), and
    only ``groups`` where given (torch keeps a recorder per backend)."""
    names = None if groups is None else {g.name for g in groups}
    uids = None if groups is None else {str(g.uid) for g in groups}
    entries = [
        e if stacks else {**e, "frames": []}
        for e in data["entries"]
        if not (only_active and e["state"] == "completed")
        and (names is None or e["process_group"][0] in names)
    ]
    out = {**data, "entries": entries}
    if names is not None and uids is not None:
        out["pg_config"] = {k: v for k, v in data["pg_config"].items() if k in names}
        out["pg_status"] = {k: v for k, v in data["pg_status"].items() if k in uids}
    return out


def write_torch_file(data: dict[str, Any], path: Path) -> Path:
    """Write a torch-shaped dump where torch's recorder writes one (``<prefix><rank>``),
    replacing it in one step, as torch replaces it on each dump."""
    try:
        write_atomic(path, pickle.dumps(data, protocol=4))
    except OSError as exc:
        raise DumpError(f"could not write dump {path}: {exc.strerror or exc}") from exc
    return path


def write_dump(data: dict[str, Any], event_dir: Path, rank: int) -> Path:
    """Write one rank's dump atomically; never replaces an existing file."""
    final = rank_file(event_dir, rank)
    tmp = temp_name(final)
    created = False
    try:
        event_dir.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:  # "x": never open a file someone else is writing
            created = True
            pickle.dump(data, f, protocol=4)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, final)
    except FileExistsError as exc:
        raise DumpError(f"{final} already exists; an event is never overwritten") from exc
    except OSError as exc:
        hint = (
            "the disk is full; free space or point --dump-dir / TETHER_DUMP_DIR elsewhere"
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            else "check that --dump-dir / TETHER_DUMP_DIR is a writable directory"
        )
        raise DumpError(f"could not write dump {final}: {exc.strerror or exc}; {hint}") from exc
    finally:
        if created:
            tmp.unlink(missing_ok=True)
    return final


def write_event(
    recorder: Recorder,
    reason: str,
    *,
    event_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``recorder``'s dump into event ``event_id`` (default: the n-th event of
    ``reason``, agreed with the other ranks through the job's store) and return its path."""
    event_id = check_event_id(event_id) if event_id else _agree_event_id(recorder, reason)
    rank = recorder.global_rank if recorder.global_rank >= 0 else 0
    data = build_dump(recorder, reason=reason, event_id=event_id, extra=extra)
    event_dir = dump_root(recorder.config.dump_dir) / event_id
    path = write_dump(data, event_dir, rank)
    logger.info("dumped %d entries to %s", len(data["entries"]), path)
    try:
        write_columns(data, event_dir, rank)
    except OSError as exc:  # the dump is written: the analyzer reads it instead
        logger.warning("no column file beside %s: %s", path, exc)
    config = recorder.config
    if config.fr_dump_prefix:  # where a job set up for torch's recorder looks for its dump
        try:
            also = write_torch_file(
                torch_dump(
                    data, stacks=config.fr_include_stacks, only_active=config.fr_only_active
                ),
                Path(f"{config.fr_dump_prefix}{rank}"),
            )
            logger.info("and to %s (TETHER_FR_DUMP_PREFIX / TORCH_FR_DUMP_TEMP_FILE)", also)
        except DumpError as exc:  # the event's file is written: that dump is not lost
            logger.error("%s", exc)
    return path
