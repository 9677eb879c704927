"""Synthetic flight-recorder dumps in torch's schema (2.10), built in a test.

    job = Synth(world_size=4)
    sub = job.group("1", "sub", [0, 1])
    job.collective("all_reduce", sizes=[[4]])                    # every member of the world group
    job.collective("all_reduce", group=sub, skip=[1])             # rank 1 never issues it
    job.write(tmp_path / "ev")                                    # rank_0 ... rank_3

Each rank keeps its own counters (record id, per-group sequence numbers, p2p counts from 2**31
as tether writes them) and clock. ``flavor`` selects what the dumps look like: ``"tether"``
(tether's dumps, with the ``tether`` section), ``"torch"`` (torch's own recorder: no tether
section), ``"gloo"`` (torch 2.13's gloo recorder: ``pg_config`` keyed ``''``, every entry
``scheduled``, completion only in ``retired``), ``"torchcomms"`` (JSON-like: a recorder-wide
``collective_seq_id``, ``p2p_seq_id`` 0, no ``is_p2p``).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tether.events.columns import write_columns

P2P_SEQ_BASE = 1 << 31
_NAMES = [f"fn{i}" for i in range(8)]
_FILES = [f"/src/model/train_{i}.py" for i in range(8)]
MS = 1_000_000


@dataclasses.dataclass
class _Rank:
    rank: int
    clock_offset_ns: int = 0
    now_ns: int = 1_700_000_000_000_000_000
    record_id: int = 0
    global_seq: int = 0
    seq: dict[str, int] = dataclasses.field(default_factory=dict)
    p2p: dict[str, int] = dataclasses.field(default_factory=dict)
    op_id: dict[str, int] = dataclasses.field(default_factory=dict)
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Group:
    name: str
    desc: str
    ranks: list[int]
    uid: int


class Synth:
    def __init__(
        self,
        world_size: int,
        *,
        flavor: str = "tether",
        backend: str = "gloo",
        clock_offsets_ns: Mapping[int, int] | None = None,
        frames_depth: int = 3,
        step_ns: int = 10 * MS,
    ) -> None:
        self.world_size = world_size
        self.flavor = flavor
        self.backend = backend
        self.frames_depth = frames_depth
        self.step_ns = step_ns
        offsets = clock_offsets_ns or {}
        # A rank's own clock = rank 0's clock - its offset (the dump's offset maps it back).
        self.ranks = [_Rank(r, clock_offset_ns=offsets.get(r, 0)) for r in range(world_size)]
        self.groups: dict[str, _Group] = {}
        self.world = self.group("0", "default_pg", list(range(world_size)))
        self.stacks: dict[int, list[dict[str, Any]]] = {}
        self.extra: dict[int, dict[str, Any]] = {}
        self.ring_size: int | None = None

    # -- building ------------------------------------------------------------------------------
    def group(self, name: str, desc: str, ranks: list[int]) -> str:
        self.groups[name] = _Group(name, desc, list(ranks), uid=len(self.groups))
        return name

    def collective(
        self,
        op: str,
        *,
        group: str | None = None,
        sizes: list[list[int]] | None = None,
        out_sizes: list[list[int]] | None = None,
        dtype: str = "Float",
        skip: Iterable[int] = (),
        incomplete: Iterable[int] | None = None,
        lag_ns: Mapping[int, int] | None = None,
        op_by_rank: Mapping[int, str] | None = None,
        sizes_by_rank: Mapping[int, list[list[int]]] | None = None,
        dtype_by_rank: Mapping[int, str] | None = None,
    ) -> None:
        """One collective on ``group``: every member issues it except ``skip``; members in
        ``incomplete`` (default: none, or all when some rank is skipped) never complete it."""
        g = self.groups[group or self.world]
        skip = set(skip)
        pending = set(g.ranks) if incomplete is None and skip else set(incomplete or ())
        base = max(self.ranks[r].now_ns + self.ranks[r].clock_offset_ns for r in g.ranks)
        for r in g.ranks:
            if r in skip:
                continue
            st = self.ranks[r]
            lag = (lag_ns or {}).get(r, 0)
            created = base - st.clock_offset_ns + lag
            in_sz = (sizes_by_rank or {}).get(r, sizes if sizes is not None else [[4]])
            o_sz = out_sizes if out_sizes is not None and r not in (sizes_by_rank or {}) else in_sz
            self._entry(
                st,
                g,
                (op_by_rank or {}).get(r, op),
                in_sz,
                o_sz,
                (dtype_by_rank or {}).get(r, dtype),
                created,
                done=r not in pending,
                p2p=None,
            )
        for r in g.ranks:
            if r not in skip:
                self.ranks[r].now_ns = (
                    base - self.ranks[r].clock_offset_ns + self.step_ns + (lag_ns or {}).get(r, 0)
                )

    def p2p(
        self,
        src: int,
        dst: int,
        *,
        group: str | None = None,
        post_send: bool = True,
        post_recv: bool = True,
        complete: bool | None = None,
        sizes: list[list[int]] | None = None,
    ) -> None:
        """A send ``src``->``dst`` (global ranks) and its receive; either side can be left out.
        Completes only when both sides are posted, unless ``complete`` says otherwise."""
        g = self.groups[group or self.world]
        done = (post_send and post_recv) if complete is None else complete
        gs, gd = g.ranks.index(src), g.ranks.index(dst)
        sz = sizes or [[4]]
        for side, r, posted in (("send", src, post_send), ("recv", dst, post_recv)):
            if not posted:
                continue
            st = self.ranks[r]
            st.p2p[g.name] = st.p2p.get(g.name, P2P_SEQ_BASE) + 1
            arrow = f" {gs}->{gd}" if side == "send" else f" {gd}<-{gs}"
            self._entry(st, g, side, sz, sz, "Float", st.now_ns, done=done, p2p=arrow)
            st.now_ns += self.step_ns

    def _entry(
        self,
        st: _Rank,
        g: _Group,
        op: str,
        in_sizes: list[list[int]],
        out_sizes: list[list[int]],
        dtype: str,
        created: int,
        *,
        done: bool,
        p2p: str | None,
    ) -> None:
        if p2p is None:
            st.seq[g.name] = st.seq.get(g.name, 0) + 1
        st.op_id[g.name] = st.op_id.get(g.name, 0) + 1
        st.global_seq += 1
        started = created + 1000
        completed = created + 2 * MS if done else None
        # The same strings for every entry, as in a real dump (where pickle's memo shares them).
        frames = [
            {"name": _NAMES[i % 8], "filename": _FILES[i % 8], "line": 10 * i + st.rank}
            for i in range(self.frames_depth)
        ]
        e: dict[str, Any] = {
            "record_id": st.record_id,
            "pg_id": g.uid,
            "process_group": (g.name, g.desc),
            "collective_seq_id": st.seq.get(g.name, 0),
            "p2p_seq_id": st.p2p.get(g.name, P2P_SEQ_BASE) if p2p else 0,
            "op_id": st.op_id[g.name],
            "profiling_name": f"{self.backend}:{op}{p2p or ''}",
            "time_created_ns": created,
            "duration_ms": 2.0 if done else None,
            "input_sizes": in_sizes,
            "input_dtypes": [dtype] * len(in_sizes),
            "output_sizes": out_sizes,
            "output_dtypes": [dtype] * len(out_sizes),
            "state": "completed" if done else "started",
            "time_discovered_started_ns": started,
            "time_discovered_completed_ns": completed,
            "retired": done,
            "timeout_ms": 600_000,
            "is_p2p": p2p is not None,
            "thread_id": "140000",
            "thread_name": "MainThread",
            "frames": frames,
        }
        if self.flavor == "gloo":
            e["state"] = "scheduled"
            e["time_discovered_started_ns"] = None
            e["time_discovered_completed_ns"] = None
            e["p2p_seq_id"] = 0
        elif self.flavor == "torchcomms":
            e["collective_seq_id"] = st.global_seq - 1
            e["op_id"] = st.global_seq - 1
            e["p2p_seq_id"] = 0
            e["is_p2p"] = False
            e["process_group"] = [g.name, g.desc]
            e["profiling_name"] = f"{self.backend}:{op}"
            del e["frames"]
            for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                e[k] = e[k] or 0
        st.entries.append(e)
        st.record_id += 1

    def fail_last(self, ranks: Iterable[int], error: str) -> None:
        """The backend failed each rank's last operation (tether keeps it ``started``, retired,
        and records the error in ``failed``), as when a peer dies under it."""
        for r in ranks:
            last = self.ranks[r].entries[-1]
            last.update(state="started", retired=True, time_discovered_completed_ns=None)
            self.extra.setdefault(r, {}).setdefault("failed", {})[str(last["record_id"])] = error

    def alarm(
        self, reason: str = "hang", *, ranks: Iterable[int] | None = None, **fields: Any
    ) -> None:
        """Every rank's dump (or ``ranks``') answered this alarm (``fields``: its JSON fields)."""
        body = {"epoch": 1, "event_id": "synthetic", "reason": reason, "origin": "launcher"}
        body.update(fields)
        for r in range(self.world_size) if ranks is None else ranks:
            self.extra.setdefault(r, {})["alarm"] = dict(body)
            self.extra[r]["reason"] = reason

    def now(self, rank: int) -> int:
        """Rank ``rank``'s next issue time, on rank 0's clock."""
        st = self.ranks[rank]
        return st.now_ns + st.clock_offset_ns

    # -- output --------------------------------------------------------------------------------
    def dump(self, rank: int) -> dict[str, Any]:
        st = self.ranks[rank]
        entries = st.entries if self.ring_size is None else st.entries[-self.ring_size :]
        mine = [g for g in self.groups.values() if rank in g.ranks]
        if self.flavor == "gloo" and self.backend == "gloo":
            # torch 2.13's gloo recorder: one config keyed '' with empty name and desc; no p2p.
            pg_config: dict[str, Any] = {"": {"name": "", "desc": "", "ranks": "[]"}}
            entries = [e for e in entries if not e["is_p2p"]]
        else:
            sep = "," if self.flavor == "torchcomms" else ", "
            pg_config = {
                g.name: {
                    "name": g.name,
                    "desc": g.desc,
                    "ranks": "[" + sep.join(map(str, g.ranks)) + "]",
                }
                for g in mine
            }
        pg_status = {
            str(g.uid): {
                "last_enqueued_collective": st.seq.get(g.name, 0),
                "last_started_collective": st.seq.get(g.name, 0),
                "last_completed_collective": max(
                    [
                        e["collective_seq_id"]
                        for e in st.entries
                        if e["process_group"][0] == g.name and e["retired"] and not e["is_p2p"]
                    ]
                    or [0]
                ),
            }
            for g in mine
        }
        data: dict[str, Any] = {
            "version": "2.10",
            "comm_lib_version": "torch 2.13.0" if self.flavor != "torchcomms" else "2.27.5",
            "pg_config": pg_config,
            "pg_status": pg_status,
            "entries": entries,
        }
        if self.flavor == "tether":
            data["tether"] = {
                "format": 1,
                "event": "synthetic",
                "reason": "hang",
                "global_rank": rank,
                "world_size": self.world_size,
                "host": "host0",
                "pid": 1000 + rank,
                "job_id": "job",
                "clock_offset_ns": st.clock_offset_ns,
                "clock_error_ns": 50_000,
                "ring_size": self.ring_size or 2000,
                "dump_time_ns": st.now_ns + 5 * MS,
                "stacks": self.stacks.get(rank, _default_stacks(rank)),
                **self.extra.get(rank, {}),
            }
        return data

    def write(
        self,
        event_dir: Path,
        *,
        prefix: str = "rank_",
        fmt: str = "pickle",
        ranks: Iterable[int] | None = None,
        columns: bool = True,
    ) -> Path:
        event_dir.mkdir(parents=True, exist_ok=True)
        for r in range(self.world_size) if ranks is None else ranks:
            data = self.dump(r)
            path = event_dir / f"{prefix}{r}"
            if fmt == "json":
                path.write_text(json.dumps(data))
            else:
                path.write_bytes(pickle.dumps(data, protocol=4))
                if columns and prefix == "rank_":
                    write_columns(data, event_dir, r)  # what tether's writer adds (tether's only)
        return event_dir


def _default_stacks(rank: int) -> list[dict[str, Any]]:
    return [
        {
            "thread_id": 2,
            "thread_name": "tether-watchdog",
            "daemon": True,
            "frames": [{"name": "_run", "filename": "/tether/watchdog/watchdog.py", "line": 1}],
        },
        {
            "thread_id": 1,
            "thread_name": "MainThread",
            "daemon": False,
            "frames": [
                {"name": "wait", "filename": "/torch/distributed/c10d.py", "line": 99},
                {"name": "train_step", "filename": "/src/train.py", "line": 40 + rank},
                {"name": "<module>", "filename": "/src/train.py", "line": 100},
            ],
        },
    ]
