"""Every rank of one event, read into columns, with the groups' memberships worked out.

Reading is the expensive part (a safe unpickle of every file); with many files it runs in forked
worker processes, each reading a chunk of files and returning only their compact columns.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import selectors
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from tether._exceptions import UnsafeDumpError
from tether.analyze.model import AlarmInfo, GroupCols, RankTrace, SigInfo, read_rank
from tether.events.columns import columns_for
from tether.events.schema import LEFT, MAX_WORLD
from tether.events.stacks import StacksHeader, parse_header, stacks_rank

__all__ = ["Event", "GroupInfo", "load_event_columns"]

WORLD_DESCS = ("default_pg", "")


@dataclasses.dataclass(kw_only=True, slots=True)
class GroupInfo:
    name: str
    desc: str
    ranks: list[int]
    """Members' global ranks in group-rank order."""
    inferred: bool = False
    """Membership not in any dump's pg_config: taken from the ranks that recorded the group."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Event:
    name: str
    path: Path
    ranks: dict[int, RankTrace]
    unreadable: dict[str, str]
    world_size: int
    groups: dict[str, GroupInfo]
    sigs: list[SigInfo]
    """Global signature codes, shared by every rank after :func:`_merge_sigs`."""
    dead_ranks: dict[int, str]
    reason: str | None
    notes: list[str]
    alarm: AlarmInfo | None = None
    """The alarm most dumps answered (None: no dump answered one)."""
    hang_timeout_s: float | None = None
    """The watchdog's hang timeout (the dumps', else the alarm's); None where unknown."""
    recovered: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> how its record was recovered after its death."""
    exceptions: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Rank -> the exception it died of, as its dump or torchrun's error file says."""
    stacks: dict[int, StacksHeader] = dataclasses.field(default_factory=dict)
    """Rank -> the header of its ``stacks_<rank>.txt`` (an empty one for a file without a
    header: an older writer)."""
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> the host it ran on, where a dump, a stacks file or a node fault says it."""
    completed: dict[str, tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    """Group -> the last (seq, signature code) a member completed; filled as asked."""

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.ranks]

    def cols(self, rank: int, group: str) -> GroupCols | None:
        tr = self.ranks.get(rank)
        return None if tr is None else tr.groups.get(group)


@contextmanager
def _no_gc() -> Iterator[None]:
    # Unpickling builds millions of containers and none of them are cyclic garbage; the cyclic
    # collector would otherwise run hundreds of times over the growing heap.
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


Result = tuple[int, str, RankTrace | None, str]
"""(rank, path, its columns or None, why not)."""


def _read_one(rank: int, path: str, keep: list[Any] | None) -> Result:
    try:
        return (rank, path, read_rank(rank, Path(path), keep=keep), "")
    except UnsafeDumpError as exc:
        return (rank, path, None, str(exc))
    except Exception as exc:  # a hostile file must not take the others down with it
        return (rank, path, None, f"{path}: unusable ({type(exc).__name__}: {exc})")


def _read_many(items: list[tuple[int, str]]) -> list[Result]:
    with _no_gc():
        return [_read_one(rank, path, None) for rank, path in items]


CHUNK_BYTES = 4 << 20
"""Most bytes of pickle a worker process unpickles before it exits. A worker keeps every dump it
parsed (about 11 bytes of Python objects per byte of pickle, so about 50 MB) and lets its exit
free them at once, faster than freeing them object by object (a third less CPU here)."""


def _workers(n_files: int, jobs: int | None) -> int:
    """Worker processes reading at once; 0: read in this process."""
    if jobs is not None and jobs <= 0:
        return 0
    if sys.platform != "linux" or threading.active_count() > 1:
        # Workers are forked (they need nothing but what is imported); a process with other
        # threads is not forked: a lock one of them holds would never be released in the child.
        return 0
    if jobs is not None:
        return jobs
    if n_files < 32:  # a worker costs a fork and a pickle of its columns: not worth it here
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 16))


IN_PROCESS_BYTES = 4 << 20
"""Below this much to read (in pickle bytes, :func:`_cost`), forking workers costs more than it
saves. Column files of 2,000 entries, here (2 CPUs): 128 read in 0.125 s in this process, 0.14 s
with 2 workers; 256 in 0.25 s and 0.21 s; 512 in 0.50 s and 0.42 s."""
COLUMN_FILE_WEIGHT = 4
"""A column file's byte costs a quarter of a pickle's to read (0.5 ms for 90 KB against 8 ms for
370 KB of pickle, here)."""


def _cost(rank: int, dump: Path) -> tuple[int, int]:
    """What reading ``dump`` costs, in pickle bytes: its column file's size, weighted, where it
    has one (:func:`read_rank` reads that), else its own; and the bytes of pickle it unpickles
    (none where it reads the column file)."""
    cols = columns_for(dump, rank)
    size = _size(cols) if cols is not None else None
    if size is not None:
        return size // COLUMN_FILE_WEIGHT, 0
    size = _size(dump) or 0
    return size, size


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def read_files(files: dict[int, Path], jobs: int | None = None) -> list[Result]:
    """Every file read into columns, by rank: in forked workers that each read a chunk of files
    and send back only their columns, ``jobs`` at once (None: one per CPU for an event of 32
    files or more, else none; 0: none), or in this process."""
    items = [(r, str(p)) for r, p in sorted(files.items())]
    costs = [_cost(rank, Path(path)) for rank, path in items]
    total = sum(c for c, _ in costs)
    workers = _workers(len(items), jobs)
    if workers == 0 or (jobs is None and total < IN_PROCESS_BYTES):
        return _read_many(items)
    # Chunks small enough to keep every worker busy to the end, and a worker's memory bounded
    # (the pickles it keeps). Few otherwise: each fork copies the page tables of this process,
    # which grows with the columns it has received (16,384 column files in chunks of 80: 203
    # forks, 3 s of fork and 3 s of wait for the children's exits).
    target = max(total // (4 * workers), 1 << 18)
    chunks: list[list[tuple[int, str]]] = [[]]
    size = kept = 0
    for item, (cost, pickled) in zip(items, costs, strict=True):
        if chunks[-1] and (size + cost > target or kept + pickled > CHUNK_BYTES):
            chunks.append([])
            size = kept = 0
        chunks[-1].append(item)
        size += cost
        kept += pickled
    with _no_gc():
        return [r for part in _fork_map(chunks, workers) for r in part]


def _fork_map(chunks: list[list[tuple[int, str]]], workers: int) -> list[list[Result]]:
    """``_read_many`` of every chunk in a forked child, at most ``workers`` at once; a chunk
    whose child fails is read again here. A child writes its columns into a memory file of its
    own (``memfd_create``) that this process unpickles as it is once the child exits: through a
    pipe, reading, joining and copying them cost this process a third as much CPU again as the
    unpickling (1.5 s for 16,384 ranks' 1.1 GB). The pipe only tells of the exit (its end
    closes)."""
    results: list[list[Result] | None] = [None] * len(chunks)
    todo = list(range(len(chunks)))
    todo.reverse()
    running: dict[int, tuple[int, int, int]] = {}  # pipe's read fd -> (pid, chunk, memory file)
    sel = selectors.DefaultSelector()
    try:
        while todo or running:
            while todo and len(running) < workers:
                k = todo.pop()
                r, w = os.pipe()
                out = os.memfd_create(f"tether-analyze-{k}", os.MFD_CLOEXEC)
                try:
                    pid = os.fork()
                except OSError:  # no more processes: what is left is read here, below
                    for fd in (r, w, out):
                        os.close(fd)
                    todo.clear()
                    break
                if pid == 0:  # pragma: no cover - the child; its exit status says how it went
                    _child(chunks[k], r, out)
                os.close(w)
                running[r] = (pid, k, out)
                sel.register(r, selectors.EVENT_READ)
            if not running:
                break
            for key, _ in sel.select():
                fd = int(key.fd)
                if os.read(fd, 1):  # never written to: it only closes
                    continue
                sel.unregister(fd)
                os.close(fd)
                pid, k, out = running.pop(fd)
                _, status = os.waitpid(pid, 0)
                with open(out, "rb", closefd=True) as f:
                    if status == 0:
                        try:
                            results[k] = _ResultUnpickler(f).load()
                        except Exception:  # never expected; the chunk is read again here
                            results[k] = None
    finally:
        for fd, (pid, _, out) in running.items():  # only on an error here: stop the others
            sel.unregister(fd)
            os.close(fd)
            os.close(out)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        sel.close()
    return [part if part is not None else _read_many(chunks[k]) for k, part in enumerate(results)]


def _child(items: list[tuple[int, str]], r: int, out: int) -> NoReturn:
    """Read ``items`` and write their columns to the memory file ``out`` (from its start, where
    the parent reads); its exit closes the pipe whose other end ``r`` is the parent's."""
    code = 1
    try:
        os.close(r)
        gc.disable()
        keep: list[Any] = []  # every parsed dump, freed by the exit below, not one by one
        result = [_read_one(rank, path, keep) for rank, path in items]
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.pwrite(out, view, len(data) - len(view)) :]
        code = 0
    finally:
        os._exit(code)


