"""How fast a hang becomes every rank's dump on disk, and what the watchdog costs while healthy.

Run from the repository root::

    python bench/hang_detection.py            # about 2-3 minutes on 2 cores
    python bench/hang_detection.py --quick    # one repetition, world sizes 2 and 4

It runs real gloo jobs (``bench/workers/hang_job.py``, one process per rank, against a TCPStore
this script hosts on a free port):

1. **Dump latency.** For 2, 4 and 8 ranks: one rank (the culprit) sleeps instead of joining an
   all_reduce, the others hang inside it; tether runs with ``hang_timeout=2`` and
   ``on_hang="abort"``. The hang starts at the earliest ``time_created_ns`` of an in-flight entry
   in the event's dumps; a rank's dump is on disk when its ``rank_<r>`` file was last written or
   linked into place (``max(st_mtime_ns, st_ctime_ns)``: the file is written under a temporary
   name, fsynced, then linked; ``ctime`` moves at the link). Dump latency = last rank's file time
   - hang start - hang_timeout: what detection, the job-wide alarm and every rank's dump add to
   the timeout. Each world size runs ``--reps`` times, interleaved; median and worst are
   reported. File times come from the kernel's coarse clock (a few ms granularity); this script
   also polls the event directory itself, as a cross-check (an upper bound, within its poll).
2. **Watchdog CPU.** A healthy 2-rank job runs back-to-back small all_reduces for ``--seconds``
   with a long hang timeout; each rank reads the CPU time of its ``tether-watchdog`` thread (and
   ``tether-alarms``, ``tether-debug-server``) from ``/proc/self/task/<native_id>/stat``
   (utime+stime) before and after, divided by the wall time: percent of one core. The
   scheduler's ``schedstat`` run time (ns) is reported beside it.
3. **What plain torch does** with the same hang: gloo, torch's own flight recorder configured
   by the environment a user would set (``TORCH_FR_BUFFER_SIZE=2000``,
   ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, ``TORCH_FR_DUMP_TEMP_FILE`` and
   ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` pointing into a fresh temporary directory) and a
   process-group timeout equal to the hang timeout. Reported: how many rank dump files torch
   wrote there, and when the ranks inside the collective got an error (the culprit gets none:
   it sleeps on, and the benchmark kills it).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import REPO, env

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKER = REPO / "bench" / "workers" / "hang_job.py"
HANG_TIMEOUT_S = 2.0
HANG_EXIT_CODE = 75  # tether.watchdog.responder.HANG_EXIT_CODE, checked in main()
POLL_S = 0.01
CULPRIT = 1
HUNG_SEQ = 4
"""The hung all_reduce's sequence number: after the worker's 3 warm-up ones (WARMUP_STEPS)."""
GOAL_LATENCY_S = 1.0
GOAL_WATCHDOG_PCT = 1.0
HEALTHY_GRACE_S = 40.0
"""The healthy job's start-up and shutdown allowance, beyond its measured seconds."""


@dataclasses.dataclass
class Job:
    mode: str
    world: int
    returncodes: list[int | None]
    exit_ns: list[int | None]
    """When this script saw each rank exit (time.time_ns)."""
    results: list[list[dict[str, Any]]]
    logs: list[str]
    launched_ns: int
    seen_ns: dict[int, int]
    """tether-hang: when this script first saw rank_<r> in a hang event."""
    timed_out: bool


def worker_env(**extra: str) -> dict[str, str]:
    return env(("TETHER_", "TORCH_FR", "TORCH_NCCL"), **{"OMP_NUM_THREADS": "1", **extra})


def hang_events(dump_dir: Path) -> list[Path]:
    if not dump_dir.is_dir():
        return []
    return sorted(p for p in dump_dir.iterdir() if p.is_dir() and p.name.endswith("-hang"))


