"""One rank's dump as compact columns, per process group.

A 512-rank x 2000-entry event is a million entry dicts; keeping them would take gigabytes and
comparing them one by one in Python is what makes torch's analyzer slow. Each dump is read,
reduced to a few ``array``s per group (sequence number, issue time, a small code standing for
what was issued, done or not) and dropped. The code (a *signature*) is op-aware: ranks issued the
same collective when their canonical op, element counts and dtypes agree, so two shapes of the
same buffer (``[n, *shape]`` vs ``[n * numel]``) do not count as a desync.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from array import array
from bisect import bisect_right
from itertools import compress, repeat
from operator import add, eq, gt, is_, itemgetter, or_
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.events.columns import Columns, columns_for, read_columns
from tether.events.exception import EXCEPTION, read_record
from tether.events.load import load_trace
from tether.events.schema import FORMING

__all__ = [
    "AlarmInfo",
    "GroupCols",
    "NodeState",
    "P2POp",
    "RankTrace",
    "SigInfo",
    "canonical_op",
    "read_rank",
]

# Names the same collective goes by, in torch's recorders and ours.
_ALIASES = {
    "allreduce": "all_reduce",
    "_all_gather_base": "all_gather",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_to_allv": "all_to_all",
    "alltoallv": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}
_P2P_OPS = frozenset({"send", "recv", "recv_any_source", "recvanysource"})
_ARROW = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")

_FIELDS = (
    "process_group",
    "collective_seq_id",
    "profiling_name",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "state",
    "retired",
    "time_created_ns",
    "is_p2p",
    "pg_id",
)
_GET = itemgetter(*_FIELDS)
_GETTERS = tuple(itemgetter(k) for k in _FIELDS)
_MAX_FAST_NAMES = 256
"""Distinct profiling names (or size variants of one name) the column-wise reduction handles;
past that (a hostile or very unusual dump) the entry-by-entry loop takes over."""
_DEFAULTS: dict[str, Any] = {
    "process_group": ("", ""),
    "collective_seq_id": None,
    "profiling_name": "",
    "input_sizes": [],
    "output_sizes": [],
    "input_dtypes": [],
    "output_dtypes": [],
    "state": "",
    "retired": False,
    "time_created_ns": 0,
    "is_p2p": False,
    "pg_id": None,
}


def canonical_op(op: str) -> str:
    return _ALIASES.get(op, op)


@dataclasses.dataclass(kw_only=True, slots=True)
class GroupCols:
    """One rank's collectives in one group, in issue order."""

    seq: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    t: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    """time_created_ns on rank 0's clock (the dump's clock_offset_ns added)."""
    sig: array[int] = dataclasses.field(default_factory=lambda: array("i"))
    """Signature codes: this rank's own codes (index into RankTrace.sigs) until the event
    merges them into codes shared by every rank. 4 bytes, as :attr:`idx`: what workers send the
    parent is a quarter smaller (16,384 ranks' columns: 1.1 GB with 8-byte codes)."""
    done: bytearray = dataclasses.field(default_factory=bytearray)
    idx: array[int] = dataclasses.field(default_factory=lambda: array("i"))
    """Position of the entry in the rank's dump."""

    def last_seq(self) -> int:
        return self.seq[-1] if self.seq else 0


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class SigInfo:
    """What a signature code stands for: the op as recorded, and one entry's sizes/dtypes."""

    op: str
    key: tuple[Any, ...]
    """The op-aware comparison key: canonical op, element counts, dtypes."""
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    input_dtypes: list[str]
    output_dtypes: list[str]


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class P2POp:
    group: str
    kind: str
    """``send`` or ``recv``."""
    peer: int
    """The other side's global rank (-1 when the dump does not say)."""
    done: bool
    t: int
    idx: int
    sig: int


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class AlarmInfo:
    """The alarm a dump answered, as far as the analyzer weighs it."""

    reason: str
    epoch: int = 0
    time_ns: int = 0
    """When it was raised (the raiser's wall clock); 0 where unknown."""
    group: str = ""
    """A hang alarm's group (its name); "" where unknown."""
    group_desc: str = ""
    seq: int = 0
    """The hung operation's collective sequence number; 0 where unknown or a send/recv."""
    op: str = ""
    """Its profiling name."""
    seen_by: int = -1
    age_s: float = 0.0
    timeout_s: float = 0.0
    nodes: tuple[NodeState, ...] = ()
    """The nodes a node fault is about (its launcher declared them failed)."""
    detail: str = ""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class NodeState:
    """A node the alarm names: ``host`` became ``state`` (lost, unreachable, frozen); its
    launcher was last heard at ``heard_ns`` (Unix ns; 0 where unknown)."""

    host: str
    state: str
    heard_ns: int = 0


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Forming:
    """A group creation a rank waited in past its hang timeout (tether's ``forming``)."""

    op: str
    """``init_process_group`` or ``new_group``."""
    group: str
    group_desc: str
    ranks: list[int]
    missing: list[int] | None
    """The members it found missing (None where it did not look)."""
    waited_s: float

    @classmethod
    def read(cls, raw: Any) -> Forming | None:
        """The record as a dump holds it, checked (a dump is read from outside)."""
        if not isinstance(raw, dict):
            return None
        op, group, desc = raw.get("op"), raw.get("group"), raw.get("group_desc")
        ranks, missing, waited = raw.get("ranks"), raw.get("missing"), raw.get("waited_s")
        if not (isinstance(op, str) and isinstance(group, str) and isinstance(desc, str)):
            return None
        if not isinstance(ranks, list) or not _ranks(ranks):
            return None
        if missing is not None and (not isinstance(missing, list) or not _ranks(missing)):
            return None
        waited_s = 0.0
        if isinstance(waited, (int, float)) and not isinstance(waited, bool):
            waited_s = float(waited)
        return cls(
            op=op[:64],
            group=group[:256],
            group_desc=desc[:256],
            ranks=list(ranks),
            missing=None if missing is None else list(missing),
            waited_s=waited_s if math.isfinite(waited_s) else 0.0,
        )


