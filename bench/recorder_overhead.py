"""What recording costs: per collective, and on a small DDP training step.

Run from the repository root::

    python bench/recorder_overhead.py            # about 2-3 minutes on 2 cores
    python bench/recorder_overhead.py --quick    # a smoke run, numbers meaningless

It measures, with gloo over loopback:

1. a small ``all_reduce`` (1 float and 1 KiB) on a plain group and on a tether-recorded group,
   both in the *same* processes, in alternating batches. The added cost is
   ``median(tether batches) - median(plain batches)`` of the time per operation. World size 2,
   and world size 1 (one process: far less noise).
2. torch's own C++ flight recorder. It is chosen per process (``TORCH_FR_BUFFER_SIZE``, read
   once), so processes with it off (``0``) and on (``2000``) are compared: at world size 1 side
   by side, one per CPU, at the same time; at world size 2 alternately. In torch 2.13 a gloo
   group records by default (2000 entries): "off" needs ``TORCH_FR_BUFFER_SIZE=0``.
3. a DDP training step of a small MLP (world size 2, batch 32): one DDP model over a recorded
   group and one over a plain group, in the same processes, stepped in alternating batches.

The tether figures are taken with torch's recorder off, so they are tether's cost alone. The
machine is assumed noisy: each comparison alternates its two sides in short batches and reports
medians (and the median and spread of the per-round differences).

A job that stops making progress (a hang) is killed after ``--stall-s`` seconds; what it measured
until then is still reported, and its figures that are missing are null, with the reason under
"errors". The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = {"1 float": 1, "1 KiB": 256}
"""all_reduce payloads, in float32 elements."""

# -- workers (run as subprocesses of this script) ---------------------------------------------


class _Worker:
    """One rank of a job: its store, its heartbeat and its (partial) results file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.tmp)
        self.name = f"{args.tag}.rank{args.rank}"
        self.result: dict[str, Any] = {}
        self.beat()

    def beat(self) -> None:
        """Tell the driver this rank is still making progress."""
        (self.dir / f"{self.name}.beat").touch()

    def save(self) -> None:
        """Write what was measured so far (the driver reads it even if a later phase hangs)."""
        tmp = self.dir / f"{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.result))
        tmp.replace(self.dir / f"{self.name}.json")

    def init_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # two processes share two cores
        dist.init_process_group(
            "gloo",
            store=self._store(),
            rank=self.args.rank,
            world_size=self.args.world,
            timeout=timedelta(seconds=60),
        )

    def _store(self) -> Any:
        """Rank 0 hosts the store on a free port and publishes the port in a file."""
        import torch.distributed as dist

        args = self.args
        port_file = self.dir / f"{args.tag}.port"
        timeout = timedelta(seconds=60)
        if args.rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False, timeout=timeout
            )
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(store.port))
            tmp.replace(port_file)
            return store
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its store port in {port_file}")
            time.sleep(0.02)
        port = int(port_file.read_text())
        return dist.TCPStore("127.0.0.1", port, args.world, is_master=False, timeout=timeout)

    def wait_for_partner(self) -> None:
        """Start timing together with the job that runs beside this one."""
        if not self.args.partner:
            return
        (self.dir / f"{self.args.tag}.ready").touch()
        deadline = time.monotonic() + 60
        while not (self.dir / f"{self.args.partner}.ready").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.args.partner} did not start")
            time.sleep(0.005)

    def interleave(
        self, sides: dict[str, Any], rounds: int, run: Callable[[Any], float]
    ) -> dict[str, list[float]]:
        """``run(side)`` for every side, ``rounds`` times; which side goes first alternates."""
        names = list(sides)
        out: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                out[name].append(run(sides[name]))
                self.beat()
        return out


def _recorded_and_plain_groups(world: int) -> tuple[Any, Any]:
    """A recorded and a plain group over the same ranks, beside a plain default group."""
    import torch.distributed as dist

    import tether
    from tether.recorder.group import is_recording

    ranks = list(range(world))
    tether.install()
    g_rec = dist.new_group(ranks)
    tether.uninstall()
    g_plain = dist.new_group(ranks)
    if not is_recording(g_rec) or is_recording(g_plain) or is_recording(dist.group.WORLD):
        raise RuntimeError("benchmark setup: expected exactly one recorded group")
    return g_rec, g_plain


