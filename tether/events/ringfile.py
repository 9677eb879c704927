"""The ring file: a rank's record kept where its death cannot take it.

Each recording process keeps its ring in a memory-mapped file, ``DUMP_DIR/.rings/<host>-<pid>``.
The pages belong to the kernel's page cache, so a process killed by SIGKILL, SIGABRT, SIGSEGV or
the OOM killer leaves them behind, complete up to its last store; ``tether run``'s agent turns
the file of a rank that died into that rank's dump in the crash event (:func:`recover`), marked
as recovered after death. A clean exit removes the file.

Both recorders write an operation's record as it is issued, on the issuing thread, before the
backend sees it, so a backend that aborts the process inside the call leaves the record that
killed it. The native core also writes each change of state as it happens; the Python recorder
writes completions from its watchdog thread every pass (50 ms). Both write this layout, so one
reader serves both. Little-endian, fixed offsets:

    header   HEADER_SIZE bytes        magic, version, sizes, rank, world size, pid, host, job
    groups   GROUP_SLOTS x GROUP_SIZE one slot per group the process created (name, desc, ranks)
    records  capacity x RECORD_SIZE   record id r in slot r % capacity

A record starts with a sequence word, odd while it is being written: a death mid-write leaves it
odd, and the reader passes that record over rather than trust half of it. Torch-free.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from pathlib import Path
from typing import Any, TypedDict

from tether.events.schema import SCHEMA_VERSION, TETHER_FORMAT

__all__ = [
    "GROUP_SIZE",
    "GROUP_SLOTS",
    "HEADER_SIZE",
    "RECORD_LAYOUT",
    "RECORD_SIZE",
    "RINGS_DIR",
    "STATES",
    "Fixed",
    "RecordLayout",
    "RingFile",
    "fixed",
    "read_ring",
    "ring_file",
]

RINGS_DIR = ".rings"
MAGIC = b"TETHRNG1"
VERSION = 1
HEADER_SIZE = 4096
GROUP_SLOTS = 256
"""Groups a ring file describes; a process creating more records the rest without names."""
GROUP_SIZE = 2048
RECORD_SIZE = 512
TENSORS = 4
"""Shapes kept per side of an operation (its count is kept whole)."""
DIMS = 4
"""Dimensions kept per shape (a deeper shape keeps its first ones and its true rank)."""
STATES = ("scheduled", "started", "completed")

# magic, version, record size, capacity, group slots, group size, rank, world size, pid,
# clock offset, host, job id, torch version, hang timeout
_HEADER = struct.Struct("<8sIIIIIiiqq64s64s32sd")
# used, uid, group rank, timeout (ms), name, desc; the members' string follows
_GROUP = struct.Struct("<B3xiiq64s128s")
_RANKS_AT = _GROUP.size
DTYPE_SIZE = 12
"""Bytes of a dtype's name in a record (NUL-terminated)."""
NAME_SIZE = 48
"""Bytes of a record's profiling name (NUL-terminated)."""

# The record, field by field (None: padding), in the order the Python recorder packs it: the one
# declaration of the layout on this side. The native core declares its own (its ring_file.h) and
# exports it; tether.recorder.native refuses a core whose layout is not RECORD_LAYOUT.
_RECORD_FIELDS: tuple[tuple[str | None, str], ...] = (
    ("seq_word", "I"),  # odd while the record is being written
    ("state", "B"),
    ("is_p2p", "B"),
    ("inputs", "B"),
    ("outputs", "B"),  # SAME_AS_INPUTS: the outputs are the inputs
    ("record_id", "q"),
    ("group", "i"),  # the group's slot
    (None, "4x"),
    ("seq", "q"),
    ("p2p_seq", "q"),
    ("op_id", "q"),
    ("thread_id", "Q"),
    ("created", "q"),
    ("started", "q"),
    ("completed", "q"),
    ("name", f"{NAME_SIZE}s"),  # the profiling name; from here on, what fixed() packs
    ("ndims", f"{2 * TENSORS}B"),  # the true rank of each of the 2 x TENSORS shapes
    ("dims", f"{2 * TENSORS * DIMS}q"),  # their first DIMS dimensions
    ("dtypes", f"{2 * TENSORS * DTYPE_SIZE}s"),  # their dtype names
)
_TAIL_AT = next(i for i, (name, _) in enumerate(_RECORD_FIELDS) if name == "name")
_HEAD = struct.Struct("<" + "".join(f for _, f in _RECORD_FIELDS[:_TAIL_AT]))
_TAIL = struct.Struct("<" + "".join(f for _, f in _RECORD_FIELDS[_TAIL_AT:]))
_RECORD = struct.Struct(_HEAD.format + _TAIL.format[1:])


