"""One rank of a job run by ``bench/hang_detection.py``.

Modes (``--mode``):

  tether-hang     recorded by tether (hang_timeout, on_hang="abort"); after a few warm-up steps the
                  culprit sleeps instead of joining an all_reduce, the other ranks hang inside it.
                  tether's watchdog and alarms dump every rank and abort the job.
  tether-healthy  recorded by tether with a long hang_timeout; back-to-back small all_reduces for
                  ``--seconds``; prints the CPU time of tether's threads over that window.
  native-hang     plain torch (gloo, torch's own flight recorder configured by the environment,
                  ``--pg-timeout``); the same hang; the ranks in the collective report when torch
                  errors out.

Every rank prints one ``RESULT {json}`` line. Run by the benchmark, never directly.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WARMUP_STEPS = 3
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOT_ABORTED_EXIT = 3
"""The culprit woke from its sleep: nobody ended the job."""
HANG_RETURNED_EXIT = 4
"""The hung collective returned: there was no hang."""


def result(**data: Any) -> None:
    print("RESULT " + json.dumps(data, sort_keys=True), flush=True)


def connect(args: argparse.Namespace) -> dist.TCPStore:
    """A client of the benchmark's store, after every rank has arrived: a slow start (8 ranks
    on 2 cores) then cannot trip a short process-group timeout during group formation."""
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world_size, is_master=False, timeout=timedelta(seconds=120)
    )
    arrived(args, store, "ready")
    return store


def arrived(args: argparse.Namespace, store: dist.TCPStore, what: str) -> None:
    """Wait until every rank is past ``what``."""
    store.set(f"bench/{what}/{args.rank}", "1")
    store.wait([f"bench/{what}/{r}" for r in range(args.world_size)], timedelta(seconds=120))


# -- CPU time of threads ---------------------------------------------------------------------


def thread_cpu(native_id: int) -> dict[str, int]:
    """CPU time of one thread of this process: utime+stime (clock ticks, from ``stat``) and the
    scheduler's run time in ns (``schedstat``, when the kernel has it)."""
    task = Path(f"/proc/self/task/{native_id}")
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    out = {"ticks": int(fields[11]) + int(fields[12])}
    with contextlib.suppress(OSError, ValueError, IndexError):
        out["sched_ns"] = int((task / "schedstat").read_text().split()[0])
    return out


def threads_cpu() -> dict[str, dict[str, int]]:
    out = {}
    for t in threading.enumerate():
        if t.native_id is not None and (t.name.startswith("tether") or t.name == "MainThread"):
            try:
                out[t.name] = thread_cpu(t.native_id)
            except OSError:
                continue
    return out


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- modes -----------------------------------------------------------------------------------


def tether_init(args: argparse.Namespace, store: dist.TCPStore) -> None:
    import tether

    tether.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world_size,
        dump_dir=args.dump_dir,
        hang_timeout=args.hang_timeout,
        on_hang="abort",
        # gloo's own timeout far beyond tether's: only tether may end the job.
        timeout=timedelta(seconds=args.pg_timeout),
    )


def warm_symbolizer() -> float:
    """Symbolize one captured stack now, as a dump would, so that the dump pays no first-use
    cost (torch's symbolize_tracebacks imports torch._inductor on its first call). Returns the
    seconds it took."""
    from tether.recorder import frames

    start = time.monotonic()
    frames.symbolize([frames.capture(1)], 1)
    return time.monotonic() - start


def warm_up(t: torch.Tensor) -> None:
    for _ in range(WARMUP_STEPS):
        dist.all_reduce(t)


def tether_hang(args: argparse.Namespace) -> None:
    store = connect(args)
    tether_init(args, store)
    warmed_s = warm_symbolizer() if args.warm_symbolizer else None
    # Ranks leave init seconds apart with 8 on 2 cores: the first all_reduce would wait that long
    # for the last, and a wait past the hang timeout is a hang (of the warm-up, not the one timed).
    arrived(args, store, "initialized")
    t = torch.ones(8)
    warm_up(t)
    if args.rank == args.culprit:
        result(role="culprit", pid=os.getpid(), warm_symbolizer_s=warmed_s)
        time.sleep(args.sleep_seconds)  # tether aborts the job long before this ends
        result(role="culprit", woke=True)
        os._exit(NOT_ABORTED_EXIT)
    start_ns = time.time_ns()
    result(role="hung", pid=os.getpid(), start_ns=start_ns, warm_symbolizer_s=warmed_s)
    dist.all_reduce(t)  # hangs: the culprit never joins
    result(role="hung", returned_after_s=(time.time_ns() - start_ns) / 1e9)
    os._exit(HANG_RETURNED_EXIT)