def _time_ops(group: Any, tensor: Any, n: int) -> float:
    """Microseconds per blocking all_reduce, over ``n`` of them."""
    import torch.distributed as dist

    all_reduce = dist.all_reduce
    t0 = time.perf_counter()
    for _ in range(n):
        all_reduce(tensor, group=group)
    return (time.perf_counter() - t0) / n * 1e6


def _worker_ops(w: _Worker) -> None:
    """Plain against recorded all_reduce, per payload size."""
    import torch

    args = w.args
    w.init_process_group()
    g_rec, g_plain = _recorded_and_plain_groups(args.world)
    sides = {"plain": g_plain, "tether": g_rec}
    w.result["ops"] = {}
    for label, numel in SIZES.items():
        tensor = torch.ones(numel)
        for group in sides.values():
            _time_ops(group, tensor, args.warmup)
        w.result["ops"][label] = w.interleave(
            sides, args.rounds, lambda g, t=tensor: _time_ops(g, t, args.ops)
        )
        w.save()


def _worker_ddp(w: _Worker) -> None:
    """A DDP model over a plain group against one over a recorded group."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    args = w.args
    w.init_process_group()
    g_rec, g_plain = _recorded_and_plain_groups(args.world)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    gen = torch.Generator().manual_seed(1 + args.rank)
    x = torch.randn(32, 256, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    trainers = {}
    for name, group in (("plain", g_plain), ("tether", g_rec)):
        ddp = DDP(copy.deepcopy(model), process_group=group)
        trainers[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))

    def steps(trainer: tuple[Any, Any], n: int) -> float:
        """Milliseconds per training step, over ``n`` of them."""
        ddp, opt = trainer
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / n * 1e3

    for trainer in trainers.values():
        steps(trainer, args.warmup)
        w.beat()
    # How many collectives one step issues on the recorded group (tether's internals; optional).
    seq = getattr(getattr(g_rec, "_tether", None), "seq", None)
    w.result["ddp_ms"] = w.interleave(trainers, args.rounds, lambda t: steps(t, args.ops))
    seq_after = getattr(getattr(g_rec, "_tether", None), "seq", None)
    per_step = None
    if isinstance(seq, int) and isinstance(seq_after, int):
        per_step = (seq_after - seq) / (args.rounds * args.ops)
    w.result["params"] = sum(p.numel() for p in model.parameters())
    w.result["collectives_per_step"] = per_step
    w.save()


def _worker_native(w: _Worker) -> None:
    """all_reduce on the default group, with torch's recorder as the environment says."""
    import torch
    import torch.distributed as dist

    args = w.args
    w.init_process_group()
    tensor = torch.ones(SIZES["1 float"])
    group = dist.group.WORLD
    _time_ops(group, tensor, args.warmup)
    w.wait_for_partner()
    times = []
    for _ in range(args.rounds):
        times.append(_time_ops(group, tensor, args.ops))
        w.beat()
    w.result["times_us"] = times
    with contextlib.suppress(Exception):  # a private API; the count is only a sanity check
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        w.result["fr_entries"] = len(trace["entries"])
    w.save()


