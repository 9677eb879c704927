"""What recording costs per operation, on both issue paths, and on DDP steps.

Run from the repository root::

    python bench/recorder_overhead.py            # about 6-10 minutes on 2 cores
    python bench/recorder_overhead.py --quick    # a smoke run (< 2 minutes), figures meaningless

The first run compiles ``bench/csrc/bench_ops.cpp`` (30-90 s; cached under the temp dir).

Each comparison runs its variants in the *same* process, interleaved in short batches (the order
rotates every round, so each takes every position: cache warmth moves a figure by tens of %), and
reports what each adds over ``plain``:

- ``plain``     an unrecorded torch group
- ``floor``     a forward-only Python ``ProcessGroup`` subclass: what any Python-subclass recorder
                pays before recording anything (the pybind trampoline and the GIL on C++-issued ops)
- ``fallback``  tether's Python recorder (``TETHER_RECORDER=python``)
- ``native``    tether's native core (``TETHER_RECORDER=native``); null, with the reason, where it
                does not load
- ``torch FR``  torch's own flight recorder (gloo only), on a plain group of its own, switched on
                for its batches and off otherwise, in-process (all else runs with it off)

on these tests:

- ``Python API``    ``dist.all_reduce`` of 1 float from Python (user code, FSDP2)
- ``C++-issued``    a C++ loop calling ``pg->allreduce(...)->wait()`` with the GIL released, as
                    DDP's reducer and functional collectives issue ops
- ``busy thread``   the C++ loop while a Python thread spins: a recorder that needs the GIL per op
                    waits up to the switch interval (the mean over rounds, and the worst op)
- ``DDP``           17 small layers, ``bucket_cap_mb`` one layer's weight: the added cost per
                    collective; and at world size 2 the step overhead of a 400k-parameter MLP
                    (default buckets, 2 collectives per step) in % of the step

over a synchronous no-thread backend (``null``: works complete on the calling thread, so figures
resolve to ~0.1 us; world size 1) and over gloo (a worker thread per op: realistic, noisier; world
size 1, and 2 for DDP). Wall time and the issuing thread's CPU time are both reported. Also: the
ring-fill GC (cyclic collections while the first ``ring_size`` ops fill a fresh ring, against
plain, then over as many ops once it is full) and the watchdog thread's CPU in an idle process.

The headline JSON keys are for the null backend and the path a plain ``tether.install()`` takes
here (``default_path``: ``TETHER_RECORDER``, or native where the core loads): Python API
(``tether_added_us_per_op``), C++-issued (``cpp_path_added_us_per_op``), with a busy thread, DDP
per collective; then per path (``native_``/``fallback_``), the floor, torch's recorder, and gloo.

Each kind of process runs ``--reps`` times, fresh, for each tether path (plain, the floor and
torch's recorder are measured in both). Per process: the paired median of the per-round
differences against ``plain`` and their IQR; over processes: median [min..max] of those medians.
A job that stops making progress is killed after ``--stall-s`` seconds and reported under
"errors"; the figures it did not measure are null. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXT_NAME = "tether_bench_ops"
EXT_SOURCE = REPO / "bench" / "csrc" / "bench_ops.cpp"
NULL = "benchnull"
"""The synchronous test backend's registered name."""
PATHS = {"python": "fallback", "native": "native"}
"""TETHER_RECORDER of a worker -> the name of its tether variant."""
PATHS_OF = {variant: path for path, variant in PATHS.items()}
VARIANTS = ["floor", "fallback", "native", "torch_fr"]
LABELS = {
    "floor": "floor (forward-only Python subclass)",
    "fallback": "tether, Python recorder (fallback)",
    "native": "tether, native core",
    "torch_fr": "torch's flight recorder",
}
TESTS = {
    "python/null": "Python API, null backend, us/op",
    "python/gloo": "Python API, gloo (world 1), us/op",
    "cpp/null": "C++-issued (GIL released), null backend, us/op",
    "cpp/gloo": "C++-issued (GIL released), gloo (world 1), us/op",
    "busy/null": "C++-issued while a Python thread spins, null backend, us/op",
    "ddp/null": "DDP, 17 layers in 16 KiB buckets, null backend (world 1), us/collective",
    "ddp/gloo": "DDP, 17 layers in 16 KiB buckets, gloo (world 2), us/collective",
    "mlp/gloo": "DDP step, MLP 256-512-512-10, gloo (world 2), % of the step",
}
# (rounds, ops or steps per batch) of each test; interleaved variants share each round.
FULL = {
    "python/null": (300, 200),
    "python/gloo": (200, 100),
    "cpp/null": (300, 200),
    "cpp/gloo": (200, 100),
    "busy/null": (10, 200),
    "ddp/null": (80, 4),
    "ddp/gloo": (60, 3),
    "mlp/gloo": (150, 2),
}
QUICK = {test: (3, max(2, ops // 10)) for test, (_, ops) in FULL.items()}
MANY_LAYERS, MANY_WIDTH = 17, 64
"""The many-bucket model: each layer's weight (16 KiB) fills a bucket of MANY_CAP_MB."""
MANY_CAP_MB = 16 * 1024 / 2**20

# -- the C++ extension ----------------------------------------------------------------------


def _build_ext() -> str:
    """Compile (or reuse) the extension; its file's path."""
    import torch
    from torch.utils.cpp_extension import load

    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    build = Path(tempfile.gettempdir()) / f"tether-bench-ext-{tag}"
    build.mkdir(parents=True, exist_ok=True)
    module = load(EXT_NAME, [str(EXT_SOURCE)], build_directory=str(build), extra_cflags=["-O2"])
    return str(module.__file__)


def _import_ext(path: str | None) -> tuple[Any, str | None]:
    """The built extension (never compiled in a worker), or None and why not."""
    if not path:
        return None, "the C++ extension did not build"
    import torch  # noqa: F401  (its libraries first)

    spec = importlib.util.spec_from_file_location(EXT_NAME, path)
    if spec is None or spec.loader is None:
        return None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, None


# -- groups: plain, the floor, tether ---------------------------------------------------------

_FORWARDED = (
    "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "all_gather_single", "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "alltoall", "all_to_all_single", "barrier", "send", "recv",
    "recv_anysource", "_start_coalescing", "_end_coalescing",
)  # fmt: skip
"""The methods besides ``allreduce`` tether's Python recorder overrides; the floor forwards them."""


def _floor_class() -> type:
    """A Python ``ProcessGroup`` subclass that only forwards, to an inner plain group (as tether's
    Python recorder does: the base implementation would run with the GIL held)."""
    from torch._C._distributed_c10d import ProcessGroup

    class SameChecks(type(ProcessGroup)):  # type: ignore[misc]
        # torch checks isinstance(x, ProcessGroup) through the name this class stands in for.
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, ProcessGroup)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, ProcessGroup)

    def forward(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._inner, name)(*args, **kwargs)

        method.__name__ = name
        return method

    def both(name: str) -> Callable[..., None]:  # configuration torch applies to the group
        def method(self: Any, *args: Any) -> None:
            getattr(ProcessGroup, name)(self, *args)
            getattr(self._inner, name)(*args)

        return method

    def init(self: Any, store: Any, rank: int, size: int) -> None:
        ProcessGroup.__init__(self, rank, size)
        self._floor_store = store
        self._inner = ProcessGroup(store, rank, size)

    def allreduce(self: Any, *args: Any, **kwargs: Any) -> Any:  # the measured one: direct
        return self._inner.allreduce(*args, **kwargs)

    def set_device(self: Any, device: Any) -> None:
        ProcessGroup.bound_device_id.fset(self, device)  # type: ignore[attr-defined]
        self._inner.bound_device_id = device

    ns: dict[str, Any] = {name: forward(name) for name in _FORWARDED}
    ns.update({n: both(n) for n in ("_register_backend", "_set_default_backend")})
    ns.update({n: both(n) for n in ("_set_group_name", "_set_group_desc")})
    ns.update(__init__=init, allreduce=allreduce, get_group_store=lambda s: s._floor_store)
    ns["bound_device_id"] = property(lambda s: s._inner.bound_device_id, set_device)
    return SameChecks("FloorProcessGroup", (ProcessGroup,), ns)


@contextlib.contextmanager
def _constructing(cls: type) -> Iterator[None]:
    """Groups created meanwhile are instances of ``cls`` (torch builds each group through this
    module-level name; tether's Python recorder does the same)."""
    import torch.distributed.distributed_c10d as c10d

    saved = c10d.ProcessGroup
    c10d.ProcessGroup = cls  # type: ignore[misc]
    try:
        yield
    finally:
        c10d.ProcessGroup = saved  # type: ignore[misc]


def _variant_groups(world: int, path: str, backends: list[str]) -> tuple[dict, str | None]:
    """Per backend, {variant: group} over all ranks: plain, floor, tether's ``path`` (and for gloo
    a second plain group, for torch's recorder); the reason where tether's variant is missing."""
    import torch.distributed as dist

    import tether

    name = PATHS[path]
    what = "native core" if path == "native" else "Python recorder"
    ranks = list(range(world))
    error = None
    try:  # before any group: an unavailable native core fails here, loudly
        tether.install()
    except Exception as exc:
        error = f"{what} not available: {type(exc).__name__}: {exc}"
    tether.uninstall()
    out: dict[str, dict[str, Any]] = {b: {} for b in backends}
    for b in backends:
        out[b]["plain"] = dist.new_group(ranks, backend=b)
        if b == "gloo":  # torch's recorder, on a plain group (and a model) of its own
            out[b]["torch_fr"] = dist.new_group(ranks, backend=b)
    with _constructing(_floor_class()):
        for b in backends:
            out[b]["floor"] = dist.new_group(ranks, backend=b)
    if error is None:
        tether.install()
        try:
            for b in backends:
                out[b][name] = dist.new_group(ranks, backend=b)
        except Exception as exc:
            error = f"{what} failed to record a group: {type(exc).__name__}: {exc}"
        finally:
            tether.uninstall()
    if error is None:
        error = _check_recording(path, out)
    if error is not None:
        for groups in out.values():
            groups.pop(name, None)
    return out, error


def _check_recording(path: str, groups: dict[str, dict[str, Any]]) -> str | None:
    """That exactly tether's groups are recorded, by the path asked for."""
    from tether.recorder.group import is_recording
    from tether.runtime import current

    recorder = current()
    native = bool(getattr(recorder, "native", False))
    if path == "native" and not native:
        return "native core not available: tether recorded with its Python recorder"
    if path == "python" and native:
        return "TETHER_RECORDER=python, yet the native core recorded"
    for per_variant in groups.values():
        for variant, pg in per_variant.items():
            recorded = recorder.is_wrapped(pg) if native else is_recording(pg)  # type: ignore[union-attr]
            if recorded != (variant == PATHS[path]):
                return (
                    f"benchmark setup: the {variant} group is {'' if recorded else 'not '}recorded"
                )
    return None


def _register_null(ext: Any) -> None:
    """The null backend, as torch's ``backend="benchnull"``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        # A whole group, built through torch's name for the class (the floor's or tether's
        # Python subclass while they are being built), with the null backend in UCC's slot (on
        # CPU, unused otherwise; GLOO's is cast to ProcessGroupGloo by DDP's logger). Registered
        # as CUSTOM (what register_backend does with a bare backend) it would not be wrapped by
        # tether's native core: torch ignores a second backend of a type the group already has.
        pg = c10d.ProcessGroup(store, rank, size)
        slot = c10d.ProcessGroup.BackendType.UCC
        pg._set_default_backend(slot)
        pg._register_backend(torch.device("cpu"), slot, ext.NullBackend(rank, size))
        return pg

    dist.Backend.register_backend(NULL, create, devices=["cpu"])


def _fr_setup(ext: Any, group: Any) -> str | None:
    """Find torch's recorder, check the switch works on ``group`` (gloo), leave it off; or why
    it cannot be switched."""
    import torch
    import torch.distributed as dist

    if ext is None:
        return "the C++ extension did not build"
    t = torch.ones(1)
    dist.all_reduce(t, group=group)  # creates torch's recorder
    why = ext.fr_find()
    if why:
        return f"torch's recorder cannot be switched in-process: {why}"
    counts = []
    for on in (True, False):
        ext.fr_set(on)
        before = ext.fr_recorded()
        dist.all_reduce(t, group=group)
        counts.append(ext.fr_recorded() - before)
    ext.fr_set(False)
    if counts != [1, 0]:
        return f"switching torch's recorder had no effect (recorded {counts} for on, off)"
    return None


# -- workers (run as subprocesses of this script) ---------------------------------------------

Sample = tuple[float, float, float]
"""(wall, thread CPU, slowest single op) in microseconds, per op or per step."""
SERIES = ("wall", "cpu", "worst")
"""A Sample's names, in a worker's results."""


class _Worker:
    """One rank of a job: its store, its heartbeat and its (partial) results file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan: dict[str, list[int]] = json.loads(args.plan)
        self.dir = Path(args.tmp)
        self.name = f"{args.tag}.rank{args.rank}"
        self.result: dict[str, Any] = {"tests": {}, "path": args.path}
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

    def measure(self, test: str, variants: dict[str, Callable[[int], Sample]]) -> None:
        """Warm every variant, then run them in rounds, one batch each, the order rotating (so
        each takes every position equally: cache warmth moves a figure by tens of %)."""
        rounds, n = self.plan[test]
        names = list(variants)
        for name in names:
            variants[name](max(2, n // 4))
        self.beat()
        out: dict[str, dict[str, list[float]]] = {name: {k: [] for k in SERIES} for name in names}
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                for key, value in zip(SERIES, variants[name](n), strict=True):
                    out[name][key].append(value)
                self.beat()
        self.result["tests"][test] = out
        self.save()


def _py_loop(group: Any, tensor: Any, n: int) -> Sample:
    """``n`` blocking ``dist.all_reduce`` from Python."""
    import torch.distributed as dist

    all_reduce, clock, cpu = dist.all_reduce, time.perf_counter, time.thread_time
    c0, t0 = cpu(), clock()
    for _ in range(n):
        all_reduce(tensor, group=group)
    t1, c1 = clock(), cpu()
    return (t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6, 0.0


def _cpp_loop(ext: Any, group: Any, tensor: Any, n: int) -> Sample:
    """``n`` blocking allreduces issued from C++ with the GIL released."""
    wall, cpu, worst = ext.allreduce_loop(group, tensor, n)
    return wall / n / 1e3, cpu / n / 1e3, worst / 1e3


def _fr_variant(
    ext: Any, fr_error: str | None, variants: dict[str, Callable[[int], Sample]]
) -> dict[str, Callable[[int], Sample]]:
    """The ``torch_fr`` variant run with torch's recorder on (dropped where it cannot be)."""
    run = variants.pop("torch_fr", None)
    if run is None or fr_error is not None:
        return variants

    def on(n: int) -> Sample:
        ext.fr_set(True)
        try:
            return run(n)
        finally:
            ext.fr_set(False)

    return {**variants, "torch_fr": on}


@contextlib.contextmanager
def _spinning() -> Iterator[None]:
    """A Python thread spinning (holding the GIL but for the switch interval) meanwhile."""
    go = [True]

    def spin() -> None:
        while go[0]:
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        go[0] = False
        thread.join(10)


def _gc_windows(run: Callable[[int], Sample], n: int) -> dict[str, dict[str, float]]:
    """Cyclic-GC runs and their time over ``n`` ops, twice: while a fresh ring fills, then once
    it is full (old entries now freed as new ones come)."""
    gc.collect()
    return {window: _gc_window(run, n) for window in ("fill", "steady")}


def _gc_window(run: Callable[[int], Sample], n: int) -> dict[str, float]:
    stats = {"collections": 0, "full": 0, "gc_ms": 0.0}
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        stats["collections"] += 1
        stats["full"] += info.get("generation") == 2
        stats["gc_ms"] += (time.perf_counter() - started[0]) * 1e3

    gc.callbacks.append(callback)
    try:
        wall, _, _ = run(n)
    finally:
        gc.callbacks.remove(callback)
    return {**stats, "ms": wall * n / 1e3}


def _watchdog_cpu_pct(idle_s: float) -> float | None:
    """The watchdog thread's CPU over ``idle_s`` seconds of an idle process, in % of a core."""
    thread = next((t for t in threading.enumerate() if t.name == "tether-watchdog"), None)
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    clock = time.pthread_getcpuclockid(thread.ident)
    c0, t0 = time.clock_gettime(clock), time.monotonic()
    time.sleep(idle_s)
    return (time.clock_gettime(clock) - c0) / (time.monotonic() - t0) * 100


def _many_bucket_model() -> Any:
    from torch import nn

    layers: list[Any] = []
    for _ in range(MANY_LAYERS - 1):
        layers += [nn.Linear(MANY_WIDTH, MANY_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MANY_WIDTH, 10))


def _mlp_model() -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def _ddp_variants(
    groups: dict[str, Any], model: Any, inputs: int, batch: int, **ddp: Any
) -> dict[str, Callable[[int], Sample]]:
    """A DDP copy of ``model`` per group, each as a ``steps(n)`` timing a training step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(batch, inputs, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def trainer(group: Any) -> Callable[[int], Sample]:
        net = DDP(copy.deepcopy(model), process_group=group, **ddp)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def steps(n: int) -> Sample:
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(net(x), y).backward()
                opt.step()
            t1, c1 = time.perf_counter(), time.thread_time()
            return (t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6, 0.0

        return steps

    return {variant: trainer(group) for variant, group in groups.items()}


def _collectives_per_step(steps: Callable[[int], Sample], count: Callable[[], int]) -> float:
    steps(2)  # DDP rebuilds its buckets after the first step
    before = count()
    steps(4)
    return (count() - before) / 4


def _tether_count(group: Any) -> Callable[[], int]:
    """Collectives issued so far on a tether-recorded group, as tether counts them."""
    from tether.runtime import current

    recorded = current().groups[group.group_name]  # type: ignore[union-attr]
    return lambda: recorded.status()["last_enqueued_collective"]


def _worker_ops(w: _Worker) -> None:
    """World 1: every per-op test, DDP over the null backend, the ring-fill GC, the watchdog."""
    import torch

    import tether.runtime

    args = w.args
    ext, ext_error = _import_ext(args.ext)
    if ext is not None:
        _register_null(ext)
    w.init_process_group()
    backends = ["gloo"] + ([NULL] if ext is not None else [])
    groups, path_error = _variant_groups(1, args.path, backends)
    w.result.update(path_error=path_error, ext_error=ext_error)
    w.save()
    if path_error is not None and args.path == "native":
        return  # plain, floor and torch's recorder are measured in the other processes
    fr_error = _fr_setup(ext, groups["gloo"]["plain"])
    w.result["fr_error"] = fr_error
    tensor = torch.ones(1)
    ours = PATHS[args.path]
    first = groups[NULL if ext is not None else "gloo"]

    # First, while tether's ring is still empty: what filling it costs in cyclic GC.
    runtime = tether.runtime.active()
    ring = runtime.config.ring_size if runtime is not None else 2000
    if ours in first:
        w.result["gc"] = {
            v: _gc_windows(lambda n, g=first[v]: _py_loop(g, tensor, n), ring)
            for v in ("plain", ours)
        }
        w.result["gc_ops"] = ring
    w.beat()
    w.save()

    for backend, label in ((NULL, "null"), ("gloo", "gloo")):
        if backend not in groups:
            continue
        per = groups[backend]
        py = _fr_variant(ext, fr_error, {v: partial(_py_loop, g, tensor) for v, g in per.items()})
        w.measure(f"python/{label}", py)
        if ext is not None:
            cpp = {v: partial(_cpp_loop, ext, g, tensor) for v, g in per.items()}
            w.measure(f"cpp/{label}", _fr_variant(ext, fr_error, cpp))
            if backend == NULL:
                with _spinning():
                    w.measure("busy/null", cpp)

    if ext is not None:
        torch.manual_seed(0)
        null, model = groups[NULL], _many_bucket_model()
        ddp = _ddp_variants(null, model, MANY_WIDTH, 8, bucket_cap_mb=MANY_CAP_MB)
        backend = null["plain"]._get_backend(torch.device("cpu"))
        w.result["collectives_per_step"] = {
            "ddp/null": _collectives_per_step(ddp["plain"], backend.calls)
        }
        w.result["params"] = {"ddp/null": sum(p.numel() for p in model.parameters())}
        w.measure("ddp/null", ddp)

    if runtime is not None:
        w.result["watchdog_cpu_pct"] = _watchdog_cpu_pct(w.plan["idle_s"][0])
    w.save()


def _worker_ddp(w: _Worker) -> None:
    """World 2 over gloo: DDP with many small buckets, and the MLP step."""
    import torch

    args = w.args
    ext, ext_error = _import_ext(args.ext)
    w.init_process_group()
    all_groups, path_error = _variant_groups(args.world, args.path, ["gloo"])
    groups = all_groups["gloo"]
    w.result.update(path_error=path_error, ext_error=ext_error)
    w.save()
    if path_error is not None and args.path == "native":
        return
    fr_error = _fr_setup(ext, groups["plain"])
    w.result["fr_error"] = fr_error
    counts: dict[str, float] = {}
    w.result["collectives_per_step"] = counts
    torch.manual_seed(0)
    configs = {
        "ddp/gloo": (_many_bucket_model(), MANY_WIDTH, 8, {"bucket_cap_mb": MANY_CAP_MB}),
        "mlp/gloo": (_mlp_model(), 256, 32, {}),
    }
    for test, (model, inputs, batch, kwargs) in configs.items():
        ddp = _fr_variant(ext, fr_error, _ddp_variants(groups, model, inputs, batch, **kwargs))
        w.beat()
        if fr_error is None:
            counts[test] = _collectives_per_step(ddp["torch_fr"], ext.fr_recorded)
        elif PATHS[args.path] in groups:
            ours = PATHS[args.path]
            counts[test] = _collectives_per_step(ddp[ours], _tether_count(groups[ours]))
        w.result.setdefault("params", {})[test] = sum(p.numel() for p in model.parameters())
        w.measure(test, ddp)


def _worker_main(args: argparse.Namespace) -> None:
    w = _Worker(args)
    {"ops": _worker_ops, "ddp": _worker_ddp}[args.worker](w)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    """``world`` worker processes of one kind, recording with tether's ``path``."""

    tag: str
    worker: str
    world: int
    path: str
    flags: list[str]
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per rank, what it saved (possibly partial)."""
    error: str | None = None


def _launch(tmp: str, job: _Job, stall_s: float) -> None:
    """Run the job's processes. A job none of whose ranks shows progress for ``stall_s`` seconds
    is killed; it keeps what its ranks saved, and its error."""
    d = Path(tmp)
    env = dict(os.environ)
    env["TETHER_RECORDER"] = job.path
    env["TORCH_FR_BUFFER_SIZE"] = "2000"  # torch's default; switched off in-process
    env["TETHER_DUMP_DIR"] = str(d / "dumps")
    env.pop("TETHER_DUMP_ON_EXIT", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(job.world):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", job.worker]
        cmd += ["--tmp", tmp, "--tag", job.tag, "--rank", str(rank), "--world", str(job.world)]
        cmd += ["--path", job.path, *job.flags]
        (d / f"{job.tag}.rank{rank}.beat").touch()
        with open(d / f"{job.tag}.rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=REPO))
    while any(p.poll() is None for p in procs):
        beats = [(d / f"{job.tag}.rank{r}.beat").stat().st_mtime for r in range(job.world)]
        if time.time() - max(beats) > stall_s:
            job.error = f"no progress for {stall_s:.0f} s: killed (a hang?)"
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        time.sleep(0.2)
    for rank, proc in enumerate(procs):
        out = d / f"{job.tag}.rank{rank}.json"
        job.results.append(json.loads(out.read_text()) if out.exists() else {})
        if proc.returncode != 0 and job.error is None:
            job.error = f"rank {rank} exited with {proc.returncode}"
    # Not what measure() writes (a worker's heap corrupted, as a refcount bug in a recorder
    # does): reported, and kept out of the figures.
    tests = job.results[0].get("tests", {})
    for test, variants in list(tests.items()):
        bad = {v: sorted(map(str, x)) for v, x in variants.items() if set(x) != set(SERIES)}
        if bad or "plain" not in variants:
            del tests[test]
            why = f"malformed result for {test}: {bad or 'no plain'}"
            job.error = f"{job.error}; {why}" if job.error else why
    if job.error is not None:
        job.error += "\n" + "".join(
            f"--- rank {r}:\n" + (d / f"{job.tag}.rank{r}.log").read_text()[-1500:]
            for r in range(job.world)
        )


def _last_words(error: str) -> str:
    """What a failed job's error says: its first line, and its log's last non-empty line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    tail = [line for line in lines[1:] if not line.startswith("--- rank")]
    return lines[0] + (f" ({tail[-1]})" if tail else "")


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def _rounded(x: Any, n: int = 2) -> Any:
    if isinstance(x, float):
        return round(x, n)
    if isinstance(x, dict):
        return {k: _rounded(v, n) for k, v in x.items()}
    return x


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def _aggregate(jobs: list[_Job]) -> dict[str, dict[str, Any]]:
    """Per test and variant, over processes: the plain level, and the added wall and CPU (per
    collective for DDP, % of the step for the MLP)."""
    per: dict[str, dict[str, dict[str, list[float]]]] = {}
    for job in jobs:
        res = job.results[0] if job.results else {}
        counts = res.get("collectives_per_step") or {}
        for test, variants in res.get("tests", {}).items():
            plain = variants.get("plain")
            if not plain:
                continue
            slot = per.setdefault(test, {})
            base = statistics.median(plain["wall"])
            slot.setdefault("plain", {"level": []})["level"].append(base)
            scale = 1.0  # added us per op or step -> the figure reported
            if test.startswith("ddp/"):
                n = counts.get(test)
                if not n:
                    continue
                scale = 1 / n
            elif test.startswith("mlp/"):
                scale = 100 / base
            # With a busy thread the stalls are the point: the mean, not the median, of rounds.
            center = statistics.fmean if test.startswith("busy/") else statistics.median
            for variant, series in variants.items():
                if variant == "plain":
                    continue
                s = slot.setdefault(variant, {k: [] for k in ("wall", "cpu", "iqr", "worst")})
                for key in ("wall", "cpu"):
                    diffs = [(y - x) * scale for x, y in zip(plain[key], series[key], strict=True)]
                    s[key].append(center(diffs))
                    if key == "wall":
                        s["iqr"].append(_iqr(diffs))
                s["worst"].append(max(series["worst"]))
    out: dict[str, dict[str, Any]] = {}
    for test, variants in per.items():
        out[test] = {"plain": _spread(variants.pop("plain")["level"])}
        for variant, s in variants.items():
            out[test][variant] = {
                "added": _spread(s["wall"]),
                "cpu_added": _spread(s["cpu"]),
                "iqr": statistics.median(s["iqr"]),
                "worst_us": max(s["worst"]),
                "processes": len(s["wall"]),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run; figures meaningless")
    p.add_argument("--reps", type=int, default=3, help="fresh processes of each kind")
    p.add_argument("--stall-s", type=float, default=90, help="kill a job silent this long")
    p.add_argument("--build-timeout-s", type=float, default=600, help="limit on compiling")
    # Worker side (the driver starts this script again with these).
    p.add_argument("--worker", choices=["ops", "ddp", "build"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--path", choices=list(PATHS), help=argparse.SUPPRESS)
    p.add_argument("--ext", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "build":
        print(_build_ext())
        return
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.reps = 1
    print(_run(args))


def _loadavg() -> float | None:
    """The 1-minute load average: how busy the machine was besides this benchmark."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _build(timeout_s: float) -> tuple[str | None, str | None]:
    """The extension's path, built in a subprocess (bounded); or None and why."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "build"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None, f"compiling {EXT_SOURCE.name} took over {timeout_s:g} s: killed"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).exists():
        return None, f"compiling {EXT_SOURCE.name} failed:\n{done.stderr[-3000:]}"
    return lines[-1], None


def _run(args: argparse.Namespace) -> str:
    """Run every job, print the table; the summary JSON line."""
    started = time.monotonic()
    load_start = _loadavg()
    plan: dict[str, Any] = {k: list(v) for k, v in (QUICK if args.quick else FULL).items()}
    plan["idle_s"] = [0.5 if args.quick else 2.0]
    errors: dict[str, str] = {}
    print(f"building {EXT_SOURCE.relative_to(REPO)} (cached after the first run) ...", flush=True)
    ext, ext_error = _build(args.build_timeout_s)
    if ext_error is not None:
        errors["build"] = ext_error
        print(f"  {ext_error.splitlines()[0]}", flush=True)
    flags = ["--plan", json.dumps(plan)] + (["--ext", ext] if ext else [])
    jobs: dict[str, dict[str, list[_Job]]] = {"ops": {}, "ddp": {}}
    unavailable: dict[str, str] = {}  # path -> why it was not measured

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for rep in range(args.reps):
            order = list(PATHS) if rep % 2 == 0 else list(PATHS)[::-1]
            for kind, world in (("ops", 1), ("ddp", 2)):
                for path in order:
                    if path in unavailable:
                        continue
                    tag = f"{kind}-{path}-{rep}"
                    print(f"[{rep + 1}/{args.reps}] {tag} (world {world}) ...", flush=True)
                    job = _Job(tag, kind, world, path, flags)
                    _launch(tmp, job, args.stall_s)
                    why = (job.results[0] if job.results else {}).get("path_error")
                    if why and path == "native":
                        unavailable[path] = why
                        print(f"  {why}", flush=True)
                    if job.error is not None:
                        errors[tag] = job.error
                        print(f"  {tag}: {_last_words(job.error)}", flush=True)
                    jobs[kind].setdefault(path, []).append(job)

    import torch

    load_end = _loadavg()
    every = [j for kind in jobs.values() for js in kind.values() for j in js]
    figures = _aggregate(every)
    # What a plain tether.install() records with here: TETHER_RECORDER, or "auto" (native where
    # the core loads). The jobs themselves ask for each path explicitly.
    default = os.environ.get("TETHER_RECORDER") or "auto"
    if default == "auto":
        default = "python" if "native" in unavailable else "native"
    first = {  # the first process's reason, where torch's recorder or the extension failed
        key: next((j.results[0][key] for j in every if j.results and key in j.results[0]), None)
        for key in ("fr_error", "ext_error")
    }
    gc_by, watchdog = {}, {}
    for path, js in jobs["ops"].items():
        for j in js:
            res = j.results[0] if j.results else {}
            if "gc" in res:
                gc_by.setdefault("plain", []).append(res["gc"]["plain"])
                gc_by.setdefault(PATHS[path], []).append(res["gc"][PATHS[path]])
            if res.get("watchdog_cpu_pct") is not None:
                watchdog.setdefault(PATHS[path], []).append(res["watchdog_cpu_pct"])
    counts: dict[str, float] = {}
    params: dict[str, int] = {}
    for j in every:
        res = j.results[0] if j.results else {}
        counts.update({k: v for k, v in (res.get("collectives_per_step") or {}).items() if v})
        params.update(res.get("params") or {})

    def why_missing(variant: str, test: str) -> str:
        if variant == "native" and "native" in unavailable:
            return unavailable["native"]
        if variant == "torch_fr" and "null" in test:
            return "gloo's own recorder: not on the null backend"
        if variant == "torch_fr" and first["fr_error"]:
            return first["fr_error"]
        if (test.split("/")[0] in ("cpp", "busy") or "null" in test) and first["ext_error"]:
            return first["ext_error"]
        kind = (
            "ops"
            if test.split("/")[0] in ("python", "cpp", "busy") or test == "ddp/null"
            else "ddp"
        )
        failed = [t for t in errors if t.startswith(f"{kind}-{PATHS_OF.get(variant, '')}")]
        if failed:  # the process that would have measured it died (see "errors")
            return f"{failed[0]} failed: {_last_words(errors[failed[0]])}"
        return "not measured"

    _print_table(figures, counts, params, plan, args, why_missing, (load_start, load_end))

    def r(x: float | None, n: int = 2) -> float | None:
        return None if x is None else round(x, n)

    def get(test: str, variant: str, key: str = "added") -> float | None:
        got = figures.get(test, {}).get(variant)
        spread = got and got.get(key)
        return r(spread["median"]) if spread else None

    ours = PATHS[default]
    mlp_plain = figures.get("mlp/gloo", {}).get("plain")
    per_coll = get("ddp/gloo", ours)
    computed = None  # the MLP's step %, from the many-bucket cost per collective (same backend)
    if mlp_plain and per_coll is not None and counts.get("mlp/gloo"):
        computed = counts["mlp/gloo"] * per_coll / mlp_plain["median"] * 100
    mlp = figures.get("mlp/gloo", {}).get(ours) or {}
    gc_ops = next((j.results[0]["gc_ops"] for j in every if "gc_ops" in j.results[0]), None)
    _print_tails(gc_by, gc_ops, watchdog)
    if computed is not None:
        print(
            f"DDP step of the MLP, computed ({default} path): {counts['mlp/gloo']:g} collectives x"
            f" {per_coll:+.1f} us / {mlp_plain['median'] / 1e3:.2f} ms = {computed:+.3f} %"
        )
    if errors:
        print()
        for tag, error in errors.items():
            print(f"{tag}: {error}")
    print()
    summary = {
        "tether_added_us_per_op": get("python/null", ours),
        "cpp_path_added_us_per_op": get("cpp/null", ours),
        "ddp_added_us_per_collective": get("ddp/null", ours),
        "busy_thread_added_us_per_op": get("busy/null", ours),
        "native_added_us_per_op": get("python/null", "native"),
        "fallback_added_us_per_op": get("python/null", "fallback"),
        "ddp_step_overhead_pct": get("mlp/gloo", ours),
        "ddp_step_overhead_pct_iqr": r(mlp.get("iqr")),
        "ddp_step_overhead_pct_computed": r(computed, 3),
        "default_path": default,
        "native_unavailable": unavailable.get("native"),
        "floor_added_us_per_op": get("python/null", "floor"),
        "floor_cpp_added_us_per_op": get("cpp/null", "floor"),
        "floor_ddp_added_us_per_collective": get("ddp/null", "floor"),
        "torch_fr_added_us_per_op": get("python/gloo", "torch_fr"),
        "torch_fr_cpp_added_us_per_op": get("cpp/gloo", "torch_fr"),
        "torch_fr_ddp_added_us_per_collective": get("ddp/gloo", "torch_fr"),
        "tether_added_us_per_op_gloo": get("python/gloo", ours),
        "cpp_path_added_us_per_op_gloo": get("cpp/gloo", ours),
        "ddp_added_us_per_collective_gloo": per_coll,
        "tether_added_cpu_us_per_op": get("python/null", ours, "cpu_added"),
        "cpp_path_added_cpu_us_per_op": get("cpp/null", ours, "cpu_added"),
        "cpp_path_native_added_us_per_op": get("cpp/null", "native"),
        "cpp_path_fallback_added_us_per_op": get("cpp/null", "fallback"),
        "busy_thread_worst_op_us": {
            v: r(figures.get("busy/null", {}).get(v, {}).get("worst_us"), 0)
            for v in ("floor", "fallback", "native")
        },
        "plain_us_per_op": {t: r((f.get("plain") or {}).get("median")) for t, f in figures.items()},
        "figures": _rounded(figures),
        "ring_fill_gc": {
            v: {
                w: {k: r(statistics.median(x[w][k] for x in runs)) for k in runs[0][w]}
                for w in ("fill", "steady")
            }
            for v, runs in gc_by.items()
        },
        "watchdog_cpu_pct": {v: r(statistics.median(x), 3) for v, x in watchdog.items()},
        "collectives_per_step": counts,
        "ddp_params": params,
        "processes": {k: {p: len(js) for p, js in kind.items()} for k, kind in jobs.items()},
        "plan": plan,
        "cpus": os.cpu_count(),
        "loadavg_start_end": [load_start, load_end],
        "torch": torch.__version__,
        "quick": args.quick,
        "errors": {tag: _last_words(e) for tag, e in errors.items()},
        "elapsed_s": r(time.monotonic() - started, 1),
    }
    return json.dumps(summary)


def _print_table(
    figures: dict[str, dict[str, Any]],
    counts: dict[str, float],
    params: dict[str, int],
    plan: dict[str, Any],
    args: argparse.Namespace,
    why_missing: Callable[[str, str], str],
    load: tuple[float | None, float | None],
) -> None:
    import torch

    def f(x: float | None, spec: str = "+.2f") -> str:
        return "-" if x is None else format(x, spec)

    def spread(s: dict[str, float] | None, spec: str = "+.2f") -> str:
        if s is None:
            return "-"
        return f"{f(s['median'], spec)} [{f(s['min'], spec)}..{f(s['max'], spec)}]"

    print()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs,")
    print(f"1 intra-op thread per process; 1-minute load average {load[0]} -> {load[1]}")
    print(f"{args.reps} fresh process(es) per kind and tether path, each interleaving plain, the")
    print("floor, its tether path and torch's recorder; added over plain: median over processes")
    print("[min..max] of each one's paired median (busy thread: mean); IQR: median of the IQRs")
    for test, title in TESTS.items():
        got = figures.get(test, {})
        plain = got.get("plain")
        rounds, n = plan[test]
        unit = "steps" if test.split("/")[0] in ("ddp", "mlp") else "ops"
        print()
        level = "-" if plain is None else spread(plain, ".2f")
        what = "us/step" if unit == "steps" else "us/op"
        print(f"{title}   (plain {level} {what}; {rounds} rounds of {n} {unit})")
        if test in counts:
            print(f"  {counts[test]:g} collectives per step, {params.get(test, '?')} parameters")
        print(f"  {'variant':40s} {'wall added':>24s} {'IQR':>6s} {'thread CPU added':>24s}")
        for variant in VARIANTS:
            s = got.get(variant)
            if s is None:
                print(f"  {LABELS[variant]:40s} n/a: {why_missing(variant, test)[:70]}")
                continue
            worst = f"   worst op {s['worst_us'] / 1e3:.1f} ms" if test == "busy/null" else ""
            print(
                f"  {LABELS[variant]:40s} {spread(s['added']):>24s} {f(s['iqr'], '.2f'):>6s}"
                f" {spread(s['cpu_added']):>24s}{worst}"
            )
    print()


def _print_tails(
    gc_by: dict[str, list[dict[str, Any]]], ops: int | None, watchdog: dict[str, list[float]]
) -> None:
    """The one-time and background costs: the ring-fill GC, the watchdog."""
    if gc_by:
        print(f"ring-fill GC: {ops} Python-API ops on the null backend into a fresh ring, then")
        print("as many once it is full (median over processes)")
        print(
            f"  {'':10s} {'fill: runs':>10s} {'full':>5s} {'GC ms':>7s} {'ms':>7s}"
            f"   {'full: runs':>10s} {'full':>5s} {'GC ms':>7s} {'ms':>7s}"
        )
        for v, runs in gc_by.items():
            cells = []
            for window in ("fill", "steady"):
                m = {k: statistics.median(x[window][k] for x in runs) for k in runs[0][window]}
                cells.append(
                    f"{m['collections']:10.0f} {m['full']:5.0f} {m['gc_ms']:7.1f} {m['ms']:7.1f}"
                )
            print(f"  {v:10s} {cells[0]}   {cells[1]}")
    for v, xs in watchdog.items():
        print(f"watchdog thread, idle process ({v}): {statistics.median(xs):.3f} % of a core")


if __name__ == "__main__":
    main()
