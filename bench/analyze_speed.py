"""How fast `tether analyze` reads a large event, against torch's own analyzer on the same files.

    python bench/analyze_speed.py [--ranks 512] [--entries 2000] [--fr-timeout 900]

Builds a synthetic event of RANKS dumps in torch's schema (pickle files ``rank_<r>``, as torch
and tether write them), ENTRIES entries each: three all_reduces for every all_gather in one of
eight data-parallel subgroups, 12 frames of stack per entry (frame dicts shared between entries,
as torch's C++ pickler writes them), the last collective never joined by one rank (a hang, so
both analyzers have something to find). Then runs, as subprocesses, as a user would:

    tether analyze EVENT --json
    python -m torch.distributed.flight_recorder.fr_trace EVENT -p rank_

and reports wall time and peak RSS of each (getrusage of the children: the largest process of
each run). fr_trace is stopped after --fr-timeout seconds; its time is then a lower bound.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MS = 1_000_000
CULPRIT = 137


def _frames(rank: int) -> list[list[dict[str, Any]]]:
    names = ["all_reduce", "wrapper", "_reduce", "step", "train_step", "run", "main", "<module>"]
    sites = []
    for site in range(4):
        sites.append(
            [
                {
                    "name": names[i % 8],
                    "filename": f"/src/model/layer_{i}.py",
                    "line": 10 * i + site,
                }
                for i in range(12)
            ]
        )
    del rank
    return sites


def build_event(event_dir: Path, ranks: int, entries: int) -> None:
    event_dir.mkdir(parents=True, exist_ok=True)
    n_sub = 8
    subs = [list(range(i, ranks, n_sub)) for i in range(n_sub)]
    t0 = 1_700_000_000_000_000_000
    for r in range(ranks):
        sub = r % n_sub
        members = subs[sub]
        sites = _frames(r)
        out = []
        world_seq = sub_seq = 0
        hang = r == CULPRIT
        for k in range(entries):
            last = k == entries - 1
            is_ag = k % 4 == 3
            if is_ag:
                sub_seq += 1
                seq, pg, pg_id = sub_seq, (str(sub + 1), f"dp{sub}"), sub + 1
                name, isz, osz = "gloo:_all_gather_base", [[16]], [[16 * len(members)]]
            else:
                world_seq += 1
                seq, pg, pg_id = world_seq, ("0", "default_pg"), 0
                name, isz, osz = "gloo:all_reduce", [[1024, 1024]], [[1024, 1024]]
            if last and hang:
                break  # the culprit never issues the last collective
            created = t0 + k * 10 * MS + (r % 7) * 1000
            done = not last
            out.append(
                {
                    "record_id": k,
                    "pg_id": pg_id,
                    "process_group": pg,
                    "collective_seq_id": seq,
                    "p2p_seq_id": 0,
                    "op_id": seq,
                    "profiling_name": name,
                    "time_created_ns": created,
                    "duration_ms": 1.5 if done else None,
                    "input_sizes": isz,
                    "input_dtypes": ["Float"],
                    "output_sizes": osz,
                    "output_dtypes": ["Float"],
                    "state": "completed" if done else "started",
                    "time_discovered_started_ns": created + 1000,
                    "time_discovered_completed_ns": created + 2 * MS if done else None,
                    "retired": done,
                    "timeout_ms": 600000,
                    "is_p2p": False,
                    "thread_id": "140001",
                    "thread_name": "MainThread",
                    "frames": list(sites[k % 4]),
                }
            )
        data = {
            "version": "2.10",
            "comm_lib_version": "torch 2.13.0",
            "pg_config": {
                "0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(ranks)))},
                str(sub + 1): {"name": str(sub + 1), "desc": f"dp{sub}", "ranks": str(members)},
            },
            "pg_status": {},
            "entries": out,
        }
        (event_dir / f"rank_{r}").write_bytes(pickle.dumps(data, protocol=4))


def _run(cmd: list[str], timeout: float) -> tuple[float, float, int | None, str]:
    """(wall seconds, peak RSS MB of the child, exit status or None on timeout, output tail)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rc: int | None = p.returncode
        out = (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = str(exc.stdout or "")[-500:]
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest child so far, in KiB: a run that peaks below an
    # earlier one reads as that earlier peak, so run the lighter command first.
    return wall, max(after, before) / 1024.0, rc, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--fr-timeout", type=float, default=900.0)
    ap.add_argument("--keep", type=Path, help="build the event here and keep it")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tether-analyze-bench-"))
    event = (args.keep or tmp) / "20261130T101500.000000Z-hang"
    try:
        t = time.perf_counter()
        build_event(event, args.ranks, args.entries)
        size_mb = sum(p.stat().st_size for p in event.iterdir()) / 1e6
        print(
            f"built {args.ranks} ranks x {args.entries} entries ({size_mb:.0f} MB) in "
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
        tether = [sys.executable, "-m", "tether.cli.main", "analyze", str(event), "--json"]
        t_wall, t_rss, t_rc, t_out = _run(tether, 600)
        if t_rc != 0:
            print(t_out, file=sys.stderr)
            return 1
        diag = json.loads(t_out.strip().splitlines()[-1])
        fr = [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(event),
            "-p",
            "rank_",
        ]
        f_wall, f_rss, f_rc, f_out = _run(fr, args.fr_timeout)
        bound = f_rc is None
        print()
        print("| analyzer | wall time | peak RSS | result |")
        print("| --- | --- | --- | --- |")
        print(
            f"| `tether analyze` | {t_wall:.2f} s | {t_rss:.0f} MB | {diag['verdict']}, culprit "
            f"{diag['culprit_ranks']} |"
        )
        fr_line = f_out.strip().splitlines()[-1][:60] if f_out.strip() else ""
        print(
            f"| `fr_trace` | {'>' if bound else ''}{f_wall:.2f} s | {f_rss:.0f} MB | "
            f"{'timed out' if bound else f'exit {f_rc}'} {fr_line} |"
        )
        speedup = f_wall / t_wall
        result = {
            "ranks": args.ranks,
            "entries": args.entries,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "tether_s": round(t_wall, 3),
            "fr_trace_s": round(f_wall, 3),
            "fr_trace_timed_out": bound,
            "speedup_vs_fr_trace": round(speedup, 1),
            "speedup_is_lower_bound": bound,
            "peak_rss_mb": round(t_rss, 1),
            "fr_trace_peak_rss_mb": round(f_rss, 1),
            "verdict": diag["verdict"],
            "culprit_ranks": diag["culprit_ranks"],
            "culprit_expected": [CULPRIT] if args.ranks > CULPRIT else None,
        }
        print(json.dumps(result))
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