def _worker_main(args: argparse.Namespace) -> None:
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})  # before torch starts its threads
    w = _Worker(args)
    {"ops": _worker_ops, "ddp": _worker_ddp, "native": _worker_native}[args.worker](w)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """``world`` worker processes of one kind, with torch's recorder buffer set to ``fr``."""

    tag: str
    worker: str
    world: int
    fr: str
    flags: list[str]
    cpu: int | None = None
    partner: str | None = None
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per rank, what it saved (possibly partial)."""
    error: str | None = None


def _launch(tmp: str, jobs: list[_Job], stall_s: float) -> None:
    """Run the jobs' processes all at once. A job none of whose ranks shows progress for
    ``stall_s`` seconds is killed; each job keeps what its ranks saved, and its error."""
    d = Path(tmp)
    running: list[tuple[_Job, int, subprocess.Popen[bytes]]] = []
    for job in jobs:
        env = dict(os.environ)
        env["TORCH_FR_BUFFER_SIZE"] = job.fr
        env["TETHER_DUMP_DIR"] = str(d / "dumps")
        env.pop("TETHER_DUMP_ON_EXIT", None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        for rank in range(job.world):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", job.worker]
            cmd += ["--tmp", tmp, "--tag", job.tag, "--rank", str(rank), "--world", str(job.world)]
            if job.cpu is not None:
                cmd += ["--cpu", str(job.cpu)]
            if job.partner is not None:
                cmd += ["--partner", job.partner]
            (d / f"{job.tag}.rank{rank}.beat").touch()
            with open(d / f"{job.tag}.rank{rank}.log", "wb") as log:
                proc = subprocess.Popen(
                    [*cmd, *job.flags], env=env, stdout=log, stderr=log, cwd=REPO
                )
            running.append((job, rank, proc))
    while True:
        alive = [(job, rank, p) for job, rank, p in running if p.poll() is None]
        if not alive:
            break
        now = time.time()
        for job in {id(job): job for job, _, _ in alive}.values():
            beats = [(d / f"{job.tag}.rank{r}.beat").stat().st_mtime for r in range(job.world)]
            if now - max(beats) > stall_s:
                job.error = f"no progress for {stall_s:.0f} s: killed (a hang?)"
                for j, _, p in alive:
                    if j is job:
                        p.kill()
                        p.wait(10)
        time.sleep(0.2)
    for job, rank, proc in running:
        out = d / f"{job.tag}.rank{rank}.json"
        job.results.append(json.loads(out.read_text()) if out.exists() else {})
        if proc.returncode != 0 and job.error is None:
            job.error = f"rank {rank} exited with {proc.returncode}"
    for job in jobs:
        if job.error is not None:
            logs = "".join(
                f"--- rank {r}:\n" + (d / f"{job.tag}.rank{r}.log").read_text()[-1500:]
                for r in range(job.world)
            )
            job.error += "\n" + logs


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def _compare(base: list[float], other: list[float]) -> dict[str, float]:
    """``other`` against ``base``: medians, their difference, and per-round differences."""
    diffs = [y - x for x, y in zip(base, other, strict=True)]
    return {
        "base": _med(base),
        "other": _med(other),
        "added": _med(other) - _med(base),
        "paired": _med(diffs),
        "paired_iqr": _iqr(diffs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run; figures meaningless")
    p.add_argument("--rounds-w1", type=int, default=40, help="alternations, world 1")
    p.add_argument("--ops-w1", type=int, default=500, help="all_reduces per batch, world 1")
    p.add_argument("--rounds-w2", type=int, default=100, help="alternations, world 2")
    p.add_argument("--ops-w2", type=int, default=40, help="all_reduces per batch, world 2")
    p.add_argument("--native-pairs-w1", type=int, default=4, help="off/on process pairs, world 1")
    p.add_argument("--native-pairs-w2", type=int, default=3, help="off/on process pairs, world 2")
    p.add_argument("--ddp-rounds", type=int, default=300, help="alternations, DDP")
    p.add_argument("--ddp-steps", type=int, default=2, help="training steps per batch")
    p.add_argument("--stall-s", type=float, default=60, help="kill a job silent this long")
    # Worker side (the driver starts this script again with these).
    p.add_argument("--worker", choices=["ops", "ddp", "native"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    p.add_argument("--partner", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--ops", type=int, default=200, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=100, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.rounds_w1 = args.rounds_w2 = 2
        args.ops_w1, args.ops_w2 = 50, 20
        args.native_pairs_w1 = args.native_pairs_w2 = 1
        args.ddp_rounds, args.ddp_steps = 2, 3
    print(_run(args))


def _loadavg() -> float | None:
    """The 1-minute load average: how busy the machine was besides this benchmark."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _flags(rounds: int, ops: int, warmup: int) -> list[str]:
    return ["--rounds", str(rounds), "--ops", str(ops), "--warmup", str(warmup)]