class _ResultUnpickler(pickle.Unpickler):
    """A worker's columns: our own classes and arrays, nothing else (defence in depth: the
    worker built them from plain data)."""

    _ALLOWED = frozenset(
        {
            ("tether.analyze.model", "RankTrace"),
            ("tether.analyze.model", "GroupCols"),
            ("tether.analyze.model", "SigInfo"),
            ("tether.analyze.model", "P2POp"),
            ("array", "array"),
            ("array", "_array_reconstructor"),
            ("builtins", "bytearray"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise UnsafeDumpError(f"a worker's result holds {module}.{name}")
        return super().find_class(module, name)


def load_event_columns(event_dir: Path, files: dict[int, Path], jobs: int | None = None) -> Event:
    ranks: dict[int, RankTrace] = {}
    unreadable: dict[str, str] = {}
    for rank, path, trace, why in read_files(files, jobs):
        if trace is None:
            unreadable[path] = why
        else:
            ranks[rank] = trace
    notes: list[str] = []
    for tr in ranks.values():
        for n in tr.notes:
            if n not in notes and len(notes) < 20:
                notes.append(n)
    world_size = _world_size(ranks, files)
    stacks = read_stacks_headers(event_dir)
    known = {tr.world_size for tr in ranks.values() if tr.world_size}
    # A dump that states the world size bounds the ranks an alarm or a stacks file may name; a
    # rank beyond it (a corrupt or hostile file) would otherwise be blamed.
    limit = world_size if known else MAX_WORLD
    beyond = sorted({r for r in stacks if r >= limit})
    for r in beyond:
        del stacks[r]
    dead: dict[int, str] = {}
    reasons: dict[str, int] = {}
    event_names: dict[str, int] = {}
    for tr in ranks.values():
        for r, how in tr.dead_ranks.items():
            if r < limit:
                dead[r] = how
            elif r not in beyond:
                beyond.append(r)
        if tr.left:  # it returned while still a member: recorded like the dead, with its record
            dead.setdefault(tr.rank, LEFT)
        if tr.reason:
            reasons[tr.reason] = reasons.get(tr.reason, 0) + 1
        if tr.event:
            event_names[tr.event] = event_names.get(tr.event, 0) + 1
    if beyond:
        notes.append(
            f"rank(s) {_short(sorted(beyond))} named by a stacks file or an alarm are beyond the "
            f"world size ({world_size}): ignored"
        )
    versions = {tr.version for tr in ranks.values()}
    if len(versions) > 1:
        notes.append(f"mixed dump versions: {sorted(versions)}; compared on the common fields")
    flavors = {tr.flavor for tr in ranks.values()}
    if len(flavors) > 1:
        notes.append(f"mixed recorders: {sorted(flavors)}")
    sigs = _merge_sigs(ranks)
    groups = _groups(ranks, world_size, notes)
    _name_dropped_groups(ranks)
    alarm = _agreed_alarm(ranks)
    timeouts = sorted({tr.hang_timeout_s for tr in ranks.values() if tr.hang_timeout_s})
    hang_timeout = timeouts[0] if timeouts else None
    if hang_timeout is None and alarm is not None and alarm.timeout_s > 0:
        hang_timeout = alarm.timeout_s
    if len(timeouts) > 1:
        notes.append(f"ranks dumped with different hang timeouts {timeouts} s: taking the least")
    return Event(
        alarm=alarm,
        hosts=_hosts(ranks, stacks, dead, alarm),
        hang_timeout_s=hang_timeout,
        recovered={r: tr.recovered for r, tr in sorted(ranks.items()) if tr.recovered},
        exceptions={r: tr.exception for r, tr in sorted(ranks.items()) if tr.exception},
        stacks=stacks,
        name=event_dir.name,
        path=event_dir,
        ranks=ranks,
        unreadable=unreadable,
        world_size=world_size,
        groups=groups,
        sigs=sigs,
        dead_ranks=dead,
        reason=max(reasons, key=lambda k: reasons[k]) if reasons else None,
        notes=notes,
    )


def _hosts(
    ranks: dict[int, RankTrace],
    stacks: dict[int, StacksHeader],
    dead: dict[int, str],
    alarm: AlarmInfo | None,
) -> dict[int, str]:
    hosts = {r: h for r, header in stacks.items() if isinstance(h := header.get("host"), str)}
    hosts.update({r: tr.host for r, tr in ranks.items() if tr.host})
    for node in alarm.nodes if alarm is not None else ():
        # A node fault names each of the node's ranks dead as "<host> <state>".
        named = f"{node.host} {node.state}"
        hosts.update({r: node.host for r, how in dead.items() if how == named})
    return dict(sorted(hosts.items()))


def _agreed_alarm(ranks: dict[int, RankTrace]) -> AlarmInfo | None:
    """The alarm most dumps answered; on a tie the earliest raised, then the lowest epoch (so
    the answer never depends on the order the files were read in)."""
    counts: dict[AlarmInfo, int] = {}
    for tr in ranks.values():
        if tr.alarm is not None:
            counts[tr.alarm] = counts.get(tr.alarm, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda a: (-counts[a], a.time_ns, a.epoch, a.group, a.seq, a.op))


MAX_STACKS_FILES = 4096
"""Stacks files whose header is read (one line each); beyond it, a hostile event."""


def read_stacks_headers(event_dir: Path) -> dict[int, StacksHeader]:
    """Every ``stacks_<rank>.txt`` in the event, by rank: its header (empty for none)."""
    out: dict[int, StacksHeader] = {}
    try:
        names = sorted(os.listdir(event_dir))
    except OSError:
        return out
    for name in names:
        rank = stacks_rank(name)
        if rank is None or len(out) >= MAX_STACKS_FILES:
            continue
        if not (event_dir / name).is_file():  # a FIFO's open() would wait for a writer
            continue
        try:
            with open(event_dir / name, encoding="utf-8", errors="replace") as f:
                first = f.readline(1 << 16)
        except OSError:
            continue
        out[rank] = parse_header(first) or {}
    return out


def _world_size(ranks: dict[int, RankTrace], files: dict[int, Path]) -> int:
    sizes = [
        ws for tr in ranks.values() if tr.world_size and 0 < (ws := tr.world_size) <= MAX_WORLD
    ]
    if sizes:
        return max(sizes)
    biggest = 0
    for tr in ranks.values():
        for _desc, members in tr.pg_config.values():
            top = max(members, default=-1) + 1
            if top <= MAX_WORLD:
                biggest = max(biggest, top)
    return max(biggest, max((r for r in files if r < MAX_WORLD), default=-1) + 1)


def _merge_sigs(ranks: dict[int, RankTrace]) -> list[SigInfo]:
    """Re-code every rank's signatures into one table keyed by the op-aware key."""
    table: dict[tuple[Any, ...], int] = {}
    out: list[SigInfo] = []
    for tr in ranks.values():
        remap = []
        for s in tr.sigs:
            code = table.get(s.key)
            if code is None:
                code = table[s.key] = len(out)
                out.append(s)
            remap.append(code)
        if remap != list(range(len(remap))):
            for g in tr.groups.values():
                g.sig = type(g.sig)(g.sig.typecode, [remap[c] for c in g.sig])
        tr.sigs = []
        tr.p2p = [dataclasses.replace(p, sig=remap[p.sig]) for p in tr.p2p]
    return out


def _groups(ranks: dict[int, RankTrace], world_size: int, notes: list[str]) -> dict[str, GroupInfo]:
    groups: dict[str, GroupInfo] = {}
    seen_in: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    for r, tr in ranks.items():
        for name, (desc, members) in tr.pg_config.items():
            if name not in groups:
                groups[name] = GroupInfo(name=name, desc=desc, ranks=members)
        for name in tr.groups.keys() | {p.group for p in tr.p2p}:
            seen_in.setdefault(name, []).append(r)
        for name, desc in tr.group_desc.items():
            descs.setdefault(name, desc)
    for name, recorded_by in seen_in.items():
        if name in groups:
            continue
        desc = descs.get(name, "")
        if desc == "default_pg" or (name == "0" and desc in WORLD_DESCS):
            members = list(range(world_size))
            groups[name] = GroupInfo(name=name, desc=desc, ranks=members, inferred=True)
        else:
            groups[name] = GroupInfo(name=name, desc=desc, ranks=sorted(recorded_by), inferred=True)
            notes.append(
                f"group {name} ({desc or 'no desc'}): membership not in any dump's pg_config; "
                f"taken as the ranks that recorded it: {_short(sorted(recorded_by))}"
            )
    return groups


def _name_dropped_groups(ranks: dict[int, RankTrace]) -> None:
    """pg_status of a group a rank's ring dropped entirely: named by the pg_id other ranks'
    entries give it. pg_ids are per process (creation order), so only a pg_id every rank that
    recorded it gives one name, and that name one pg_id, is taken; the group must be one of the
    rank's own (its pg_config) and not a group its entries already name otherwise."""
    by_id: dict[str, set[str]] = {}
    by_name: dict[str, set[str]] = {}
    for tr in ranks.values():
        for pg_id, name in tr.pg_ids.items():
            by_id.setdefault(str(pg_id), set()).add(name)
            by_name.setdefault(name, set()).add(str(pg_id))
    for tr in ranks.values():
        if not tr.unnamed_enqueued:
            continue
        own = set(tr.pg_ids.values())
        for key, enq in tr.unnamed_enqueued.items():
            names = by_id.get(key, set())
            if len(names) != 1:
                continue
            (name,) = names
            if len(by_name[name]) != 1 or name in own or name == "?":
                continue
            if tr.pg_config and name not in tr.pg_config:
                continue
            tr.last_enqueued[name] = max(tr.last_enqueued.get(name, 0), enq)


def _short(ranks: list[int], limit: int = 12) -> str:
    return compress_ranks(ranks, limit)


def compress_ranks(ranks: list[int], limit: int = 16) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3, 7"``; long lists end with ``… (N ranks)``."""
    parts: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    if len(parts) > limit:
        return ", ".join(parts[:limit]) + f", … ({len(rs)} ranks)"
    return ", ".join(parts)