class RecordLayout(TypedDict):
    """A ring record's layout as both writers declare it: each field's (name, offset, size)."""

    version: int
    record_size: int
    fields: list[tuple[str, int, int]]


def _layout() -> RecordLayout:
    fields = []
    for i, (name, fmt) in enumerate(_RECORD_FIELDS):
        if name is not None:
            at = struct.calcsize("<" + "".join(f for _, f in _RECORD_FIELDS[:i]))
            fields.append((name, at, struct.calcsize("<" + fmt)))
    return {"version": VERSION, "record_size": RECORD_SIZE, "fields": fields}


RECORD_LAYOUT = _layout()
"""The record layout this module reads (and the Python recorder writes)."""


def _values() -> dict[str, slice]:
    """Where each field's values are in what ``_RECORD.unpack_from`` returns."""
    out, at = {}, 0
    for name, fmt in _RECORD_FIELDS:
        count = len(struct.unpack("<" + fmt, bytes(struct.calcsize("<" + fmt))))
        if name is not None:
            out[name] = slice(at, at + count)
        at += count
    return out


_VALUES = _values()
_SCALARS = slice(_VALUES["state"].start, _VALUES["name"].stop)  # state ... name, one value each
_WORD = struct.Struct("<I")
# The writer's view: the fixed part as one field, so a record is stored by one C call (which a
# thread switch cannot split), bound once: the Python recorder writes one per operation.
_pack_record = struct.Struct(f"{_HEAD.format}{_TAIL.size}s").pack_into
_pack_word = _WORD.pack_into
Fixed = tuple[int, int, bytes]
"""A record's input count, output count, and bytes from its name on (:func:`fixed`)."""
SAME_AS_INPUTS = 255
assert _HEADER.size <= HEADER_SIZE and _RECORD.size <= RECORD_SIZE
RECORDS_AT = HEADER_SIZE + GROUP_SLOTS * GROUP_SIZE
"""Where the records start (the native core is told; its record layout is checked at load)."""


def ring_file(dump_dir: Path, host: str, pid: int) -> Path:
    return dump_dir / RINGS_DIR / f"{host}-{pid}"


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _fixed(text: str, size: int) -> bytes:
    """``text`` in at most ``size - 1`` bytes (NUL-terminated), never cut inside a character."""
    raw = text.encode("utf-8")[: size - 1]
    return raw.decode("utf-8", "ignore").encode("utf-8")


class RingFile:
    """A ring file open for writing: the header, the groups, and (Python recorder) records."""

    def __init__(self, path: Path, capacity: int, *, host: str, pid: int) -> None:
        self.path = path
        self.capacity = capacity
        path.parent.mkdir(parents=True, exist_ok=True)
        size = RECORDS_AT + capacity * RECORD_SIZE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        # Each page written once now: the first store to a page of a file costs a fault (block
        # reservation, page-cache insertion: ~4 µs a record averaged over the first pass
        # through the ring, measured inside DDP on ext4), taken here instead of on the hot path.
        for at in range(0, size, mmap.PAGESIZE):
            self._map[at] = 0
        self._host, self._pid = host, pid
        self.identify(rank=-1, world_size=-1)

    def identify(
        self,
        *,
        rank: int,
        world_size: int,
        clock_offset_ns: int = 0,
        job_id: str = "",
        torch_version: str = "",
        hang_timeout_s: float = 0.0,
    ) -> None:
        _HEADER.pack_into(
            self._map, 0, MAGIC, VERSION, RECORD_SIZE, self.capacity, GROUP_SLOTS, GROUP_SIZE,
            rank, world_size, self._pid, clock_offset_ns, _fixed(self._host, 64),
            _fixed(job_id, 64), _fixed(torch_version, 32), hang_timeout_s,
        )  # fmt: skip

    def add_group(
        self, slot: int, *, uid: int, name: str, desc: str, ranks: str, group_rank: int,
        timeout_ms: int,
    ) -> None:  # fmt: skip
        if slot >= GROUP_SLOTS:
            return
        at = HEADER_SIZE + slot * GROUP_SIZE
        self._map[at + _RANKS_AT : at + GROUP_SIZE] = bytes(GROUP_SIZE - _RANKS_AT)
        raw = _fixed(ranks, GROUP_SIZE - _RANKS_AT)
        self._map[at + _RANKS_AT : at + _RANKS_AT + len(raw)] = raw
        _GROUP.pack_into(
            self._map, at, 1, uid, group_rank, timeout_ms, _fixed(name, 64), _fixed(desc, 128)
        )

    def write(
        self, state: int, is_p2p: bool, record_id: int, slot: int, seq: int, p2p_seq: int,
        op_id: int, thread_id: int, created: int, started: int, completed: int, fixed: Fixed,
    ) -> None:  # fmt: skip
        """Write one record; ``fixed`` (:func:`fixed`) is what stays the same as it advances.

        Positional, in the layout's order: the Python recorder calls this on the issuing thread
        for every operation (0.5 µs in a loop, ~3 right after a collective, with cold caches;
        packing the whole record field by field took 6). The record goes in with its sequence
        word odd, in one store no other Python thread can interleave with, then the word turns
        even: of two threads writing one slot, the last store wins whole. Only the word's
        parity is read (after a death), so it need not be read back here: 1, then 2."""
        m = self._map
        at = RECORDS_AT + (record_id % self.capacity) * RECORD_SIZE
        n_in, n_out, rest = fixed
        _pack_record(m, at, 1, state, is_p2p, n_in, n_out, record_id, slot, seq, p2p_seq, op_id,
                     thread_id, created, started, completed, rest)  # fmt: skip
        _pack_word(m, at, 2)

    def close(self, *, remove: bool) -> None:
        """Remove the file if ``remove``. The mapping stays until this object goes: a thread
        still issuing at exit writes into it harmlessly, rather than fail on a closed map."""
        if remove:
            self.path.unlink(missing_ok=True)


