"""A dump's columns: what ``tether analyze`` reads of a rank's dump, without unpickling it.

``cols_<rank>.npz`` beside ``rank_<rank>`` (docs/dump-format.md). It is numpy's own archive
format, written and read here with the standard library alone: a zip, stored uncompressed, of
three ``.npy`` arrays, one row per entry field the analyzer compares and one column per entry
(``i8.npy``: :data:`I8`; ``i4.npy``: :data:`I4`; ``u1.npy``: :data:`U1`), and ``header.json``:
the dump without its entries, the tables the rows index into (groups, kinds of operation,
states), and the size of the pickle it was made from. ``numpy.load`` opens it as it is.

The entries are stored group by group (the groups in order of first appearance, each group's
entries in the dump's order; ``idx`` is each entry's place in the dump), so that a group's
columns are one slice of each row: at 16,384 ranks, picking each group's entries out of the
dump's order was half of what reading a column file cost. A member list that runs evenly (the
world's ``[0, 1, ..., 16383]``: 117 KB of the header's text) is written ``{"range": [start,
stop, step]}`` and read back as a ``range``.

A 2,000-entry dump is about 370 KB of pickle, most of it stack frames, and unpickling it safely
costs about 5 ms; its columns are 90 KB and read in a twentieth of that. One array per dtype,
not one per field: each member of a zip costs the standard library's reader about 30 us, more
than reading its bytes. The pickle stays the record (torch's ``fr_trace`` and the culprit's stack
read it); a column file whose pickle has another size is stale, and the reader says so instead of
reading it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import struct
import sys
import zipfile
import zlib
from array import array
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.layout import FILE_PREFIX, rank_file, write_atomic
from tether.events.schema import MAX_WORLD

__all__ = [
    "I4",
    "I8",
    "U1",
    "Columns",
    "columns_file",
    "columns_for",
    "encode",
    "parse_columns",
    "read_columns",
    "write_columns",
]

FORMAT = 2
I8 = ("record_id", "pg_id", "collective_seq_id", "time_created_ns")
"""The rows of ``i8.npy`` (little-endian int64)."""
I4 = ("kind", "idx")
"""The rows of ``i4.npy`` (little-endian int32). ``kind`` indexes the header's ``kinds``:
[profiling_name, input_sizes, output_sizes, input_dtypes, output_dtypes]; ``idx`` is the
entry's place in the dump."""
U1 = ("group", "state", "retired", "is_p2p")
"""The rows of ``u1.npy`` (uint8). ``group`` indexes the header's ``groups`` ([name, desc]: at
most 256 in one dump), ``state`` its ``states``; ``retired`` and ``is_p2p`` are 0 or 1."""
_HEADER = "header.json"
_MAX_BYTES = 256 << 20
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '(?P<descr><i8|<i4|\|u1)', 'fortran_order': False, "
    rb"'shape': \((?P<rows>\d+), (?P<n>\d+)\), \} *\n"
)