def _ranks(values: list[Any]) -> bool:
    return all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in values)


# What watchdog/hang.describe writes in an alarm's detail: older dumps carry the op only there.
_HANG_DETAIL = re.compile(
    r"^(?P<op>\S+(?: \d+(?:->|<-)\d+)?) #(?P<seq>-?\d+) on group (?P<group>\S+) "
    r"\((?P<desc>[^)]*)\) in flight (?P<age>\d+(?:\.\d*)?)s on rank (?P<rank>\d+)"
)


def _node_states(nodes: Any, heard: Any) -> tuple[NodeState, ...]:
    if not isinstance(nodes, dict):
        return ()
    heard = heard if isinstance(heard, dict) else {}
    out = []
    for host, state in sorted(nodes.items())[:64]:
        if not isinstance(host, str) or not isinstance(state, str):
            continue
        when = heard.get(host)
        ns = int(when) if isinstance(when, str) and when.isascii() and when.isdigit() else 0
        out.append(NodeState(host=host[:100], state=state[:40], heard_ns=ns))
    return tuple(out)


def _alarm_info(alarm: dict[str, Any]) -> AlarmInfo | None:
    reason = alarm.get("reason")
    if not isinstance(reason, str):
        return None

    def num(key: str, kind: type, default: Any) -> Any:
        v = alarm.get(key)
        # inf or nan (JSON takes both) would fail int() and take the whole dump with it.
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return default
        return kind(v)

    def text(key: str) -> str:
        v = alarm.get(key)
        return v if isinstance(v, str) else ""

    info = AlarmInfo(
        reason=reason,
        epoch=num("epoch", int, 0),
        time_ns=num("time_ns", int, 0),
        group=text("group"),
        group_desc=text("group_desc"),
        seq=num("seq", int, 0),
        op=text("op"),
        seen_by=num("seen_by", int, -1),
        age_s=num("age_s", float, 0.0),
        timeout_s=_timeout(alarm.get("timeout_s")) or 0.0,
        nodes=_node_states(alarm.get("nodes"), alarm.get("heard")),
        detail=text("detail")[:500],
    )
    m = _HANG_DETAIL.match(text("detail")) if reason == "hang" and not info.group else None
    if m is not None:  # an older raiser: the same facts, from its detail line
        info = dataclasses.replace(
            info,
            group=m["group"],
            group_desc=m["desc"],
            seq=int(m["seq"]) if " " not in m["op"] else 0,
            op=m["op"],
            seen_by=int(m["rank"]),
            age_s=float(m["age"]),
        )
    return info


@dataclasses.dataclass(kw_only=True, slots=True)
class RankTrace:
    """What the analyzer keeps of one rank's dump."""

    rank: int
    path: str
    version: str = ""
    flavor: str = "torch"
    """``tether``, ``torch``, ``gloo`` (torch's own gloo recorder) or ``torchcomms``."""
    n_entries: int = 0
    first_record_id: int | None = None
    world_size: int | None = None
    clock_offset_ns: int = 0
    clock_error_ns: int = 0
    """How far off ``clock_offset_ns`` may be (half the shortest store round trip)."""
    reason: str | None = None
    event: str | None = None
    dump_time_ns: int | None = None
    dead_ranks: dict[int, str] = dataclasses.field(default_factory=dict)
    failed: list[str] = dataclasses.field(default_factory=list)
    """Errors of operations the backend failed (tether's ``failed``), oldest first."""
    alarm_detail: str | None = None
    alarm: AlarmInfo | None = None
    hang_timeout_s: float | None = None
    """The watchdog's hang timeout on this rank (where its dump says it)."""
    recovered: str | None = None
    """How the record was recovered after the rank's death (``tether.recovered.how``); None for
    a dump the rank wrote itself."""
    left: bool = False
    """The rank returned while still a member of the job's groups (tether's ``left``: its record
    was kept and recovered after it exited cleanly)."""
    dropped: int = 0
    """Completed entries the rank's ring dropped for newer ones (tether's ``dropped``)."""
    exception: dict[str, Any] | None = None
    """The exception the rank died of (:mod:`tether.events.exception`), where it died of one."""
    forming: Forming | None = None
    """The group creation this rank waited in past its hang timeout (tether's ``forming``)."""
    pg_config: dict[str, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)
    group_desc: dict[str, str] = dataclasses.field(default_factory=dict)
    last_enqueued: dict[str, int] = dataclasses.field(default_factory=dict)
    """Group -> its last enqueued collective per pg_status (covers entries the ring dropped)."""
    pg_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    """pg_id -> group, as this rank's entries name them."""
    unnamed_enqueued: dict[str, int] = dataclasses.field(default_factory=dict)
    """pg_status's last enqueued collective of the pg_ids none of this rank's entries name (a
    group its ring dropped entirely): the event names them from the other ranks' entries."""
    groups: dict[str, GroupCols] = dataclasses.field(default_factory=dict)
    p2p: list[P2POp] = dataclasses.field(default_factory=list)
    sigs: list[SigInfo] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    has_stacks: bool = False
    host: str | None = None
    """The host the rank ran on (tether's dumps say it)."""