def tether_healthy(args: argparse.Namespace) -> None:
    tether_init(args, connect(args))
    torch.set_num_threads(1)
    t = torch.zeros(2)
    warm_up(t)
    # Rank 0 decides when to stop; the decision rides in the collective itself (element 0), so
    # every rank leaves the loop after the same operation.
    before, cpu0, wall0 = threads_cpu(), process_cpu_s(), time.monotonic_ns()
    deadline = time.monotonic() + args.seconds
    ops = 0
    held: collections.deque[Any] = collections.deque(maxlen=8)
    while True:
        t[0] = 1.0 if (args.rank == 0 and time.monotonic() >= deadline) else 0.0
        t[1] = 1.0
        if args.hold_works:
            # Keep the last few operations' Works alive past the next issue, so that gloo's
            # worker threads never drop the last reference to a Work (see the benchmark).
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            held.append(work)
        else:
            dist.all_reduce(t)
        ops += 1
        if t[0].item() > 0:
            break
    after, cpu1, wall1 = threads_cpu(), process_cpu_s(), time.monotonic_ns()
    threads = {
        name: {k: after[name][k] - before[name][k] for k in after[name] if k in before[name]}
        for name in after
        if name in before
    }
    del held
    result(
        role="healthy",
        hold_works=args.hold_works,
        wall_s=(wall1 - wall0) / 1e9,
        ops=ops,
        process_cpu_s=cpu1 - cpu0,
        clk_tck=CLK_TCK,
        threads=threads,
        missing=sorted(set(before) ^ set(after)),
    )
    dist.destroy_process_group()


def native_hang(args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo",
        store=connect(args),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    t = torch.ones(8)
    warm_up(t)
    if args.rank == args.culprit:
        result(role="culprit", pid=os.getpid())
        time.sleep(args.sleep_seconds)  # the benchmark kills it once the others have failed
        result(role="culprit", woke=True)
        os._exit(NOT_ABORTED_EXIT)
    start_ns = time.time_ns()
    try:
        dist.all_reduce(t)
    except Exception as exc:  # what a plain job sees: the collective raises after pg timeout
        end_ns = time.time_ns()
        # What torch's own recorder holds now (it writes no file for gloo; a user could only
        # fetch it like this, from a rank whose main thread got the error).
        fr: dict[str, Any] = {}
        try:
            import pickle

            from torch._C._distributed_c10d import _dump_fr_trace

            raw = pickle.loads(_dump_fr_trace(True, False, False))
            entries = raw.get("entries", [])
            fr = {
                "entries": len(entries),
                "last_state": entries[-1].get("state") if entries else None,
                "states": sorted({str(e.get("state")) for e in entries}),
            }
        except Exception as fr_exc:
            fr = {"error": f"{type(fr_exc).__name__}: {fr_exc}"}
        result(
            role="hung",
            pid=os.getpid(),
            start_ns=start_ns,
            error_ns=end_ns,
            error_after_s=(end_ns - start_ns) / 1e9,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            torch_fr_in_memory=fr,
        )
        os._exit(1)
    result(role="hung", returned_after_s=(time.time_ns() - start_ns) / 1e9)
    os._exit(HANG_RETURNED_EXIT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["tether-hang", "tether-healthy", "native-hang"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dump-dir", required=True)
    parser.add_argument("--culprit", type=int, default=1)
    parser.add_argument("--hang-timeout", type=float, default=2.0)
    parser.add_argument("--pg-timeout", type=float, default=120.0)
    parser.add_argument("--sleep-seconds", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--hold-works",
        action="store_true",
        help="tether-healthy: keep each Work referenced until the next operation is issued",
    )
    parser.add_argument(
        "--warm-symbolizer",
        action="store_true",
        help="tether-hang: symbolize once at start, so the dump does not pay torch's first call",
    )
    args = parser.parse_args()
    {"tether-hang": tether_hang, "tether-healthy": tether_healthy, "native-hang": native_hang}[
        args.mode
    ](args)


if __name__ == "__main__":
    main()
