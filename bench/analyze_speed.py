"""How fast `tether analyze` reads a large event, against torch's own analyzer on the same files.

    python bench/analyze_speed.py [--ranks 512] [--entries 2000] [--reps 3] [--fr-timeout 900]
                                  [--skip-fr-trace] [--keep DIR]

Builds a synthetic event of RANKS dumps as tether writes them (pickle files ``rank_<r>`` in
torch's schema, and beside each its column file ``cols_<r>.npz``, written by tether's writer's own
function), ENTRIES entries each: three all_reduces for every all_gather in one of eight
data-parallel subgroups, 12 frames of stack per entry (frame dicts shared between entries, as
torch's C++ pickler writes them), the last collective never joined by one rank (a hang, so both
analyzers have something to find). Then runs, as subprocesses, as a user would:

    tether analyze EVENT --json                                     (--reps times: the median)
    tether analyze PICKLES --json    (--reps times: the same dumps without their column files, as
                                      torch's own recorder leaves them)
    python -m torch.distributed.flight_recorder.fr_trace EVENT -p rank_  (once, after the first)
    tether analyze EVENT --json --jobs 1                                 (once: one CPU)

every one of them with the files read once just before (page cache warm for all). Each run's
wall time, and its peak memory: the larger of wait4's ru_maxrss (its largest process) and the
largest sum of proportional set sizes over the process and its workers (forked workers' shared
pages counted once), sampled every 50 ms. fr_trace is stopped after --fr-timeout seconds; its
time is then a lower bound. Also what gathering the event to one node takes over a 10 Gb/s link
(``gather_s_10gbps``: its bytes in this format, as the nodes send their parts, / the link's
rate). Ends with one JSON line; exits 1 when tether's diagnosis does not name the rank that
hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import spread

from tether.events.columns import write_columns

MS = 1_000_000
CULPRIT = 137
LINK_GBPS = 10.0
"""The link the event is gathered over: every other node sends its part to the one that
assembles it, whose one link takes all of them (the event's bytes / its rate)."""


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
            "tether": {  # what tether's writer adds (torch's analyzer never reads it)
                "format": 1,
                "event": event_dir.name,
                "reason": "hang",
                "global_rank": r,
                "world_size": ranks,
                "host": f"node{r // 16}",
                "clock_offset_ns": 0,
                "hang_timeout_s": 600.0,
                "dump_time_ns": t0 + entries * 10 * MS,
            },
        }
        (event_dir / f"rank_{r}").write_bytes(pickle.dumps(data, protocol=4))
        write_columns(data, event_dir, r)  # tether's writer's own function


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/TID/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _tree_memory(pid: int) -> int:
    """The memory of ``pid`` and its descendants, in bytes: the sum of their proportional set
    sizes (a page shared by k processes counts 1/k in each: forked workers share the parent's
    pages until they write them), from ``/proc/PID/smaps_rollup``; a process whose PSS cannot
    be read counts its RSS."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss = [line for line in f if line.startswith("Pss:")]
            total += int(pss[0].split()[1]) * 1024
            continue
        except (OSError, IndexError, ValueError):
            pass
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclasses.dataclass
class Run:
    wall_s: float
    rc: int | None
    """Exit status; None when it was stopped at the timeout."""
    maxrss_mb: float
    """The largest single process of the run (wait4's ru_maxrss: the command or a worker)."""
    tree_peak_mb: float
    """The largest memory of the command and its workers together (:func:`_tree_memory`),
    sampled every 50 ms."""
    out: str

    @property
    def peak_mb(self) -> float:
        return max(self.maxrss_mb, self.tree_peak_mb)


def measure(cmd: list[str], timeout: float) -> Run:
    """Runs ``cmd``, its output to a temporary file; wall time, peak memory, exit status."""
    with tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.wait(0.05):
                peak = max(peak, _tree_memory(p.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc: int | None = None
        deadline = t + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                wall = time.perf_counter() - t
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                wall = time.perf_counter() - t
                for q in reversed(_tree(p.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(q, signal.SIGKILL)
                _, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.01)
        p.returncode = rc if rc is not None else -9  # reaped here, not by Popen
        stop.set()
        sampler.join()
        out.seek(0)
        text = out.read().decode(errors="replace")
    return Run(wall, rc, usage.ru_maxrss / 1024.0, peak / 2**20, text)


def warm(event: Path) -> None:
    """Both analyzers read the files from the page cache."""
    for p in sorted(event.iterdir()):
        p.read_bytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--fr-timeout", type=float, default=900.0)
    ap.add_argument("--keep", type=Path, help="build the event here and keep it")
    ap.add_argument("--skip-fr-trace", action="store_true", help="time tether analyze only")
    ap.add_argument("--reps", type=int, default=3, help="runs of each tether analyze command")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tether-analyze-bench-"))
    event = (args.keep or tmp) / "20261130T101500.000000Z-hang"
    try:
        t = time.perf_counter()
        if not (event / f"rank_{args.ranks - 1}").exists():
            build_event(event, args.ranks, args.entries)
        os.sync()  # no writeback of the new files during the first measurement
        size_mb = sum(p.stat().st_size for p in event.iterdir()) / 1e6
        gather_s = size_mb * 1e6 * 8 / (LINK_GBPS * 1e9)
        print(
            f"event: {args.ranks} ranks x {args.entries} entries ({size_mb:.0f} MB) ready in "
            f"{time.perf_counter() - t:.1f} s; gathered to one node over {LINK_GBPS:g} Gb/s in "
            f"{gather_s:.1f} s",
            flush=True,
        )
        # The same dumps without their column files: what tether reads of torch's own dumps
        # (and read before column files existed). Hard links: no second copy on disk.
        bare = tmp / "pickles" / event.name
        bare.mkdir(parents=True)
        for p in event.glob("rank_*"):
            os.link(p, bare / p.name)
        tether = [sys.executable, "-m", "tether.cli.main", "analyze", str(event), "--json"]
        pickles = [sys.executable, "-m", "tether.cli.main", "analyze", str(bare), "--json"]
        fr = [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            str(event),
            "-p",
            "rank_",
        ]
        # Each command three times, interleaved (a burst of load on a shared machine hits one
        # run of each, not one command's figure); fr_trace once, after the first round. Then
        # tether once more with one worker process (one CPU busy).
        runs: list[Run] = []
        bare_runs: list[Run] = []
        diag: dict[str, Any] = {}
        for k in range(args.reps):
            for cmd, kept in ((tether, runs), (pickles, bare_runs)):
                warm(event)
                r = measure(cmd, 600)
                if r.rc != 0:
                    print(r.out[-2000:], file=sys.stderr)
                    return 1
                got = json.loads(r.out.strip().splitlines()[-1])
                if cmd is tether:
                    diag = got
                elif (got["verdict"], got["culprit_ranks"]) != (
                    diag["verdict"],
                    diag["culprit_ranks"],
                ):
                    print(f"the pickles alone say {got['verdict']} {got['culprit_ranks']}")
                    return 1
                kept.append(r)
                what = "tether analyze" + ("" if cmd is tether else " (pickles only)")
                print(f"{what}: {r.wall_s:.2f} s, {r.peak_mb:.0f} MB", flush=True)
            if k == 0 and not args.skip_fr_trace:
                warm(event)
                f = measure(fr, args.fr_timeout)
                state = "timed out" if f.rc is None else f"exit {f.rc}"
                print(f"fr_trace: {f.wall_s:.2f} s, {f.peak_mb:.0f} MB, {state}", flush=True)
        warm(event)
        single = measure([*tether, "--jobs", "1"], 600)
        print(f"tether analyze --jobs 1: {single.wall_s:.2f} s, {single.peak_mb:.0f} MB")
        med = statistics.median(r.wall_s for r in runs)
        bare_med = statistics.median(r.wall_s for r in bare_runs)
        peak = max(r.peak_mb for r in runs)
        culprit_ok = args.ranks <= CULPRIT or (
            diag["verdict"] == "hang" and diag["culprit_ranks"] == [CULPRIT]
        )
        print()
        print("| analyzer | wall time, median [min-max] | peak memory | result |")
        print("| --- | --- | --- | --- |")
        print(
            f"| `tether analyze` (column files, runs: {args.reps}) | "
            f"{spread([r.wall_s for r in runs], '{:.2f}')} s | {peak:.0f} MB | "
            f"{diag['verdict']}, culprit {diag['culprit_ranks']} |"
        )
        print(
            f"| `tether analyze` (pickles only, runs: {args.reps}) | "
            f"{spread([r.wall_s for r in bare_runs], '{:.2f}')} s | "
            f"{max(r.peak_mb for r in bare_runs):.0f} MB | same |"
        )
        print(
            f"| `tether analyze --jobs 1` (column files) | {single.wall_s:.2f} s | "
            f"{single.peak_mb:.0f} MB | same, one worker process |"
        )
        result: dict[str, Any] = {
            "ranks": args.ranks,
            "entries": args.entries,
            "event_mb": round(size_mb, 1),
            "gather_s_10gbps": round(gather_s, 2),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "tether_s": round(med, 3),
            "tether_runs_s": [round(r.wall_s, 3) for r in runs],
            "tether_pickles_only_s": round(bare_med, 3),
            "tether_pickles_only_runs_s": [round(r.wall_s, 3) for r in bare_runs],
            "columns_speedup": round(bare_med / med, 1),
            "tether_jobs1_s": round(single.wall_s, 3),
        }
        if not args.skip_fr_trace:
            bound = f.rc is None
            fr_line = f.out.strip().splitlines()[-1][:60] if f.out.strip() else ""
            print(
                f"| `fr_trace -p rank_` | {'>' if bound else ''}{f.wall_s:.2f} s | "
                f"{f.peak_mb:.0f} MB | {'timed out' if bound else f'exit {f.rc}'} {fr_line} |"
            )
            result.update(
                {
                    "fr_trace_s": round(f.wall_s, 3),
                    "fr_trace_exit": f.rc,
                    "fr_trace_timed_out": bound,
                    "speedup_vs_fr_trace": round(f.wall_s / med, 1),
                    "speedup_jobs1_vs_fr_trace": round(f.wall_s / single.wall_s, 1),
                    "speedup_is_lower_bound": bound,
                    "fr_trace_peak_rss_mb": round(f.peak_mb, 1),
                }
            )
        result.update(
            {
                "peak_rss_mb": round(peak, 1),
                "peak_rss_jobs1_mb": round(single.peak_mb, 1),
                "verdict": diag["verdict"],
                "culprit_ranks": diag["culprit_ranks"],
                "culprit_expected": [CULPRIT] if args.ranks > CULPRIT else None,
                "culprit_ok": culprit_ok,
            }
        )
        print(json.dumps(result))
        return 0 if culprit_ok else 1
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
