"""A dump's columns: what ``tether analyze`` reads of a rank's dump, without unpickling it.

``cols_<rank>.npz`` beside ``rank_<rank>`` (docs/dump-format.md). It is numpy's own archive
format, written and read here with the standard library alone: a zip, stored uncompressed, of two
``.npy`` arrays, one row per entry field the analyzer compares and one column per entry
(``i8.npy``: :data:`I8`; ``u1.npy``: :data:`U1`), and ``header.json``: the dump without its
entries, the tables the rows index into (groups, kinds of operation, states), and the size of
the pickle it was made from. ``numpy.load`` opens it as it is.

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
import sys
import zipfile
from array import array
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.layout import rank_file, write_atomic

__all__ = [
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

FORMAT = 1
I8 = ("record_id", "pg_id", "collective_seq_id", "time_created_ns", "kind")
"""The rows of ``i8.npy`` (little-endian int64). ``kind`` indexes the header's ``kinds``:
[profiling_name, input_sizes, output_sizes, input_dtypes, output_dtypes]."""
U1 = ("group", "state", "retired", "is_p2p")
"""The rows of ``u1.npy`` (uint8). ``group`` indexes the header's ``groups`` ([name, desc]: at
most 256 in one dump), ``state`` its ``states``; ``retired`` and ``is_p2p`` are 0 or 1."""
_HEADER = "header.json"
_MAX_BYTES = 256 << 20
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '(?P<descr><i8|\|u1)', 'fortran_order': False, "
    rb"'shape': \((?P<rows>\d+), (?P<n>\d+)\), \} *\n"
)


def columns_file(event_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s column file in an event directory."""
    return event_dir / f"cols_{rank}.npz"


def columns_for(dump: Path, rank: int) -> Path | None:
    """Where the column file of rank ``rank``'s dump at ``dump`` would be; None for a dump not
    named as tether names them (torch's own prefixes: tether wrote no column file for it)."""
    if dump.name != rank_file(dump.parent, rank).name:
        return None
    return columns_file(dump.parent, rank)


@dataclasses.dataclass(frozen=True, slots=True)
class Columns:
    """One dump's columns as read back."""

    header: dict[str, Any]
    """The dump without its entries: ``version``, ``pg_config``, ``pg_status``, ``tether``."""
    groups: list[tuple[str, str]]
    kinds: list[list[Any]]
    states: list[str]
    cols: dict[str, Any]
    """Each row: an ``array("q")`` for those of :data:`I8`, ``bytes`` for those of :data:`U1`."""
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
    i8 = [array("q") for _ in I8]
    u1 = [bytearray() for _ in U1]
    put = [c.append for c in i8] + [c.append for c in u1]
    try:
        for e in entries:
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
            code = states.setdefault(state, len(states))
            values = (rid, pg_id, seq, t, kind, group, code, retired, is_p2p)
            for add, v in zip(put, values, strict=True):
                add(v)
        header = json.dumps(
            {
                "format": FORMAT,
                "pickle_size": pickle_size,
                "dump": {k: v for k, v in data.items() if k != "entries"},
                "groups": list(groups),
                "kinds": kind_rows,
                "states": list(states),
            }
        ).encode()
    except (KeyError, TypeError, ValueError, OverflowError):
        # A field missing, a number past 64 bits, over 256 groups or states, a header that is
        # not plain data.
        return None
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(_HEADER, header)
        z.writestr("i8.npy", _npy("<i8", len(entries), [_le(c) for c in i8]))
        z.writestr("u1.npy", _npy("|u1", len(entries), u1))
    return out.getvalue()


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
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            header = json.loads(z.read(_HEADER))
            i8_raw, u1_raw = z.read("i8.npy"), z.read("u1.npy")
    except (zipfile.BadZipFile, KeyError, ValueError, RecursionError, EOFError) as exc:
        raise UnsafeDumpError(f"{source}: not a column file ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise UnsafeDumpError(f"{source}: not a column file of format {FORMAT}")
    if header.get("pickle_size") != pickle_size:
        raise UnsafeDumpError(
            f"{source}: stale (made from a {header.get('pickle_size')}-byte dump, {dump_name} "
            f"has {pickle_size} bytes)"
        )
    i8_data, n = _block(source, "i8.npy", "<i8", len(I8), i8_raw)
    u1_data, n1 = _block(source, "u1.npy", "|u1", len(U1), u1_raw)
    if n1 != n:
        raise UnsafeDumpError(f"{source}: i8.npy has {n} entries, u1.npy {n1}")
    cols: dict[str, Any] = {}
    for k, name in enumerate(I8):
        col = array("q")
        col.frombytes(i8_data[8 * n * k : 8 * n * (k + 1)])
        if sys.byteorder == "big":
            col.byteswap()
        cols[name] = col
    for k, name in enumerate(U1):
        cols[name] = u1_data[n * k : n * (k + 1)]
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
    ):
        raise UnsafeDumpError(f"{source}: its header is not a column file's")
    # Every index in bounds: the reader indexes the tables with them. A byte row is checked by
    # deleting every value allowed (2 us; max() takes 20).
    kind = cols["kind"]
    if n and (min(kind) < 0 or max(kind) >= len(kinds)):
        raise UnsafeDumpError(f"{source}: its kind row points outside the header's table")
    for name, size in (("group", len(groups)), ("state", len(states))):
        if cols[name].translate(None, bytes(range(min(size, 256)))):
            raise UnsafeDumpError(f"{source}: its {name} row points outside the header's table")
    if (cols["retired"] + cols["is_p2p"]).translate(None, b"\x00\x01"):
        raise UnsafeDumpError(f"{source}: a flag that is neither 0 nor 1")
    return Columns(
        header=dump_head,
        groups=[(g[0], g[1]) for g in groups],
        kinds=kinds,
        states=states,
        cols=cols,
        n=n,
    )


def _block(source: str, name: str, descr: str, rows: int, raw: bytes) -> tuple[bytes, int]:
    """The data of a ``rows`` x n ``.npy`` array of ``descr``, and n."""
    m = _NPY_HEADER.match(raw, len(_NPY_MAGIC) + 2) if raw.startswith(_NPY_MAGIC) else None
    if m is None or m["descr"].decode() != descr or int(m["rows"]) != rows:
        raise UnsafeDumpError(f"{source}: {name} is not a {rows}-row {descr} array")
    n = int(m["n"])
    data = raw[m.end() :]
    if len(data) != rows * n * (8 if descr == "<i8" else 1):
        raise UnsafeDumpError(f"{source}: {name} holds {len(data)} bytes for {rows} x {n} values")
    return data, n