def read_rank(rank: int, path: Path, *, keep: list[Any] | None = None) -> RankTrace:
    """Read rank ``rank``'s dump at ``path`` into columns: from its column file where one was
    written beside it (:mod:`tether.events.columns`), else by loading it safely. Raises
    UnsafeDumpError for a file that is not a readable dump. ``keep``: where to leave the parsed
    dump instead of freeing it (a worker process that frees everything at once, by exiting)."""
    why = ""
    if (cols := columns_for(path, rank)) is not None:
        try:
            return _reduce_columns(rank, path, read_columns(cols, path))
        except FileNotFoundError:
            pass
        except UnsafeDumpError as exc:  # the dump is the record: read it instead
            why = f"{exc}: read its dump instead"
    data = load_trace(path)
    if keep is not None:
        keep.append(data)
    tr = _reduce(rank, path, data)
    if why:
        tr.notes.append(why)
    return tr


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a float infinity
        return default


MAX_TIMEOUT_S = 1e9
"""A hang timeout beyond this (about 30 years) is not believed: it is corrupt, and in
nanoseconds it would overflow what the analyzer computes from it."""


def _timeout(v: Any) -> float | None:
    """A hang timeout in seconds, or None where ``v`` is not a believable one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_TIMEOUT_S:
        return None
    return float(v)


def _reduce(rank: int, path: Path, data: dict[str, Any], *, columnwise: bool = True) -> RankTrace:
    """``columnwise=False`` forces the entry-by-entry loop (the tests hold the two equal)."""
    tr, meta, pg_status = _head(rank, path, data)
    entries = data.get("entries")
    if not isinstance(entries, list):
        entries = []
    elif entries and set(map(type, entries)) != {dict}:
        entries = [e for e in entries if isinstance(e, dict)]
    cutoff = _regrouped_after_alarm(meta, tr.alarm)
    if cutoff is not None:
        entries = [e for e in entries if not _created_from(e, cutoff)]
    tr.n_entries = len(entries)
    if entries:
        tr.first_record_id = _int(entries[0].get("record_id"), 0)
    # Column by column: one C-level pass per field, never a Python loop over the entries. The
    # frames (most of a dump's bytes) are never looked at here; pg_id only serves pg_status.
    getters = _GETTERS if pg_status else _GETTERS[:-1]
    try:
        cols = [list(map(get, entries)) for get in getters]
    except KeyError:  # an older or foreign schema: fill what is missing
        rows = [tuple(e.get(k, _DEFAULTS[k]) for k in _FIELDS) for e in entries]
        cols = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in _FIELDS]
        tr.notes.append(
            f"rank {rank}: some entries lack fields of schema 2.10 (version {tr.version})"
        )
    if len(cols) < len(_FIELDS):
        cols.append([None] * len(entries))
    _detect_flavor(tr, data, entries, cols)
    if not columnwise or tr.flavor == "torchcomms" or not _columns_fast(tr, cols, pg_status):
        tr.groups, tr.p2p, tr.sigs, tr.group_desc, tr.last_enqueued = {}, [], [], {}, {}
        tr.pg_ids, tr.unnamed_enqueued = {}, {}
        _columns(tr, list(zip(*cols, strict=True)), pg_status)
    return tr


def _head(rank: int, path: Path, head: dict[str, Any]) -> tuple[RankTrace, Any, dict[str, Any]]:
    """What a dump says besides its entries (``head``: the dump, or its column file's header):
    the trace started with it, the ``tether`` section, and ``pg_status``."""
    tr = RankTrace(rank=rank, path=str(path), version=str(head.get("version", "")))
    meta = head.get("tether")
    if isinstance(meta, dict):
        _read_meta(tr, meta)
    _read_pg_config(tr, head.get("pg_config"))
    status = head.get("pg_status")
    return tr, meta, status if isinstance(status, dict) else {}


def _reduce_columns(rank: int, path: Path, c: Columns) -> RankTrace:
    """:func:`_reduce` of a dump's column file: the same ``RankTrace`` as its pickle gives.

    The file keeps each group's entries together (:mod:`tether.events.columns`): a dump of
    collectives alone, nothing left out, takes each group's columns as slices of its rows
    (:func:`_group_slices`; at 16,384 ranks, picking them out of the dump's order was half of
    reading a column file). Any other is put back in the dump's order and read with whole-row
    masks (:func:`_reduce_in_order`)."""
    tr, meta, pg_status = _head(rank, path, c.header)
    if not isinstance(meta, dict):
        raise UnsafeDumpError(f"{path}: its column file has no tether section")
    cutoff = _regrouped_after_alarm(meta, tr.alarm)
    if cutoff is None:
        for pname, *shape in c.kinds:  # numbered by the writer in the dump's order
            if not _add_sig(tr, pname, tuple(shape)):
                raise UnsafeDumpError(f"{path}: sizes or dtypes of {pname!r} are not lists")
        p2p = c.cols["is_p2p"].count(1) or any(canonical_op(s.op) in _P2P_OPS for s in tr.sigs)
        if not p2p and _group_slices(tr, c, pg_status):
            return tr
    return _reduce_in_order(tr, path, c, _in_dump_order(path, c), cutoff, pg_status)


def _done_row(c: Columns, cols: dict[str, Any], m: int) -> bytes:
    """1 for each entry done: completed, or retired unless still started (a failed op is
    retired too)."""
    states = cols["state"]
    completed = states.translate(_table(i for i, s in enumerate(c.states) if s == "completed"))
    not_started = states.translate(_table(i for i, s in enumerate(c.states) if s != "started"))
    return _bits(_as_int(completed) | (_as_int(not_started) & _as_int(cols["retired"])), m)


def _group_slices(tr: RankTrace, c: Columns, pg_status: dict[str, Any]) -> bool:
    """Each group's columns as slices of the rows; False (``tr`` untouched) where the file's
    groups are not one per name or its first entry is not the dump's."""
    cols, m = c.cols, c.n
    names = [name for name, _ in c.groups]
    if len(set(names)) < len(names) or (m and cols["idx"][0] != 0):
        return False
    tr.n_entries = m
    if m:
        tr.first_record_id = cols["record_id"][0]
    done = _done_row(c, cols, m)
    offset = tr.clock_offset_ns
    seq, t, sig, idx, pg_ids = (
        cols[k] for k in ("collective_seq_id", "time_created_ns", "kind", "idx", "pg_id")
    )
    firsts: list[tuple[int, int, str]] = []  # (place in the dump, pg_id, group)
    for g, a, b in c.spans:
        name = names[g]
        tr.group_desc.setdefault(*c.groups[g])
        ts = t[a:b]
        tr.groups[name] = GroupCols(
            seq=seq[a:b],
            t=array("q", map(add, ts, repeat(offset))) if offset else ts,
            sig=sig[a:b],
            done=bytearray(done[a:b]),
            idx=idx[a:b],
        )
        if pg_status:  # the group behind each pg_id (only pg_status needs it): its first entry
            ids = pg_ids[a:b]
            if ids.count(ids[0]) == len(ids):
                firsts.append((idx[a], ids[0], name))
            else:
                firsts.extend((idx[a + ids.index(i)], i, name) for i in dict.fromkeys(ids))
    pgid_name: dict[Any, str] = {}
    for _, pg_id, name in sorted(firsts, key=itemgetter(0)):
        pgid_name.setdefault(pg_id, name)
    _apply_pg_status(tr, pg_status, pgid_name, False)
    return True


def _in_dump_order(path: Path, c: Columns) -> dict[str, Any]:
    """The file's rows in the dump's order (its ``idx`` row)."""
    idx = c.cols["idx"]
    order = sorted(range(c.n), key=idx.__getitem__)
    if not all(map(eq, map(idx.__getitem__, order), range(c.n))):
        raise UnsafeDumpError(f"{path}: its idx row does not number the entries once each")
    return {k: _like(v, map(v.__getitem__, order)) for k, v in c.cols.items()}


def _reduce_in_order(
    tr: RankTrace,
    path: Path,
    c: Columns,
    cols: dict[str, Any],
    cutoff: int | None,
    pg_status: dict[str, Any],
) -> RankTrace:
    """The column file's rows, in the dump's order, reduced with whole-row masks: ``compress``
    by a byte mask, and masks combined as integers (``int.from_bytes`` of 0/1 bytes: one
    bitwise operation for the row), 4x as fast as looking entries up one by one. ``tr`` holds
    the signatures already unless entries are left out (``cutoff``)."""
    if cutoff is not None:  # entries from the regroup on left out, as from the pickle
        keep = bytes(map(gt, repeat(cutoff), cols["time_created_ns"]))
        cols = {k: _like(v, compress(v, keep)) for k, v in cols.items()}
    m = len(cols["record_id"])
    tr.n_entries = m
    if m:
        tr.first_record_id = cols["record_id"][0]
    kinds = cols["kind"]
    codes: Any = kinds
    order: list[int] | range = range(len(c.kinds))
    if cutoff is not None:
        # Signatures numbered in order of first appearance, as the pickle's reduction numbers
        # them: among the entries kept.
        order = list(dict.fromkeys(kinds))
        code_of = {k: code for code, k in enumerate(order)}
        codes = array("i", map(code_of.__getitem__, kinds))
        for k in order:
            pname, *shape = c.kinds[k]
            if not _add_sig(tr, pname, tuple(shape)):
                raise UnsafeDumpError(f"{path}: sizes or dtypes of {pname!r} are not lists")
    groupc = cols["group"]
    donec = _done_row(c, cols, m)
    p2p_kinds = [code for code, sig in enumerate(tr.sigs) if canonical_op(sig.op) in _P2P_OPS]
    p2p_int = _as_int(cols["is_p2p"])
    if p2p_kinds:
        p2p_int |= _as_int(bytes(map(set(p2p_kinds).__contains__, codes)))
    names = [name for name, _ in c.groups]
    for g in dict.fromkeys(groupc):
        tr.group_desc.setdefault(*c.groups[g])
    pgid_name: dict[Any, str] = {}
    if pg_status:  # the group behind each pg_id: only pg_status needs it
        for pg_id, g in dict.fromkeys(zip(cols["pg_id"], groupc, strict=True)):
            pgid_name.setdefault(pg_id, names[g])
    # Lists: compress() yields from a list twice as fast as from an array, and an array is
    # built from a list twice as fast as from an iterator.
    offset = tr.clock_offset_ns
    tc, seqc = cols["time_created_ns"].tolist(), cols["collective_seq_id"].tolist()
    codes = codes.tolist()
    collective = None
    if p2p_int:
        p2pm = _bits(p2p_int, m)
        for i in compress(range(m), p2pm):
            name, code = names[groupc[i]], codes[i]
            tr.p2p.append(
                P2POp(
                    group=name,
                    kind=canonical_op(tr.sigs[code].op),
                    peer=_peer(tr, name, c.kinds[order[code]][0]),
                    done=bool(donec[i]),
                    t=tc[i] + offset,
                    idx=i,
                    sig=code,
                )
            )
        collective = _bits(p2p_int ^ _as_int(b"\x01" * m), m)  # 0/1 bytes: 1 - p2p
    # Collectives, group by group in order of first appearance.
    in_order = dict.fromkeys(groupc if collective is None else compress(groupc, collective))
    by_name: dict[str, list[int]] = {}
    for g in in_order:
        by_name.setdefault(names[g], []).append(g)
    for name, gs in by_name.items():
        if collective is None and len(in_order) == 1:
            mask = None  # every entry
        else:
            mask_int = _as_int(groupc.translate(_table(gs)))
            if collective is not None:
                mask_int &= ~p2p_int
            mask = _bits(mask_int, m)
        ts = _pick(tc, mask)
        tr.groups[name] = GroupCols(
            seq=array("q", _pick(seqc, mask)),
            t=array("q", list(map(add, ts, repeat(offset))) if offset else ts),
            sig=array("i", _pick(codes, mask)),
            done=bytearray(donec if mask is None else compress(donec, mask)),
            idx=array("i", range(m) if mask is None else _pick(range(m), mask)),
        )
    _apply_pg_status(tr, pg_status, pgid_name, False)
    return tr


def _like(row: Any, values: Any) -> Any:
    """``values`` as a row of ``row``'s type: bytes, or an array of its typecode."""
    return bytes(values) if type(row) is bytes else array(row.typecode, values)


def _pick(col: Any, mask: bytes | None) -> Any:
    """The values of ``col`` where ``mask`` is 1 (all where it is None), as a list."""
    return col if mask is None else list(compress(col, mask))


def _table(ones: Any) -> bytes:
    """A ``bytes.translate`` table mapping the byte values in ``ones`` to 1, others to 0."""
    t = bytearray(256)
    for i in ones:
        t[i] = 1
    return bytes(t)


def _as_int(mask: bytes) -> int:
    """0/1 bytes as one integer, bit 8k set for byte k: masks then combine in one operation."""
    return int.from_bytes(mask, "little")


def _bits(value: int, n: int) -> bytes:
    """The inverse of :func:`_as_int`: n bytes of 0 or 1."""
    return value.to_bytes(n, "little")


def _regrouped_after_alarm(meta: Any, alarm: AlarmInfo | None) -> int | None:
    """When this rank's first reconfigure after the alarm took effect (an elastic job's survivors
    regroup once the launcher has raised the crash alarm): the entries created from then on ran
    on a communicator formed after the incident, and are not part of it. None: no such
    reconfigure."""
    if not isinstance(meta, dict) or alarm is None or not alarm.time_ns:
        return None
    lists = meta.get("reconfigures")
    if not isinstance(lists, dict):
        return None
    times = [
        r.get("time_ns")
        for made in lists.values()
        if isinstance(made, list)
        for r in made
        if isinstance(r, dict)
    ]
    later = [t for t in times if isinstance(t, int) and t > alarm.time_ns]
    return min(later) if later else None


def _created_from(entry: dict[str, Any], cutoff: int) -> bool:
    created = entry.get("time_created_ns")
    return isinstance(created, int) and created >= cutoff


def _read_meta(tr: RankTrace, meta: dict[str, Any]) -> None:
    tr.flavor = "tether"
    ws = meta.get("world_size")
    tr.world_size = ws if isinstance(ws, int) and ws > 0 else None
    tr.clock_offset_ns = _int(meta.get("clock_offset_ns"), 0)
    tr.clock_error_ns = max(_int(meta.get("clock_error_ns"), 0), 0)
    tr.reason = meta.get("reason") if isinstance(meta.get("reason"), str) else None
    tr.event = meta.get("event") if isinstance(meta.get("event"), str) else None
    dt = meta.get("dump_time_ns")
    tr.dump_time_ns = dt if isinstance(dt, int) else None
    tr.has_stacks = bool(meta.get("stacks"))
    host = meta.get("host")
    tr.host = host[:100] if isinstance(host, str) and host else None
    failed = meta.get("failed")
    if isinstance(failed, dict):
        ids = sorted(
            (int(k), v) for k, v in failed.items() if str(k).isascii() and str(k).isdigit()
        )
        tr.failed = [str(v)[:300] for _, v in ids]
    tr.hang_timeout_s = _timeout(meta.get("hang_timeout_s"))
    rec = meta.get("recovered")
    if isinstance(rec, dict) and rec.get("after_death"):
        how = rec.get("how")
        tr.recovered = how if isinstance(how, str) and how else "recovered"
    tr.exception = read_record(meta.get(EXCEPTION))
    tr.forming = Forming.read(meta.get(FORMING))
    tr.dropped = max(_int(meta.get("dropped"), 0), 0)
    tr.left = meta.get("left") is True and tr.recovered is not None
    alarm = meta.get("alarm")
    if isinstance(alarm, dict):
        tr.alarm = _alarm_info(alarm)
        dead = alarm.get("dead_ranks")
        if isinstance(dead, dict):
            for r, how in dead.items():
                key = str(r)
                if key.isascii() and key.isdigit():  # a global rank: "²" or "-1" are not
                    tr.dead_ranks[int(key)] = str(how)[:300]
        if isinstance(alarm.get("detail"), str) and alarm["detail"]:
            tr.alarm_detail = alarm["detail"]
    elif isinstance(meta.get("detail"), str) and meta["detail"]:
        tr.alarm_detail = meta["detail"]
        if tr.reason == "hang":  # dumped alone (no store): the detail still names the operation
            tr.alarm = _alarm_info({"reason": "hang", "detail": meta["detail"]})


_RANKS_CACHE: dict[str | range, list[int]] = {}


def parse_ranks(text: Any) -> list[int]:
    """``"[0, 2]"`` (torch), ``"[0,2]"`` (torchcomms), a list, or a ``range`` (a column
    file's evenly spaced members) -> ``[0, 2]``; [] if unreadable."""
    if isinstance(text, list):
        return [r for r in text if isinstance(r, int)]
    if not isinstance(text, (str, range)):
        return []
    got = _RANKS_CACHE.get(text)
    if got is None:
        if isinstance(text, range):
            got = list(text)
        else:
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = []
            ok = isinstance(parsed, list)
            got = [r for r in parsed if isinstance(r, int)] if ok else []
        if len(_RANKS_CACHE) < 4096:
            _RANKS_CACHE[text] = got
    return got


def _read_pg_config(tr: RankTrace, pg_config: Any) -> None:
    if not isinstance(pg_config, dict):
        return
    for key, cfg in pg_config.items():
        if not isinstance(cfg, dict):
            continue
        name = cfg.get("name", key)
        name = name if isinstance(name, str) and name else str(key)
        desc = str(cfg.get("desc") or "")
        ranks = parse_ranks(cfg.get("ranks"))
        if name and ranks:  # torch 2.13's gloo writes '' -> {'ranks': '[]'}: says nothing
            tr.pg_config[name] = (desc, ranks)


def _detect_flavor(
    tr: RankTrace, data: dict[str, Any], entries: list[dict[str, Any]], cols: list[list[Any]]
) -> None:
    if tr.flavor == "tether":
        return
    cfg = data.get("pg_config")
    if isinstance(cfg, dict) and "" in cfg and not tr.pg_config:
        tr.flavor = "gloo"
        tr.notes.append(
            f"rank {tr.rank}: torch's own gloo recorder (empty pg_config, states not kept, "
            "no send/recv): completion read from 'retired' and pg_status"
        )
        return
    # torchcomms numbers collectives across all of a process's communicators (one counter),
    # and records p2p as plain entries: consecutive ids over the whole dump betray it.
    seqs = cols[1]
    if (
        len(seqs) >= 2
        and type(seqs[0]) is int
        and type(seqs[-1]) is int
        and seqs[-1] - seqs[0] == len(seqs) - 1
        and not any(e.get("p2p_seq_id") for e in entries[:64])
        and set(map(type, seqs)) == {int}
        and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    ):
        names = {pg[0] for pg in cols[0] if isinstance(pg, (list, tuple)) and pg}
        ops = {_op_of(p) for p in cols[2]}
        if len(names) > 1 or ops & _P2P_OPS or "frames" not in entries[0]:
            tr.flavor = "torchcomms"


def _op_of(profiling_name: Any) -> str:
    if not isinstance(profiling_name, str):
        return "?"
    return profiling_name.split(":", 1)[-1].split(" ", 1)[0] or "?"


def _numel(sizes: Any) -> int:
    total = 0
    for s in sizes if isinstance(sizes, list) else ():
        if isinstance(s, list):
            total += math.prod(d for d in s if isinstance(d, int))
    return total


def _key(op: str, isz: Any, osz: Any, idt: Any, odt: Any) -> tuple[Any, ...]:
    canon = canonical_op(op)
    i_dt, o_dt = tuple(map(str, idt or ())), tuple(map(str, odt or ()))
    if canon.startswith("all_to_all"):
        return (canon, i_dt[:1], o_dt[:1])  # split sizes legitimately differ between ranks
    if canon == "gather":
        return (canon, _numel(isz), i_dt)
    if canon == "scatter":
        return (canon, _numel(osz), o_dt)
    if canon == "barrier":
        return (canon,)
    return (canon, _numel(isz), _numel(osz), i_dt, o_dt)


def _columns(tr: RankTrace, rows: list[Any], pg_status: dict[str, Any]) -> None:
    # The hot loop of the analyzer: one pass per entry, no function call on the common path.
    # Consecutive entries of the same op almost always carry the same sizes, so the signature
    # is looked up by comparing lists (C speed) with the last one seen for that op name.
    table: dict[str, int] = {}
    last: dict[Any, tuple[Any, Any, Any, Any, int, str, bool]] = {}
    sigs = tr.sigs
    groups = tr.groups
    pgid_name: dict[Any, str] = {}
    torchcomms = tr.flavor == "torchcomms"
    ordinal: dict[str, int] = {}
    offset = tr.clock_offset_ns
    gname: Any = None
    name = "?"
    g: GroupCols | None = None
    for i, (pg, seq, pname, isz, osz, idt, odt, state, retired, t, is_p2p, pg_id) in enumerate(
        rows
    ):
        if type(pname) is not str:  # hostile or foreign: compare by its text
            pname = str(pname)
        prev = last.get(pname)
        if (
            prev is not None
            and prev[0] == isz
            and prev[1] == osz
            and prev[2] == idt
            and (prev[3] == odt)
        ):
            code, op, p2p = prev[4], prev[5], prev[6]
        else:
            op = _op_of(pname)
            p2p = canonical_op(op) in _P2P_OPS
            sk = f"{pname}|{isz}|{osz}|{idt}|{odt}"
            code_ = table.get(sk)
            if code_ is None:
                code_ = table[sk] = len(sigs)
                sigs.append(
                    SigInfo(
                        op=op,
                        key=_key(op, isz, osz, idt, odt),
                        input_sizes=isz if isinstance(isz, list) else [],
                        output_sizes=osz if isinstance(osz, list) else [],
                        input_dtypes=idt if isinstance(idt, list) else [],
                        output_dtypes=odt if isinstance(odt, list) else [],
                    )
                )
            code = code_
            last[pname] = (isz, osz, idt, odt, code, op, p2p)
        if pg is not gname:
            gname = pg
            if isinstance(pg, (list, tuple)) and pg:
                name = str(pg[0])
                if name not in tr.group_desc:
                    tr.group_desc[name] = str(pg[1]) if len(pg) > 1 else ""
            else:
                name = "?"
            g = groups.get(name)
        if type(pg_id) is int and pg_id not in pgid_name:
            pgid_name[pg_id] = name
        # Retired counts as done (torch 2.13's gloo recorder never updates states) unless the
        # op is still "started": a failed op (tether's ``failed``, NCCL's errors) is retired too.
        done = state == "completed" or (retired is True and state != "started")
        if is_p2p is True or p2p:
            tr.p2p.append(
                P2POp(
                    group=name,
                    kind=canonical_op(op),
                    peer=_peer(tr, name, pname),
                    done=done,
                    t=(t if isinstance(t, int) else 0) + offset,
                    idx=i,
                    sig=code,
                )
            )
            continue
        if torchcomms:
            seq = ordinal[name] = ordinal.get(name, 0) + 1
        elif type(seq) is not int:
            continue
        if g is None:
            g = groups[name] = GroupCols()
        g.seq.append(seq)
        g.t.append((t if type(t) is int else 0) + offset)
        g.sig.append(code)
        g.done.append(done)
        g.idx.append(i)
    _apply_pg_status(tr, pg_status, pgid_name, torchcomms)


def _columns_fast(tr: RankTrace, cols: list[list[Any]], pg_status: dict[str, Any]) -> bool:
    """:func:`_columns`, column-wise, for what every recorder writes: string profiling names,
    process groups as tuples or lists of strings, sizes and dtypes as lists. Anything else
    makes it return False, having kept nothing, and the entry-by-entry loop takes over. Sizes
    and dtypes are compared with ``==``, as the loop's cache compares them."""
    pgc, seqc, pnc, iszc, oszc, idtc, odtc, statec, retc, tc, isp2pc, pgidc = cols
    n = len(pnc)
    pgid_name: dict[Any, str] = {}
    if n == 0:
        _apply_pg_status(tr, pg_status, pgid_name, False)
        return True
    # Types are checked on the distinct values only: a value equal to a string is a string,
    # one equal to a tuple (list) a tuple (list); 1 == True == 1.0 is why numbers are not.
    try:
        pnames = dict.fromkeys(pnc)
        if not set(map(type, pnames)) <= {str}:
            return False
        pgk: list[Any] = pgc
        try:
            pgs = dict.fromkeys(pgk)
        except TypeError:  # lists (JSON dumps): as tuples
            pgk = list(map(tuple, pgc))
            pgs = dict.fromkeys(pgk)
        # Group names, their descs in order of first appearance (as the loop records them).
        names: dict[Any, str] = {}
        for pg in pgs:
            if type(pg) is not tuple or not set(map(type, pg)) <= {str}:
                return False
            if pg:
                name = names[pg] = pg[0]
                if name not in tr.group_desc:
                    tr.group_desc[name] = pg[1] if len(pg) > 1 else ""
            else:
                names[pg] = "?"
        namec = [names[pgk[0]]] * n if len(names) == 1 else list(map(names.__getitem__, pgk))
        if pg_status:  # the group behind each pg_id: only pg_status needs it
            if not set(map(type, pgidc)) <= {int, type(None)}:
                return False
            for pg_id, name in dict.fromkeys(zip(pgidc, namec, strict=True)):
                if type(pg_id) is int and pg_id not in pgid_name:
                    pgid_name[pg_id] = name
        codes = _signatures(tr, pnc, pnames, (iszc, oszc, idtc, odtc))
        if codes is None:
            return False
        donec = list(
            map(
                or_,
                map(eq, statec, repeat("completed")),
                map(gt, map(is_, retc, repeat(True)), map(eq, statec, repeat("started"))),
            )
        )
        p2p_code = [canonical_op(s.op) in _P2P_OPS for s in tr.sigs]
        flagged = any(map(is_, isp2pc, repeat(True)))
        p2pm: list[bool] | None = None
        offset = tr.clock_offset_ns
        if flagged or any(p2p_code):
            p2pm = list(map(or_, map(is_, isp2pc, repeat(True)), map(p2p_code.__getitem__, codes)))
            for i in compress(range(n), p2pm):
                name, t, code = namec[i], tc[i], codes[i]
                tr.p2p.append(
                    P2POp(
                        group=name,
                        kind=canonical_op(tr.sigs[code].op),
                        peer=_peer(tr, name, pnc[i]),
                        done=donec[i],
                        t=(t if isinstance(t, int) else 0) + offset,
                        idx=i,
                        sig=code,
                    )
                )
        # Collectives: not p2p, with an integer sequence number.
        keep: list[int] | range = range(n)
        if p2pm is not None or set(map(type, seqc)) != {int}:
            keepm = list(map(is_, map(type, seqc), repeat(int)))
            if p2pm is not None:
                keepm = list(map(gt, keepm, p2pm))
            if not all(keepm):
                keep = list(compress(range(n), keepm))
        tvals = tc if set(map(type, tc)) == {int} else [t if type(t) is int else 0 for t in tc]
        kept_names = namec if len(keep) == n else list(map(namec.__getitem__, keep))
        order = dict.fromkeys(kept_names)
        for name in order:
            gi = (
                keep if len(order) == 1 else list(compress(keep, map(eq, kept_names, repeat(name))))
            )
            whole = len(gi) == n
            ts = tvals if whole else list(map(tvals.__getitem__, gi))
            tr.groups[name] = GroupCols(
                seq=array("q", seqc if whole else map(seqc.__getitem__, gi)),
                t=array("q", map(add, ts, repeat(offset)) if offset else ts),
                sig=array("i", codes if whole else map(codes.__getitem__, gi)),
                done=bytearray(donec if whole else map(donec.__getitem__, gi)),
                idx=array("i", gi),
            )
    except (TypeError, OverflowError):  # an unhashable group; a number past 64 bits
        return False
    _apply_pg_status(tr, pg_status, pgid_name, False)
    return True


def _signatures(
    tr: RankTrace, pnc: list[str], pnames: dict[str, None], shape_cols: tuple[list[Any], ...]
) -> list[int] | None:
    """Every entry's signature code (an index into ``tr.sigs``, numbered in order of first
    appearance, as the loop numbers them), comparing whole columns at C speed. None past
    ``_MAX_FAST_NAMES`` distinct ones, or for sizes and dtypes that are not lists."""
    if len(pnames) > _MAX_FAST_NAMES:
        return None
    n = len(pnc)
    first = {p: pnc.index(p) for p in pnames}  # C-level scans, each stops at the first
    # The usual case: each name always with the same sizes and dtypes. Check it by building
    # each column as it would then be, and comparing.
    single = len(pnames) == 1
    pcode = [] if single else list(map({p: c for c, p in enumerate(pnames)}.__getitem__, pnc))
    reps = [[col[first[p]] for p in pnames] for col in shape_cols]
    for col, rep in zip(shape_cols, reps, strict=True):
        expected = [rep[0]] * n if single else list(map(rep.__getitem__, pcode))
        if expected != col:
            break
    else:
        for c, pname in enumerate(pnames):
            if not _add_sig(tr, pname, tuple(rep[c] for rep in reps)):
                return None
        return [0] * n if single else pcode
    # Some name with several shapes: name by name, shape by shape.
    found: list[tuple[str, tuple[Any, ...], int]] = []  # (name, shape, first index)
    codes: list[int] = [0] * n
    shapes = list(zip(*shape_cols, strict=True))
    for pname in pnames:
        where: list[int] | range = (
            range(n) if single else list(compress(range(n), map(eq, pnc, repeat(pname))))
        )
        seen: list[tuple[tuple[Any, ...], int]] = []
        last: tuple[Any, ...] | None = None
        last_code = -1
        for i in where:
            shape = shapes[i]
            if last is None or shape != last:
                for known, c in seen:
                    if known == shape:
                        last_code = c
                        break
                else:
                    if len(seen) >= _MAX_FAST_NAMES:
                        return None
                    last_code = len(found)
                    found.append((pname, shape, i))
                    seen.append((shape, last_code))
                last = shape
            codes[i] = last_code
    firsts = sorted(range(len(found)), key=lambda c: found[c][2])
    renumber = [0] * len(found)
    for new, old in enumerate(firsts):
        renumber[old] = new
        if not _add_sig(tr, found[old][0], found[old][1]):
            return None
    return list(map(renumber.__getitem__, codes))


def _add_sig(tr: RankTrace, pname: str, shape: tuple[Any, ...]) -> bool:
    """Records the signature; False unless sizes and dtypes are lists, dtypes of strings
    (only then are the values ``==`` took for the same the same: ``[1] == [True]``)."""
    isz, osz, idt, odt = shape
    if not (
        type(isz) is list
        and type(osz) is list
        and type(idt) is list
        and type(odt) is list
        and set(map(type, idt)) | set(map(type, odt)) <= {str}
    ):
        return False
    op = _op_of(pname)
    tr.sigs.append(
        SigInfo(
            op=op,
            key=_key(op, isz, osz, idt, odt),
            input_sizes=isz,
            output_sizes=osz,
            input_dtypes=idt,
            output_dtypes=odt,
        )
    )
    return True


def _apply_pg_status(
    tr: RankTrace, pg_status: dict[str, Any], pgid_name: dict[Any, str], torchcomms: bool
) -> None:
    tr.pg_ids = dict(pgid_name)
    names = {str(k): v for k, v in pgid_name.items()}
    for key, st in pg_status.items():
        if not isinstance(st, dict):
            continue
        enq = _int(st.get("last_enqueued_collective"), -1)
        comp = _int(st.get("last_completed_collective"), -1)
        name = names.get(str(key))
        if name is None:
            if enq > 0:
                tr.unnamed_enqueued[str(key)] = enq
            continue
        g = tr.groups.get(name)
        if g is None:  # only p2p of it in the ring: what was enqueued still counts
            if enq > 0:
                tr.last_enqueued[name] = enq
            continue
        if torchcomms and enq > 0:
            # Our ordinals count from the window's start; pg_status says where the group
            # really is, which realigns ranks whose rings wrapped at different points.
            shift = enq - g.seq[-1]
            if shift:
                g.seq = array("q", (s + shift for s in g.seq))
        if enq > 0:
            tr.last_enqueued[name] = enq
        if comp > 0 and tr.flavor in ("gloo", "torch", "torchcomms"):
            # torch 2.13's gloo recorder never updates states; pg_status does know.
            done, seq = g.done, g.seq
            if all(map(gt, seq[1:], seq)):  # increasing, as recorded: one slice
                k = bisect_right(seq, comp)
                done[:k] = b"\x01" * k
            else:
                for k, s in enumerate(seq):
                    if s <= comp:
                        done[k] = 1


def _peer(tr: RankTrace, group: str, pname: Any) -> int:
    m = _ARROW.search(pname) if isinstance(pname, str) else None
    if m is None:
        return -1
    a, arrow, b = int(m[1]), m[2], int(m[3])
    # "me->peer" for a send, "me<-peer" for a receive, in group ranks.
    peer_g = b
    del a, arrow
    members = tr.pg_config.get(group, ("", []))[1]
    if members:
        return members[peer_g] if 0 <= peer_g < len(members) else -1
    return peer_g  # no membership known: the default group, where group rank = global rank