def _run(args: argparse.Namespace) -> str:
    """Run every job, print the table; the summary JSON line."""
    started = time.monotonic()
    load_start = _loadavg()
    ops_w = {1: args.ops_w1, 2: args.ops_w2}
    rounds = {1: args.rounds_w1, 2: args.rounds_w2}
    native: dict[int, dict[str, list[float]]] = {w: {"0": [], "2000": []} for w in (1, 2)}
    fr_entries: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def run(jobs: list[_Job]) -> None:
        _launch(tmp, jobs, args.stall_s)
        for job in jobs:
            if job.error is not None:
                errors[job.tag] = job.error
                print(f"  {job.tag}: {job.error.splitlines()[0]}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        print("world size 1: plain vs tether all_reduce ...", flush=True)
        w1 = _Job("ops-w1", "ops", 1, "0", _flags(rounds[1], ops_w[1], 100))
        run([w1])
        print("world size 2: plain vs tether all_reduce ...", flush=True)
        w2 = _Job("ops-w2", "ops", 2, "0", _flags(rounds[2], ops_w[2], 100))
        run([w2])
        print("world size 2: DDP over a plain vs a recorded group ...", flush=True)
        ddp = _Job("ddp-w2", "ddp", 2, "0", _flags(args.ddp_rounds, args.ddp_steps, 20))
        run([ddp])
        # World 1: an "off" and an "on" process side by side, each pinned to its own CPU
        # (swapped every pair), so both see the same background load at the same time.
        print("world size 1: torch's recorder off and on, side by side ...", flush=True)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        for i in range(args.native_pairs_w1):
            pair = [
                _Job(f"native-w1-{i}-{fr}", "native", 1, fr, _flags(rounds[1], ops_w[1], 100))
                for fr in ("0", "2000")
            ]
            pair[0].partner, pair[1].partner = pair[1].tag, pair[0].tag
            if len(cpus) >= 2:
                pair[0].cpu, pair[1].cpu = cpus[i % 2], cpus[1 - i % 2]
            run(pair)
            for job in pair:
                if job.error is None:
                    native[1][job.fr].append(_med(job.results[0]["times_us"]))
                    fr_entries[job.fr] = job.results[0].get("fr_entries")
        # World 2 needs both CPUs for one job: "off" and "on" jobs alternate.
        print("world size 2: torch's recorder off and on, alternating ...", flush=True)
        for i in range(args.native_pairs_w2):
            pair = [
                _Job(
                    f"native-w2-{i}-{fr}",
                    "native",
                    2,
                    fr,
                    _flags(rounds[2] // 4 or 1, ops_w[2], 100),
                )
                for fr in ("0", "2000")
            ]
            for job in pair if i % 2 == 0 else pair[::-1]:
                run([job])
            if all(job.error is None for job in pair):
                for job in pair:
                    native[2][job.fr].append(_med(job.results[0]["times_us"]))

    import torch

    load_end = _loadavg()

    def compare(base: list[float] | None, other: list[float] | None) -> dict[str, float] | None:
        return _compare(base, other) if base and other else None

    def ops_of(job: _Job) -> dict[str, dict[str, float] | None]:
        got = job.results[0].get("ops", {})
        return {s: compare(*(got.get(s, {}).get(k) for k in ("plain", "tether"))) for s in SIZES}

    ops = {1: ops_of(w1), 2: ops_of(w2)}
    nat = {w: compare(native[w]["0"], native[w]["2000"]) for w in (1, 2)}
    ddp_res = ddp.results[0]
    step = compare(*(ddp_res.get("ddp_ms", {}).get(k) for k in ("plain", "tether")))

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, gloo over loopback,")
    print(f"{os.cpu_count()} CPUs, 1 intra-op thread per process; medians of alternating batches;")
    print(f"1-minute load average {load_start} at the start, {load_end} at the end")
    print()
    print("all_reduce, us/op          plain    tether   added   per-round diff: median, IQR")
    for world in (2, 1):
        for label, c in ops[world].items():
            if c is None:
                print(f"  world {world}, {label:8s}        -         -       -   (not measured)")
                continue
            print(
                f"  world {world}, {label:8s} {c['base']:8.1f}  {c['other']:8.1f}"
                f" {c['added']:+7.1f}   {c['paired']:+.1f}, {c['paired_iqr']:.1f}"
            )
    print(
        f"  ({rounds[2]} alternations of {ops_w[2]} ops (world 2),"
        f" {rounds[1]} of {ops_w[1]} ops (world 1))"
    )
    print()
    print("torch's C++ recorder, us/op  off        on   added   per-process medians")
    for world in (2, 1):
        c = nat[world]
        runs = "off " + " ".join(f"{v:.1f}" for v in native[world]["0"])
        runs += "; on " + " ".join(f"{v:.1f}" for v in native[world]["2000"])
        print(
            f"  world {world}, 1 float  {fmt(c and c['base'], '8.1f')}"
            f"  {fmt(c and c['other'], '8.1f')} {fmt(c and c['added'], '+7.1f')}   {runs}"
        )
    print(
        f"  (entries in torch's recorder after a run: on {fr_entries.get('2000')},"
        f" off {fr_entries.get('0')})"
    )
    print()
    pct = paired_pct = iqr_pct = None
    if step is not None:
        pct = step["added"] / step["base"] * 100
        paired_pct = step["paired"] / step["base"] * 100
        iqr_pct = step["paired_iqr"] / step["base"] * 100
    print("DDP step, ms               plain    tether   added   per-round diff: median, IQR")
    print(
        f"  world 2, MLP {fmt(ddp_res.get('params', 0) / 1e3, '.0f')}k"
        f" {fmt(step and step['base'], '7.3f')}  {fmt(step and step['other'], '8.3f')}"
        f" {fmt(pct, '+6.2f')}%   {fmt(paired_pct, '+.2f')}%, {fmt(iqr_pct, '.2f')}%"
    )
    print(
        f"  (batch 32, MLP 256-512-512-10, SGD; {args.ddp_rounds} alternations of"
        f" {args.ddp_steps} steps; recorded collectives per step:"
        f" {ddp_res.get('collectives_per_step')})"
    )
    if errors:
        print()
        for tag, error in errors.items():
            print(f"{tag}: {error}")
    print()

    def r(x: float | None, n: int = 2) -> float | None:
        return None if x is None else round(x, n)

    def get(c: dict[str, float] | None, key: str) -> float | None:
        return None if c is None else c[key]

    summary = {
        "tether_added_us_per_op": r(get(ops[2]["1 float"], "added")),
        "native_added_us_per_op": r(get(nat[2], "added")),
        "ddp_step_overhead_pct": r(pct),
        "world_size": 2,
        "plain_us_per_op": r(get(ops[2]["1 float"], "base")),
        "tether_us_per_op": r(get(ops[2]["1 float"], "other")),
        "tether_added_us_per_op_paired": r(get(ops[2]["1 float"], "paired")),
        "tether_added_us_per_op_1KiB": r(get(ops[2]["1 KiB"], "added")),
        "native_off_us_per_op": r(get(nat[2], "base")),
        "native_on_us_per_op": r(get(nat[2], "other")),
        "world1_plain_us_per_op": r(get(ops[1]["1 float"], "base")),
        "world1_tether_added_us_per_op": r(get(ops[1]["1 float"], "added")),
        "world1_tether_added_us_per_op_paired": r(get(ops[1]["1 float"], "paired")),
        "world1_tether_added_us_per_op_1KiB": r(get(ops[1]["1 KiB"], "added")),
        "world1_native_off_us_per_op": r(get(nat[1], "base")),
        "world1_native_added_us_per_op": r(get(nat[1], "added")),
        "ddp_plain_step_ms": r(get(step, "base"), 3),
        "ddp_tether_step_ms": r(get(step, "other"), 3),
        "ddp_step_overhead_pct_paired": r(paired_pct),
        "ddp_params": ddp_res.get("params"),
        "ddp_collectives_per_step": ddp_res.get("collectives_per_step"),
        "rounds": {"world1": rounds[1], "world2": rounds[2], "ddp": args.ddp_rounds},
        "ops_per_batch": {"world1": ops_w[1], "world2": ops_w[2], "ddp": args.ddp_steps},
        "cpus": os.cpu_count(),
        "loadavg_start_end": [load_start, load_end],
        "torch": torch.__version__,
        "quick": args.quick,
        "errors": {tag: e.splitlines()[0] for tag, e in errors.items()},
        "elapsed_s": r(time.monotonic() - started, 1),
    }
    return json.dumps(summary)


if __name__ == "__main__":
    main()