def run_job(
    mode: str,
    world: int,
    workdir: Path,
    *args: str,
    deadline_s: float,
    env: dict[str, str] | None = None,
    kill_culprit_when_others_exit: bool = False,
) -> Job:
    """Run one job to its end (bounded by ``deadline_s``) and collect what it left."""
    import torch.distributed as dist

    workdir.mkdir(parents=True, exist_ok=True)
    dump_dir = workdir / "dumps"
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs: list[subprocess.Popen[bytes]] = []
    log_paths = [workdir / f"rank_{r}.log" for r in range(world)]
    launched_ns = time.time_ns()
    for rank in range(world):
        with open(log_paths[rank], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        *("--mode", mode, "--rank", str(rank), "--world-size", str(world)),
                        *("--port", str(store.port), "--dump-dir", str(dump_dir)),
                        *("--culprit", str(CULPRIT), "--hang-timeout", str(HANG_TIMEOUT_S)),
                        *args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=worker_env(**(env or {})),
                    cwd=workdir,
                )
            )
    exit_ns: list[int | None] = [None] * world
    seen_ns: dict[int, int] = {}
    deadline = time.monotonic() + deadline_s
    timed_out = False
    try:
        while True:
            now = time.time_ns()
            for rank, p in enumerate(procs):
                if exit_ns[rank] is None and p.poll() is not None:
                    exit_ns[rank] = now
            if mode == "tether-hang":
                for event in hang_events(dump_dir):
                    for rank in range(world):
                        if rank not in seen_ns and (event / f"rank_{rank}").exists():
                            seen_ns[rank] = now
            if all(t is not None for t in exit_ns):
                break
            others_done = all(t is not None for r, t in enumerate(exit_ns) if r != CULPRIT)
            if kill_culprit_when_others_exit and others_done:
                procs[CULPRIT].kill()
            if time.monotonic() > deadline:
                timed_out = True
                if mode.startswith("tether"):
                    collect_stacks(procs)
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        del store
    logs = [path.read_text(errors="replace") for path in log_paths]
    if timed_out:  # what tether's stack signal wrote, one file per process
        for path in sorted((dump_dir / ".stacks").glob("*.txt")):
            logs.append(f"--- {path.name} (stacks at the deadline) ---\n" + path.read_text())
    results = [
        [
            json.loads(line[len("RESULT ") :])
            for line in log.splitlines()
            if line.startswith("RESULT ")
        ]
        for log in logs
    ]
    return Job(
        mode=mode,
        world=world,
        returncodes=[p.returncode for p in procs],
        exit_ns=exit_ns,
        results=results,
        logs=logs,
        launched_ns=launched_ns,
        seen_ns=seen_ns,
        timed_out=timed_out,
    )


def collect_stacks(procs: list[subprocess.Popen[bytes]]) -> None:
    """Have tether's stack signal write every live rank's threads (into DUMP_DIR/.stacks)."""
    from tether.job.stacks import STACK_SIGNAL

    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(p.pid, STACK_SIGNAL)
    time.sleep(1.0)


def tail(job: Job, lines: int = 15) -> str:
    out = []
    for rank, log in enumerate(job.logs[: job.world]):
        out.append(f"--- rank {rank} (exit {job.returncodes[rank]}) ---")
        out.extend(log.splitlines()[-lines:])
    for extra in job.logs[job.world :]:
        out.append(extra)
    return "\n".join(out)


# -- 1. dump latency -----------------------------------------------------------------------------


