"""Every rank of one event, read into columns, with the groups' memberships worked out.

Reading is the expensive part (a safe unpickle of every file); with many files it runs in forked
worker processes, each returning only the compact columns of its ranks.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tether._exceptions import UnsafeDumpError
from tether.analyze.model import GroupCols, RankTrace, SigInfo, read_rank

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


def _read_many(items: list[tuple[int, str]]) -> list[tuple[int, str, RankTrace | None, str]]:
    out: list[tuple[int, str, RankTrace | None, str]] = []
    with _no_gc():
        for rank, path in items:
            try:
                out.append((rank, path, read_rank(rank, Path(path)), ""))
            except UnsafeDumpError as exc:
                out.append((rank, path, None, str(exc)))
            except Exception as exc:  # a hostile file must not take the others down with it
                out.append((rank, path, None, f"{path}: unusable ({type(exc).__name__}: {exc})"))
    return out


def _workers(n_files: int, jobs: int | None) -> int:
    if jobs is not None:
        return max(1, jobs)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A worker costs a fork and a pickle of its columns; below a few dozen files it never pays.
    return max(1, min(cpus or 1, 16, n_files // 32))


def read_files(
    files: dict[int, Path], jobs: int | None = None
) -> list[tuple[int, str, RankTrace | None, str]]:
    items = [(r, str(p)) for r, p in sorted(files.items())]
    workers = _workers(len(items), jobs)
    if workers <= 1 or sys.platform != "linux":
        return _read_many(items)
    # fork: the workers need nothing but this module, already imported; spawn would import
    # torch again in every worker (seconds each).
    chunks = [items[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        results = [r for part in pool.map(_read_many, chunks) for r in part]
    return sorted(results, key=lambda x: x[0])


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
    dead: dict[int, str] = {}
    reasons: dict[str, int] = {}
    event_names: dict[str, int] = {}
    for tr in ranks.values():
        dead.update(tr.dead_ranks)
        if tr.reason:
            reasons[tr.reason] = reasons.get(tr.reason, 0) + 1
        if tr.event:
            event_names[tr.event] = event_names.get(tr.event, 0) + 1
    versions = {tr.version for tr in ranks.values()}
    if len(versions) > 1:
        notes.append(f"mixed dump versions: {sorted(versions)}; compared on the common fields")
    flavors = {tr.flavor for tr in ranks.values()}
    if len(flavors) > 1:
        notes.append(f"mixed recorders: {sorted(flavors)}")
    sigs = _merge_sigs(ranks)
    groups = _groups(ranks, world_size, notes)
    return Event(
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


def _world_size(ranks: dict[int, RankTrace], files: dict[int, Path]) -> int:
    sizes = [tr.world_size for tr in ranks.values() if tr.world_size]
    if sizes:
        return max(sizes)
    biggest = 0
    for tr in ranks.values():
        for _desc, members in tr.pg_config.values():
            biggest = max(biggest, max(members, default=-1) + 1)
    return max(biggest, max(files, default=-1) + 1)


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