def columns_file(event_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s column file in an event directory."""
    return event_dir / _name(rank)


def _name(rank: int) -> str:
    return f"cols_{rank}.npz"


def columns_for(dump: Path, rank: int) -> Path | None:
    """Where the column file of rank ``rank``'s dump at ``dump`` would be; None for a dump not
    named as tether names them (torch's own prefixes: tether wrote no column file for it)."""
    if dump.name != f"{FILE_PREFIX}{rank}":
        return None
    return dump.with_name(_name(rank))  # one Path built, not three


@dataclasses.dataclass(frozen=True, slots=True)
class Columns:
    """One dump's columns as read back."""

    header: dict[str, Any]
    """The dump without its entries: ``version``, ``pg_config`` (a member list that runs
    evenly as a ``range``), ``pg_status``, ``tether``."""
    groups: list[tuple[str, str]]
    kinds: list[list[Any]]
    states: list[str]
    cols: dict[str, Any]
    """Each row, in the file's order (group by group): an ``array("q")`` for those of
    :data:`I8`, an ``array("i")`` for those of :data:`I4`, ``bytes`` for those of :data:`U1`."""
    spans: list[tuple[int, int, int]]
    """(group, start, stop) of each group's entries in the rows, in the file's order."""
    n: int
    """Entries."""


def encode(data: dict[str, Any], *, pickle_size: int) -> bytes | None:
    """``data`` (a dump as its writer holds it) as a column file's bytes; None for a dump that
    is not tether's, or whose entries are not what tether writes (the pickle alone is then
    read)."""
    entries = data.get("entries")
    if not isinstance(entries, list) or not isinstance(data.get("tether"), dict):
        return None  # a foreign dump: the analyzer reads it as it is
    groups: dict[tuple[str, str], int] = {}
    kinds: dict[str, int] = {}
    kind_rows: list[list[Any]] = []
    states: dict[str, int] = {}
    by_group: list[list[tuple[Any, ...]]] = []  # each group's entries' values, in order
    try:
        for i, e in enumerate(entries):
            pg, pname, state = e["process_group"], e["profiling_name"], e["state"]
            rid, pg_id, seq, t = (
                e["record_id"],
                e["pg_id"],
                e["collective_seq_id"],
                e["time_created_ns"],
            )
            retired, is_p2p = e["retired"], e["is_p2p"]
            # Only what tether's writer and torch's recorders write: anything else is read by
            # the analyzer from the pickle, as it is.
            if not (
                type(pg) in (tuple, list)
                and len(pg) == 2
                and type(pg[0]) is type(pg[1]) is type(pname) is type(state) is str
                and type(rid) is type(pg_id) is type(seq) is type(t) is int
                and type(retired) is type(is_p2p) is bool
            ):
                return None
            # Sizes and dtypes as JSON: kinds are few (a handful per model), entries many.
            row = [
                pname,
                e["input_sizes"],
                e["output_sizes"],
                e["input_dtypes"],
                e["output_dtypes"],
            ]
            key = json.dumps(row)
            kind = kinds.get(key)
            if kind is None:
                kind = kinds[key] = len(kind_rows)
                kind_rows.append(row)
            group = groups.setdefault((pg[0], pg[1]), len(groups))
            if group == len(by_group):
                by_group.append([])
            code = states.setdefault(state, len(states))
            by_group[group].append((rid, pg_id, seq, t, kind, i, group, code, retired, is_p2p))
        rows = list(zip(*(v for part in by_group for v in part), strict=True)) or [()] * 10
        i8 = [array("q", rows[k]) for k in range(4)]
        i4 = [array("i", rows[k]) for k in range(4, 6)]
        u1 = [bytes(rows[k]) for k in range(6, 10)]
        header = json.dumps(
            {
                "format": FORMAT,
                "pickle_size": pickle_size,
                "dump": _with_runs({k: v for k, v in data.items() if k != "entries"}),
                "groups": list(groups),
                "kinds": kind_rows,
                "states": list(states),
            }
        ).encode()
    except (KeyError, TypeError, ValueError, OverflowError):
        # A field missing, a number past 64 bits (32 for a kind), over 256 groups or states, a
        # header that is not plain data.
        return None
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(_HEADER, header)
        z.writestr("i8.npy", _npy("<i8", len(entries), [_le(c) for c in i8]))
        z.writestr("i4.npy", _npy("<i4", len(entries), [_le(c) for c in i4]))
        z.writestr("u1.npy", _npy("|u1", len(entries), u1))
    return out.getvalue()


def _with_runs(head: dict[str, Any]) -> dict[str, Any]:
    """The dump's head with each ``pg_config`` member list that runs evenly (torch writes it
    as the text of a list) as ``{"range": [start, stop, step]}``."""
    cfg = head.get("pg_config")
    if not isinstance(cfg, dict):
        return head
    out = {}
    for key, group in cfg.items():
        text = group.get("ranks") if isinstance(group, dict) else None
        if isinstance(text, str) and (run := _run(text)) is not None:
            group = {**group, "ranks": {"range": run}}
        out[key] = group
    return {**head, "pg_config": out}


def _run(text: str) -> list[int] | None:
    try:
        ranks = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(ranks, list) and len(ranks) >= 2 and all(type(r) is int for r in ranks)):
        return None
    step = ranks[1] - ranks[0]
    if step < 1 or ranks != list(range(ranks[0], ranks[-1] + 1, step)):
        return None
    return [ranks[0], ranks[-1] + 1, step]


def write_columns(data: dict[str, Any], event_dir: Path, rank: int) -> Path | None:
    """Write rank ``rank``'s column file beside its dump, already written from ``data``; None
    when ``data`` has no columnar form (see :func:`encode`). Raises OSError."""
    size = rank_file(event_dir, rank).stat().st_size
    raw = encode(data, pickle_size=size)
    if raw is None:
        return None
    path = columns_file(event_dir, rank)
    write_atomic(path, raw)
    return path


def _le(col: array[int]) -> bytes:
    if sys.byteorder == "big":
        col = array(col.typecode, col)
        col.byteswap()
    return col.tobytes()


def _npy(descr: str, n: int, rows: list[Any]) -> bytes:
    head = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({len(rows)}, {n}), }}"
    # numpy pads the header with spaces to a multiple of 64 bytes, ending in a newline.
    pad = -(len(_NPY_MAGIC) + 2 + len(head) + 1) % 64
    head_b = (head + " " * pad + "\n").encode()
    return b"".join([_NPY_MAGIC, len(head_b).to_bytes(2, "little"), head_b, *rows])