def measure_hang(world: int, workdir: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from tether.events.load import load_event

    deadline_s = 60.0 + 8.0 * world
    if "--warm-symbolizer" in extra:  # every rank imports torch._inductor before the hang
        deadline_s += 60.0 + 10.0 * world
    job = run_job("tether-hang", world, workdir, *extra, deadline_s=deadline_s)
    problems: list[str] = []
    if job.timed_out:
        problems.append("job did not end within its deadline")
    if job.returncodes != [HANG_EXIT_CODE] * world:
        problems.append(f"exit codes {job.returncodes}, expected {HANG_EXIT_CODE} on every rank")
    events = hang_events(workdir / "dumps")
    if len(events) != 1:
        problems.append(f"{len(events)} hang events in {workdir / 'dumps'}, expected 1")
        return {"world": world, "ok": False, "problems": problems, "logs": tail(job)}
    event = events[0]
    dumps, errors = load_event(event)
    if errors:
        problems.append(f"unreadable dumps: {errors}")
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        problems.append(f"ranks missing from the event: {missing}")
    inflight = [
        e
        for rank, d in dumps.items()
        if rank != CULPRIT
        for e in d["entries"]
        if e["state"] != "completed"
    ]
    if not inflight:
        problems.append("no in-flight entry in any dump")
        return {"world": world, "ok": False, "problems": problems, "logs": tail(job)}
    start_ns = min(e["time_created_ns"] for e in inflight)
    hung_ranks = {
        r for r, d in dumps.items() if any(e["state"] != "completed" for e in d["entries"])
    }
    if hung_ranks != set(range(world)) - {CULPRIT}:
        problems.append(f"ranks with an in-flight entry: {sorted(hung_ranks)}")
    worker_starts = [res["start_ns"] for rs in job.results for res in rs if "start_ns" in res]
    due_ns = start_ns + int(HANG_TIMEOUT_S * 1e9)
    per_rank: dict[int, dict[str, float]] = {}
    for rank in sorted(dumps):
        st = (event / f"rank_{rank}").stat()
        file_ns = max(st.st_mtime_ns, st.st_ctime_ns)
        exited = job.exit_ns[rank]
        per_rank[rank] = {
            "file_s": (file_ns - due_ns) / 1e9,
            "mtime_s": (st.st_mtime_ns - due_ns) / 1e9,
            "dump_time_s": (dumps[rank]["tether"]["dump_time_ns"] - due_ns) / 1e9,
            "seen_s": (job.seen_ns[rank] - due_ns) / 1e9 if rank in job.seen_ns else float("nan"),
            "exit_s": (exited - due_ns) / 1e9 if exited is not None else float("nan"),
        }
    alarms = {json.dumps(d["tether"].get("alarm"), sort_keys=True) for d in dumps.values()}
    if len(alarms) != 1:
        problems.append(f"ranks disagree on the alarm: {alarms}")
    alarm = next(iter(dumps.values()))["tether"].get("alarm") or {}
    if alarm.get("reason") != "hang":
        problems.append(f"alarm reason {alarm.get('reason')!r}")
    if alarm.get("seq") != HUNG_SEQ:  # a warm-up collective's wait is not the hang timed here
        problems.append(f"the alarm is for collective #{alarm.get('seq')}, not #{HUNG_SEQ}")
    return {
        "world": world,
        "ok": not problems,
        "problems": problems,
        "event": event.name,
        "ranks_dumped": len(dumps),
        "stacks_collected_for": sorted(
            int(p.name[len("stacks_") : -len(".txt")]) for p in event.glob("stacks_*.txt")
        ),
        "startup_s": (start_ns - job.launched_ns) / 1e9,
        "worker_start_skew_ms": (min(worker_starts) - start_ns) / 1e6 if worker_starts else None,
        "detect_s": (alarm.get("time_ns", 0) - due_ns) / 1e9,
        "alarm_origin": alarm.get("origin"),
        "latency_s": max(r["file_s"] for r in per_rank.values()),
        "latency_mtime_s": max(r["mtime_s"] for r in per_rank.values()),
        "latency_seen_s": max(r["seen_s"] for r in per_rank.values()),
        "first_dump_s": min(r["file_s"] for r in per_rank.values()),
        "job_end_s": max(r["exit_s"] for r in per_rank.values()),
        "per_rank": per_rank,
        "logs": tail(job) if problems else "",
    }


# -- 2. watchdog CPU ---------------------------------------------------------------------------


def measure_cpu(workdir: Path, seconds: float, tries: int = 2) -> dict[str, Any]:
    """Watchdog CPU in a healthy job. A job that never ends is reported (a hang where there
    should be none) and run again, once."""
    hangs: list[str] = []
    hold = False
    for attempt in range(tries):
        job = run_job(
            "tether-healthy",
            2,
            workdir / f"try{attempt}",
            "--seconds",
            str(seconds),
            "--hang-timeout",
            "600",
            *(("--hold-works",) if hold else ()),
            deadline_s=HEALTHY_GRACE_S + seconds,
        )
        if not job.timed_out:
            break
        # The known deadlock: the main thread issues the next collective holding the GIL while
        # gloo's worker thread, holding its queue lock, destroys the last reference to the
        # previous Work and waits for the GIL. Measure again with the Works kept alive.
        hold = True
        hangs.append(tail(job, lines=8))
        print(f"  healthy job HUNG (try {attempt}): no end within {HEALTHY_GRACE_S + seconds:g} s")
        print(hangs[-1])
    healthy = [res for rs in job.results for res in rs if res.get("role") == "healthy"]
    if job.returncodes != [0, 0] or len(healthy) != 2:
        return {
            "ok": False,
            "problems": [f"exit codes {job.returncodes}"],
            "logs": tail(job),
            "hangs": len(hangs),
        }
    per_rank = []
    for res in healthy:
        wall, tck = res["wall_s"], res["clk_tck"]
        row: dict[str, Any] = {
            "wall_s": wall,
            "ops": res["ops"],
            "ops_per_s": res["ops"] / wall,
            "process_pct": 100 * res["process_cpu_s"] / wall,
            "missing_threads": res["missing"],
        }
        for name, cpu in res["threads"].items():
            row[f"{name}_pct"] = 100 * cpu["ticks"] / tck / wall
            if "sched_ns" in cpu:
                row[f"{name}_sched_pct"] = 100 * cpu["sched_ns"] / 1e9 / wall
        per_rank.append(row)
    watchdog = [r.get("tether-watchdog_pct") for r in per_rank]
    problems = [f"the healthy job hung {len(hangs)} time(s) before this run"] if hangs else []
    if None in watchdog:
        problems.append("no tether-watchdog thread found")
    return {
        "ok": not problems,
        "problems": problems,
        "per_rank": per_rank,
        "hangs": len(hangs),
        "hold_works": hold,
    }


# -- 3. plain torch ------------------------------------------------------------------------------


def measure_native(world: int, workdir: Path) -> dict[str, Any]:
    torch_dir = workdir / "torch_fr"
    torch_dir.mkdir(parents=True)
    env = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(torch_dir / "fr_rank_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(torch_dir / "nccl_trace_rank_"),
    }
    job = run_job(
        "native-hang",
        world,
        workdir,
        "--pg-timeout",
        str(HANG_TIMEOUT_S),
        deadline_s=60.0 + 8.0 * world,
        env=env,
        kill_culprit_when_others_exit=True,
    )
    hung = {r: res for r, rs in enumerate(job.results) for res in rs if "error_after_s" in res}
    files = sorted(p.name for p in torch_dir.iterdir())
    # Where else torch might have written, had the variables been ignored: its defaults.
    default_files = sorted(
        p.name
        for p in Path(tempfile.gettempdir()).glob("*trace_rank_*")
        if p.stat().st_mtime_ns >= job.launched_ns
    )
    problems = []
    if sorted(hung) != sorted(set(range(world)) - {CULPRIT}):
        problems.append(f"ranks that got an error: {sorted(hung)}")
    if not hung:
        return {"world": world, "ok": False, "problems": problems, "logs": tail(job)}
    start_ns = min(res["start_ns"] for res in hung.values())
    due_ns = start_ns + int(HANG_TIMEOUT_S * 1e9)
    errors = sorted({res["error"] for res in hung.values()})
    return {
        "world": world,
        "ok": not problems,
        "problems": problems,
        "torch_dump_files": len(files) + len(default_files),
        "torch_dump_names": files + default_files,
        "torch_dump_dir": str(torch_dir),
        "ranks_errored": len(hung),
        "first_error_s": (min(r["error_ns"] for r in hung.values()) - start_ns) / 1e9,
        "last_error_s": (max(r["error_ns"] for r in hung.values()) - start_ns) / 1e9,
        "last_error_after_timeout_s": (max(r["error_ns"] for r in hung.values()) - due_ns) / 1e9,
        "errors": errors,
        "culprit_killed_by_bench": job.returncodes[CULPRIT] not in (0, None)
        and job.returncodes[CULPRIT] < 0,
        "torch_fr_in_memory": sorted(
            {json.dumps(res.get("torch_fr_in_memory"), sort_keys=True) for res in hung.values()}
        ),
        "logs": tail(job) if problems else "",
    }


# -- report ------------------------------------------------------------------------------------


def tree_state() -> str:
    """The commit measured, and how many files under tether/ differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "tether").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head or 'unknown'}" + (f"+{len(dirty)} changed in tether/" if dirty else "")


def source_digest() -> str:
    """A digest of tether's sources, to tell whether they changed while this ran."""
    h = hashlib.sha1()
    for path in sorted((REPO / "tether").rglob("*.py")):
        with contextlib.suppress(OSError):
            h.update(path.as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _r(x: float | None) -> float | None:
    return round(x, 4) if x is not None and x == x else None


def fmt(x: float | None, unit: str = "s") -> str:
    if x is None or x != x:
        return "-"
    return f"{x * 1000:7.0f} ms" if unit == "s" else f"{x:6.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="healthy job's length")
    parser.add_argument("--native-worlds", default="4")
    parser.add_argument("--quick", action="store_true", help="one repetition, worlds 2 and 4")
    parser.add_argument("--keep", action="store_true", help="keep the dumps and logs")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="no further repetition starts once it would end past this many seconds",
    )
    parser.add_argument(
        "--warm-symbolizer",
        action="store_true",
        help="diagnosis: each rank symbolizes one captured stack at start, so that its dump "
        "pays no first-use cost (torch's symbolize_tracebacks imports torch._inductor)",
    )
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.reps, args.seconds, args.native_worlds = "2,4", 1, 4.0, "2"
        args.budget_s = 0.0
    worlds = [int(w) for w in args.worlds.split(",")]
    native_worlds = [int(w) for w in args.native_worlds.split(",") if w]

    from tether.job.alarm import HANG_EXIT_CODE as real_exit_code

    if real_exit_code != HANG_EXIT_CODE:
        raise SystemExit(f"tether's hang exit code is {real_exit_code}, not {HANG_EXIT_CODE}")

    t_begin = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="tether-hang-bench-"))
    print(f"hang_timeout {HANG_TIMEOUT_S:g} s, culprit rank {CULPRIT}, {os.cpu_count()} CPUs")
    tree, digest = tree_state(), source_digest()
    print(f"tree {tree} (sources {digest}); work in {root}")

    # 2. Watchdog CPU in a healthy job, and 3. plain torch: short and bounded, so they go first.
    cpu = measure_cpu(root / "healthy", args.seconds)
    if not cpu["ok"]:
        print("  healthy job PROBLEM: " + "; ".join(cpu["problems"]))
        print(cpu.get("logs", ""))
    native = [measure_native(w, root / f"native-w{w}") for w in native_worlds]
    for n in native:
        print(
            f"  native world {n['world']}: torch dump files {n.get('torch_dump_files')}, "
            f"ranks errored {n.get('ranks_errored')}  "
            + ("ok" if n["ok"] else "PROBLEM: " + "; ".join(n["problems"])),
            flush=True,
        )
        if n.get("logs"):
            print(n["logs"])

    # 1. Dump latency, world sizes interleaved so slow phases of the machine hit each alike.
    # Every world size runs at least once; further repetitions only while the budget lasts.
    extra = ("--warm-symbolizer",) if args.warm_symbolizer else ()
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in worlds}
    cost: dict[int, float] = {}
    skipped = 0
    for rep in range(args.reps):
        for world in worlds:
            elapsed = time.monotonic() - t_begin
            if rep > 0 and elapsed + cost.get(world, 0.0) > args.budget_s:
                skipped += 1
                print(f"  hang  world {world} rep {rep}: skipped (budget {args.budget_s:g} s)")
                continue
            t_job = time.monotonic()
            r = measure_hang(world, root / f"hang-w{world}-r{rep}", extra)
            cost[world] = max(cost.get(world, 0.0), time.monotonic() - t_job)
            runs[world].append(r)
            status = "ok" if r["ok"] else "PROBLEM: " + "; ".join(r["problems"])
            if r.get("stacks_collected_for"):
                status += f" (peers collected the stacks of ranks {r['stacks_collected_for']})"
            print(
                f"  hang  world {world} rep {rep}: dumps {r.get('ranks_dumped', 0)}/{world}, "
                f"latency {fmt(r.get('latency_s'))}, startup {r.get('startup_s', 0):.1f} s, "
                f"job {time.monotonic() - t_job:.0f} s  {status}",
                flush=True,
            )
            if r.get("logs"):
                print(r["logs"])

    # -- tables --
    print()
    print("Dump latency: last rank's dump file on disk, after hang start + hang_timeout")
    print(
        f"{'world':>5} {'reps ok':>7} {'median':>10} {'worst':>10} {'detect':>10} "
        f"{'1st dump':>10} {'(mtime)':>10} {'(seen)':>10} {'job end':>10}"
    )
    medians: dict[str, float | None] = {}
    worsts: dict[str, float | None] = {}
    detects: dict[str, float | None] = {}
    job_ends: dict[str, float | None] = {}
    for world in worlds:
        measured = [r for r in runs[world] if "latency_s" in r]
        lat = [r["latency_s"] for r in measured]

        def med(key: str, rows: list[dict[str, Any]] = measured) -> float | None:
            vals = [r[key] for r in rows if r.get(key) is not None and r[key] == r[key]]
            return statistics.median(vals) if vals else None

        medians[str(world)] = statistics.median(lat) if lat else None
        worsts[str(world)] = max(lat) if lat else None
        detects[str(world)] = med("detect_s")
        job_ends[str(world)] = med("job_end_s")
        n_ok = sum(r["ok"] for r in runs[world])
        print(
            f"{world:>5} {n_ok:>3}/{len(runs[world]):<3} {fmt(medians[str(world)]):>10} "
            f"{fmt(worsts[str(world)]):>10} {fmt(detects[str(world)]):>10} "
            f"{fmt(med('first_dump_s')):>10} {fmt(med('latency_mtime_s')):>10} "
            f"{fmt(med('latency_seen_s')):>10} {fmt(job_ends[str(world)]):>10}"
        )
    print(
        "  (over the ranks that dumped; reps ok = every rank dumped and the job aborted cleanly;"
        "\n   detect, 1st dump, mtime, seen, job end are medians: detect = alarm raised; 1st dump ="
        "\n   first rank's file; mtime = by st_mtime only; seen = first seen by this script's"
        "\n   10 ms poll; job end = last rank exited)"
    )

    print()
    print(
        f"Watchdog CPU, healthy 2-rank job, back-to-back all_reduce for {args.seconds:g} s "
        "(% of one core)"
    )
    watchdog_pct = alarms_pct = None
    if cpu.get("per_rank"):
        names = sorted(
            {
                k[: -len("_pct")]
                for r in cpu["per_rank"]
                for k in r
                if k.endswith("_pct") and not k.endswith("_sched_pct")
            }
        )
        print(f"{'rank':>4} {'ops/s':>8} " + " ".join(f"{n:>22}" for n in names))
        for rank, row in enumerate(cpu["per_rank"]):
            nan = float("nan")
            cells = [
                f"{row.get(n + '_pct', nan):6.2f} ({row.get(n + '_sched_pct', nan):6.2f})"
                for n in names
            ]
            print(f"{rank:>4} {row['ops_per_s']:>8.0f} " + " ".join(f"{c:>22}" for c in cells))
        print("  (utime+stime from /proc/self/task/<id>/stat; in brackets: schedstat run time)")
        if cpu.get("hold_works"):
            print("  (measured with --hold-works, after the plain loop hung: see above)")
        watchdog_pct = max(r["tether-watchdog_pct"] for r in cpu["per_rank"])
        alarms_pct = max(r.get("tether-alarms_pct", 0.0) for r in cpu["per_rank"])

    print()
    print(f"Plain torch (gloo, torch's recorder on, pg timeout {HANG_TIMEOUT_S:g} s), same hang")
    print(
        f"{'world':>5} {'torch dumps':>12} {'errored ranks':>14} "
        f"{'first error':>12} {'last error':>12}"
    )
    for n in native:
        if "ranks_errored" not in n:
            print(f"{n['world']:>5}  (failed)")
            continue
        print(
            f"{n['world']:>5} {n['torch_dump_files']:>6}/{n['world']:<5} "
            f"{n['ranks_errored']:>7}/{n['world']:<6} {fmt(n['first_error_s']):>12} "
            f"{fmt(n['last_error_s']):>12}"
        )
    for n in native:
        for err in n.get("errors", []):
            print(f"  world {n['world']} error: {err}")
        for fr in n.get("torch_fr_in_memory", []):
            print(f"  world {n['world']} torch's recorder in memory (not written): {fr}")
    print(
        "  (errors timed from the hung all_reduce's start; the culprit never errors and is killed)"
    )

    all_ok = (
        all(r["ok"] for rs in runs.values() for r in rs)
        and cpu["ok"]
        and all(n["ok"] for n in native)
    )
    lat_all = [r["latency_s"] for rs in runs.values() for r in rs if "latency_s" in r]
    missing = {
        f"w{w}r{i}": r["problems"]
        for w, rs in runs.items()
        for i, r in enumerate(rs)
        if not r["ok"]
    }
    total_s = time.monotonic() - t_begin
    changed = source_digest() != digest
    if changed:
        print("WARNING: tether's sources changed while this ran; the runs may mix versions")
    verdict = (
        "every rank dumped and every job ended as expected"
        if all_ok
        else "PROBLEMS: " + json.dumps(missing)
    )
    print(f"\ntotal {total_s:.0f} s; {verdict}")
    worst = max(lat_all) if lat_all else None
    hangs_ok = bool(lat_all) and all(r["ok"] for rs in runs.values() for r in rs)
    latency_met = worst is not None and worst < GOAL_LATENCY_S and hangs_ok
    watchdog_met = watchdog_pct is not None and watchdog_pct < GOAL_WATCHDOG_PCT
    print(
        f"goal: dump latency < {GOAL_LATENCY_S:g} s on every rank: "
        f"{'met' if latency_met else 'NOT MET'} (worst {fmt(worst).strip()})"
    )
    print(
        f"goal: watchdog < {GOAL_WATCHDOG_PCT:g} % of a core: "
        f"{'met' if watchdog_met else 'NOT MET'} (worst rank {fmt(watchdog_pct, '%').strip()})"
    )
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "hang_timeout_s": HANG_TIMEOUT_S,
        "worst_dump_latency_s": round(max(lat_all), 4) if lat_all else None,
        "median_dump_latency_s": {w: _r(v) for w, v in medians.items()},
        "worst_dump_latency_s_by_world": {w: _r(v) for w, v in worsts.items()},
        "median_detect_s": {w: _r(v) for w, v in detects.items()},
        "median_job_end_from_hang_start_s": {
            w: _r(v + HANG_TIMEOUT_S if v is not None else None) for w, v in job_ends.items()
        },
        "reps": args.reps,
        "reps_done": {str(w): len(rs) for w, rs in runs.items()},
        "reps_skipped_for_budget": skipped,
        "warm_symbolizer": args.warm_symbolizer,
        "ranks_missing_from_events": sum(
            r["world"] - r.get("ranks_dumped", 0) for rs in runs.values() for r in rs
        ),
        "watchdog_cpu_pct": round(watchdog_pct, 3) if watchdog_pct is not None else None,
        "alarms_cpu_pct": round(alarms_pct, 3) if alarms_pct is not None else None,
        "healthy_ops_per_s": round(statistics.median(r["ops_per_s"] for r in cpu["per_rank"]))
        if cpu.get("per_rank")
        else None,
        "healthy_job_hangs": cpu.get("hangs", 0),
        "healthy_hold_works": cpu.get("hold_works", False),
        "native": {
            str(n["world"]): {
                "torch_dump_files": n.get("torch_dump_files"),
                "ranks_errored": n.get("ranks_errored"),
                "first_error_s": round(n["first_error_s"], 4) if "first_error_s" in n else None,
                "last_error_s": round(n["last_error_s"], 4) if "last_error_s" in n else None,
            }
            for n in native
        },
        "ok": all_ok,
        "goal_latency_met": latency_met,
        "goal_watchdog_met": watchdog_met,
        "total_s": round(total_s, 1),
        "tree": tree,
        "sources_changed_during_run": changed,
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