def fixed(
    name: str, inputs: list[tuple[list[int], str]], outputs: list[tuple[list[int], str]] | None
) -> Fixed:
    """The part of a record that does not change as it advances: the input and output counts,
    and the bytes from its name on (the shapes and dtypes). Callers cache it per operation;
    :meth:`RingFile.write` takes it with the rest, in the layout's order."""
    sides = [inputs[:TENSORS], (outputs or [])[:TENSORS]]
    ndims = [0] * (2 * TENSORS)
    dims = [0] * (2 * TENSORS * DIMS)
    dtypes = bytearray(2 * TENSORS * DTYPE_SIZE)
    for side, tensors in enumerate(sides):
        for i, (shape, dtype) in enumerate(tensors):
            k = side * TENSORS + i
            ndims[k] = min(len(shape), 255)
            dims[k * DIMS : k * DIMS + min(len(shape), DIMS)] = shape[:DIMS]
            raw = _fixed(dtype, DTYPE_SIZE)
            dtypes[k * DTYPE_SIZE : k * DTYPE_SIZE + len(raw)] = raw
    n_out = SAME_AS_INPUTS if outputs is None else min(len(outputs), 254)
    rest = _TAIL.pack(_fixed(name, NAME_SIZE), *ndims, *dims, bytes(dtypes))
    return min(len(inputs), 254), n_out, rest


def _reserve(fd: int, size: int) -> None:
    """The file's blocks, allocated now: on a full disk a store into a sparse mapping would kill
    the process with SIGBUS, at any later moment; this fails here instead, with ENOSPC."""
    fallocate = getattr(os, "posix_fallocate", None)  # Linux's; not on macOS
    if fallocate is None:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it
            raise


def _shapes(
    ndims: tuple[int, ...], dims: tuple[int, ...], dtypes: bytes, side: int, n: int
) -> tuple[list[list[int]], list[str]]:
    sizes: list[list[int]] = []
    names: list[str] = []
    for i in range(min(n, TENSORS)):
        k = side * TENSORS + i
        rank = ndims[k]
        shape = list(dims[k * DIMS : k * DIMS + min(rank, DIMS)])
        sizes.append(shape)
        names.append(_text(dtypes[k * DTYPE_SIZE : (k + 1) * DTYPE_SIZE]))
    return sizes, names