def read_columns(path: Path, dump: Path) -> Columns:
    """The column file at ``path``, made from the dump at ``dump``. Raises UnsafeDumpError for
    a stale, unreadable or inconsistent one, and FileNotFoundError where there is none."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > _MAX_BYTES:  # read(n) would allocate n at once
                raise UnsafeDumpError(f"{path}: larger than {_MAX_BYTES >> 20} MB")
            raw = f.read()
        size = dump.stat().st_size
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafeDumpError(f"{path}: unreadable ({exc.strerror or exc})") from exc
    return parse_columns(raw, source=str(path), pickle_size=size, dump_name=dump.name)


def parse_columns(
    raw: bytes, *, source: str, pickle_size: int, dump_name: str = "the dump"
) -> Columns:
    """A column file's bytes, checked whole (a file from outside is not trusted), for a dump
    of ``pickle_size`` bytes. Raises UnsafeDumpError."""
    try:
        members = _members(raw)
        header = json.loads(bytes(members[_HEADER]))
        blocks = [members[name] for name, _, _ in _BLOCKS]
    except (KeyError, ValueError, RecursionError, struct.error) as exc:
        raise UnsafeDumpError(f"{source}: not a column file ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UnsafeDumpError(f"{source}: not a column file of format {FORMAT}")
    if header.get("pickle_size") != pickle_size:
        raise UnsafeDumpError(
            f"{source}: stale (made from a {header.get('pickle_size')}-byte dump, {dump_name} "
            f"has {pickle_size} bytes)"
        )
    cols: dict[str, Any] = {}
    n = -1
    for (name, descr, rows), raw_block in zip(_BLOCKS, blocks, strict=True):
        data, width = _block(source, name, descr, len(rows), raw_block)
        if n not in (-1, width):
            raise UnsafeDumpError(f"{source}: i8.npy has {n} entries, {name} {width}")
        n = width
        size = n * _WIDTH[descr]
        for k, row in enumerate(rows):
            cols[row] = _row(descr, data[size * k : size * (k + 1)])
    dump_head, groups, kinds, states = (
        header.get("dump"),
        header.get("groups"),
        header.get("kinds"),
        header.get("states"),
    )
    if not (
        isinstance(dump_head, dict)
        and isinstance(groups, list)
        and all(
            isinstance(g, list) and len(g) == 2 and all(type(s) is str for s in g) for g in groups
        )
        and isinstance(kinds, list)
        and all(isinstance(k, list) and len(k) == 5 and type(k[0]) is str for k in kinds)
        and isinstance(states, list)
        and all(type(s) is str for s in states)
        and _read_runs(dump_head)
    ):
        raise UnsafeDumpError(f"{source}: its header is not a column file's")
    # Every index in bounds: the reader indexes the tables with them. A byte row is checked by
    # deleting every value allowed (2 us; max() takes 20). ``idx`` indexes nothing here: the
    # reader that puts the rows back in the dump's order checks it numbers each entry once.
    if not _all_below(cols["kind"], len(kinds)):
        raise UnsafeDumpError(f"{source}: its kind row points outside its table")
    for name, size in (("group", len(groups)), ("state", len(states))):
        if cols[name].translate(None, bytes(range(min(size, 256)))):
            raise UnsafeDumpError(f"{source}: its {name} row points outside its table")
    if (cols["retired"] + cols["is_p2p"]).translate(None, b"\x00\x01"):
        raise UnsafeDumpError(f"{source}: a flag that is neither 0 nor 1")
    return Columns(
        header=dump_head,
        groups=[(g[0], g[1]) for g in groups],
        kinds=kinds,
        states=states,
        cols=cols,
        spans=_spans(source, cols["group"], len(groups)),
        n=n,
    )


_BLOCKS = (("i8.npy", "<i8", I8), ("i4.npy", "<i4", I4), ("u1.npy", "|u1", U1))
_WIDTH = {"<i8": 8, "<i4": 4, "|u1": 1}


def _row(descr: str, data: memoryview) -> Any:
    if descr == "|u1":
        return data.tobytes()
    col = array("q" if descr == "<i8" else "i")
    col.frombytes(data)
    if sys.byteorder == "big":
        col.byteswap()
    return col


def _spans(source: str, group: bytes, n_groups: int) -> list[tuple[int, int, int]]:
    """Where each group's entries lie; UnsafeDumpError unless each group's are together."""
    spans = []
    for g in range(n_groups):
        code = bytes((g,))
        start = group.find(code)
        if start < 0:
            continue
        stop = group.rfind(code) + 1
        if group.count(code, start, stop) != stop - start:
            raise UnsafeDumpError(f"{source}: the entries of group {g} are not stored together")
        spans.append((g, start, stop))
    spans.sort(key=lambda span: span[1])
    return spans


def _read_runs(head: dict[str, Any]) -> bool:
    """Each member list written as a run (:func:`_with_runs`) turned back into a ``range``, in
    place; False for one that is not a believable run."""
    cfg = head.get("pg_config")
    for group in cfg.values() if isinstance(cfg, dict) else ():
        ranks = group.get("ranks") if isinstance(group, dict) else None
        if not isinstance(ranks, dict):
            continue
        run = ranks.get("range")
        if not (isinstance(run, list) and len(run) == 3 and all(type(v) is int for v in run)):
            return False
        start, stop, step = run
        if start < 0 or step < 1 or not 0 < len(members := range(start, stop, step)) <= MAX_WORLD:
            return False
        group["ranks"] = members
    return True


def _members(raw: bytes) -> dict[str, memoryview]:
    """The members of a zip as :func:`encode` writes it (stored, no comment, no zip64), each
    checked against its CRC. ``zipfile``'s reader was a third of reading a column file (0.2 ms
    of 0.6); a zip written otherwise is not a column file (ValueError, struct.error)."""
    view = memoryview(raw)
    sig, _, _, _, count, _, pos, comment = _END.unpack_from(raw, len(raw) - _END.size)
    if sig != b"PK\x05\x06" or comment:
        raise ValueError("no zip directory at its end")
    out: dict[str, memoryview] = {}
    for _ in range(count):
        sig, _, _, _, method, _, _, crc, size, stored, n_name, n_extra, n_comment, _, _, _, at = (
            _CENTRAL.unpack_from(raw, pos)
        )
        if sig != b"PK\x01\x02" or method != zipfile.ZIP_STORED or size != stored:
            raise ValueError("a member that is not stored as it is")
        name = bytes(view[pos + _CENTRAL.size : pos + _CENTRAL.size + n_name]).decode()
        pos += _CENTRAL.size + n_name + n_extra + n_comment
        local = _LOCAL.unpack_from(raw, at)
        if local[0] != b"PK\x03\x04":
            raise ValueError(f"{name}: no local header where the directory says")
        start = at + _LOCAL.size + local[-2] + local[-1]
        data = view[start : start + size]
        if len(data) != size or zlib.crc32(data) != crc:
            raise ValueError(f"{name}: torn or corrupt")
        out[name] = data
    return out


_END = struct.Struct("<4s4H2IH")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_LOCAL = struct.Struct("<4s5H3I2H")


def _all_below(col: array[int], limit: int) -> bool:
    """Whether every value of the int32 row ``col`` is in [0, limit): for a table of at most
    256 rows, on its bytes (min() and max() of a 2,000-entry row took 79 us, these 8)."""
    if limit > 256:
        return not col or (min(col) >= 0 and max(col) < limit)
    data = col.tobytes()  # the machine's order: the low byte first on a little-endian one
    low = 0 if sys.byteorder == "little" else 3
    high = b"".join(data[k::4] for k in range(4) if k != low)
    return high == bytes(len(high)) and not data[low::4].translate(None, bytes(range(limit)))


def _block(
    source: str, name: str, descr: str, rows: int, raw: memoryview
) -> tuple[memoryview, int]:
    """The data of a ``rows`` x n ``.npy`` array of ``descr``, and n."""
    magic = len(_NPY_MAGIC)
    m = _NPY_HEADER.match(raw, magic + 2) if raw[:magic] == _NPY_MAGIC else None
    if m is None or m["descr"].decode() != descr or int(m["rows"]) != rows:
        raise UnsafeDumpError(f"{source}: {name} is not a {rows}-row {descr} array")
    n = int(m["n"])
    data = raw[m.end() :]
    if len(data) != rows * n * _WIDTH[descr]:
        raise UnsafeDumpError(f"{source}: {name} holds {len(data)} bytes for {rows} x {n} values")
    return data, n