def read_ring(path: Path, *, how: str) -> dict[str, Any]:
    """The ring file at ``path`` as a dump (docs/dump-format.md), its ``tether`` section saying
    it was recovered after the process died (``how``). ValueError if it is not a ring file."""
    raw = path.read_bytes()
    if len(raw) < RECORDS_AT or raw[:8] != MAGIC:
        raise ValueError(f"{path} is not a tether ring file")
    header = _HEADER.unpack_from(raw, 0)
    (_, version, record_size, capacity, group_slots, group_size, rank, world_size, pid,
     clock_offset, host, job_id, torch_version, hang_timeout) = header  # fmt: skip
    if version != VERSION or record_size != RECORD_SIZE or group_size != GROUP_SIZE:
        raise ValueError(f"{path}: ring file version {version} is not this tether's")
    groups: dict[int, dict[str, Any]] = {}
    for slot in range(min(group_slots, GROUP_SLOTS)):
        at = HEADER_SIZE + slot * GROUP_SIZE
        used, uid, _, timeout_ms, name, desc = _GROUP.unpack_from(raw, at)
        if used:
            ranks = _text(raw[at + _RANKS_AT : at + GROUP_SIZE])
            groups[slot] = {"uid": uid, "name": _text(name), "desc": _text(desc), "ranks": ranks,
                            "timeout_ms": timeout_ms}  # fmt: skip
    entries = []
    for i in range(capacity):
        at = RECORDS_AT + i * RECORD_SIZE
        if at + RECORD_SIZE > len(raw):
            break
        fields = _RECORD.unpack_from(raw, at)
        seq_word = fields[0]
        if seq_word == 0 or seq_word & 1:  # never written, or cut short by the death
            continue
        (state, is_p2p, n_in, n_out, record_id, slot, cseq, p2p_seq, op_id, thread_id, created,
         started, completed, name) = fields[_SCALARS]  # fmt: skip
        ndims = fields[_VALUES["ndims"]]
        dims = fields[_VALUES["dims"]]
        (dtypes,) = fields[_VALUES["dtypes"]]
        group = groups.get(slot, {"uid": slot, "name": str(slot), "desc": "undefined",
                                  "ranks": "[]", "timeout_ms": 0})  # fmt: skip
        in_sizes, in_dtypes = _shapes(ndims, dims, dtypes, 0, n_in)
        if n_out == SAME_AS_INPUTS:
            out_sizes, out_dtypes = in_sizes, in_dtypes
        else:
            out_sizes, out_dtypes = _shapes(ndims, dims, dtypes, 1, n_out)
        state_name = STATES[state] if state < len(STATES) else "scheduled"
        entries.append({
            "record_id": record_id,
            "pg_id": group["uid"],
            "process_group": (group["name"], group["desc"]),
            "collective_seq_id": cseq,
            "p2p_seq_id": p2p_seq,
            "op_id": op_id,
            "profiling_name": _text(name),
            "time_created_ns": created,
            "duration_ms": (completed - started) / 1e6 if completed and started else None,
            "input_sizes": in_sizes,
            "input_dtypes": in_dtypes,
            "output_sizes": out_sizes,
            "output_dtypes": out_dtypes,
            "state": state_name,
            "time_discovered_started_ns": started or None,
            "time_discovered_completed_ns": completed or None,
            "retired": bool(completed),
            "timeout_ms": group["timeout_ms"],
            "is_p2p": bool(is_p2p),
            "thread_id": str(thread_id),
            "thread_name": "",
            "frames": [],
        })  # fmt: skip
    entries.sort(key=lambda e: e["record_id"])
    status: dict[str, dict[str, int]] = {}
    for g in groups.values():
        mine = [e for e in entries if e["pg_id"] == g["uid"] and not e["is_p2p"]]
        status[str(g["uid"])] = {
            "last_enqueued_collective": max((e["collective_seq_id"] for e in mine), default=0),
            "last_started_collective": max(
                (e["collective_seq_id"] for e in mine if e["state"] != "scheduled"), default=0
            ),
            "last_completed_collective": max(
                (e["collective_seq_id"] for e in mine if e["state"] == "completed"), default=0
            ),
        }
    return {
        "version": SCHEMA_VERSION,
        "comm_lib_version": f"torch {_text(torch_version)}",
        "pg_config": {
            g["name"]: {"name": g["name"], "desc": g["desc"], "ranks": g["ranks"]}
            for g in groups.values()
        },
        "pg_status": status,
        "entries": entries,
        "tether": {
            "format": TETHER_FORMAT,
            "reason": "crash",
            "global_rank": rank,
            "world_size": world_size,
            "host": _text(host),
            "pid": pid,
            "job_id": _text(job_id),
            "torch_version": _text(torch_version),
            "clock_offset_ns": clock_offset,
            "ring_size": capacity,
            "hang_timeout_s": hang_timeout,
            "stacks": [],
            "failed": {},
            "recovered": {"after_death": True, "how": how},
        },
    }
