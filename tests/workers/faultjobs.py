"""The fault corpus: faults users really have, each a real ``tether run`` job.

:data:`JOBS` is the table: a name, the class of fault, the job's size, the rank(s) at fault,
and what the diagnosis must say (verdict, operation, the culprit's line: a ``# MARK`` comment
in this file, see :func:`line_of`). Each class has several jobs that differ in world size,
which rank misbehaves, the operation, the dtype and the group, so that a fix that fits one
example fails the others.

A job is run as::

  tether run --standalone --nproc-per-node=N --hang-timeout=H --debug-port=off \\
      --monitor-interval=0.5 --dump-dir=D faultjobs.py --job NAME --sync S

:func:`run_jobs` does that for any set of jobs, a few at once, and returns what each left
(exit code, log, event, whether a rank's child outlived it): the test
(tests/analyze/test_fault_corpus_integ.py) and the benchmark (bench/diagnosis.py) share it.

Every rank writes ``S/pid_<rank>`` (its pid) once it runs and ``S/ready_<rank>`` after its
warm-up; a job whose table entry has an ``action`` waits for the runner to do it (SIGTERM to
``tether run``) once every rank is ready. Stuck ranks wait :data:`HOLD_S`: the job's abort
must end them long before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[2]
FRAMEWORK_SITE = SCRIPT.parent / "fault_site" / "site-packages"
"""Where the stand-in training framework lives (tests/workers/fault_site/site-packages)."""
WARMUP = 3
"""World all_reduces every rank runs first (sequence numbers 1..3): a matched history."""
HOLD_S = 120.0
"""How long a stuck rank waits; the hang's abort must end it first."""
HEALTHY_LIMIT_S = 90.0
"""A job waiting for the runner's SIGTERM gives up after this long (exit 3)."""
NOT_STOPPED_EXIT = 3
LATE_S = 1.5
"""How long past the hang timeout a late rank holds the GIL before joining the collective."""
HANG_EXIT_CODE = 75  # EX_TEMPFAIL: tether.watchdog.responder.HANG_EXIT_CODE, the README's


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a job's fault function knows about its rank."""

    job: FaultJob
    rank: int
    world_size: int
    sync: Path

    @property
    def is_culprit(self) -> bool:
        return self.rank in self.job.culprits

    @property
    def hang_timeout(self) -> float:
        return self.job.hang_timeout


@dataclasses.dataclass(frozen=True)
class FaultJob:
    cls: str
    """The class: backend-abort, dead-rank, stuck-c, busy-groups, real-code, exception, left."""
    world_size: int
    culprits: tuple[int, ...]
    """The rank(s) at fault; () when none is."""
    verdict: str
    reason: str
    """The event's reason: hang (the watchdog's alarm), crash (a rank died: the launcher's
    alarm), signal (the launcher was stopped by a signal); ``crash|hang`` where the backend
    decides which comes first."""
    fault: Callable[[Ctx], None] | None
    """What every rank does after the warm-up; None for a job of another script (``argv``)."""
    what: str
    """What is injected, in one line (the README of the events, the benchmark's table)."""
    op: str | None = None
    """The operation the diagnosis names, where it is certain."""
    marker: str | tuple[str, ...] | None = None
    """The ``# MARK`` of the culprit's line in this file (one of them, where a tuple)."""
    victims: tuple[int, ...] = ()
    """Ranks the backend kills as a consequence of the culprit's fault."""
    sides: tuple[str, str] | None = None
    """A desync's two sides as the evidence shows them (the culprit's sizes/dtypes, the
    others')."""
    group: str | None = "default_pg"
    """The desc of the process group the diagnosis names; None where it does not matter."""
    hang_timeout: float = 3.0
    action: str | None = None
    """``sigterm``: the runner sends SIGTERM to ``tether run`` once every rank is ready."""
    exit_code: int | None = None
    """``tether run``'s exit code, where the issue fixes it."""
    stacks: str | None = None
    """The method of the culprit's ``stacks_<r>.txt``, where the issue fixes it."""
    child: bool = False
    """The culprit runs a child process that must not outlive the job."""
    ends_fast: bool = False
    """The job must end long before the old timers (a 30 s abort grace, torchrun's 30 s)."""
    backward_frame: bool = False
    """The waiting ranks' in-flight collective keeps the job's ``loss.backward()`` line in its
    recorded frames, at the default depth."""
    argv: tuple[str, ...] = ()
    """The script and its arguments, for a job that is not one of this file's."""
    exception: str | None = None
    """What the culprit died of, as the diagnosis says it (``ValueError: bad batch``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables set for ``tether run`` (and so its workers)."""
    flags: tuple[str, ...] = ()
    """``tether run`` options beyond the runner's own."""
    before_init: bool = False
    """The fault runs before ``init_process_group`` (and every rank but the culprit then
    creates the default group)."""


def reasons(job: FaultJob) -> tuple[str, ...]:
    return tuple(job.reason.split("|"))


def line_of(marker: str) -> int:
    """The line of this file holding ``# MARK`` ``marker``."""
    tag = f"# MARK {marker}"
    lines = [
        i
        for i, text in enumerate(SCRIPT.read_text().splitlines(), 1)
        if text.rstrip().endswith(tag)
    ]
    if len(lines) != 1:
        raise ValueError(f"marker {marker!r} is on lines {lines}, expected one")
    return lines[0]


def step_tensor() -> torch.Tensor:
    return torch.ones(8)


def hold() -> None:
    time.sleep(HOLD_S)  # MARK hold


def libc() -> ctypes.PyDLL:
    """libc through PyDLL: its calls keep the GIL, as C extensions that do not release it do."""
    return ctypes.PyDLL(None)


# -- 1. a desync that makes gloo abort a rank -----------------------------------------------
# Found empirically (torch 2.13, gloo over TCP): a rank that receives more bytes than it
# expects is aborted by gloo (EnforceNotMet "Received data size doesn't match expected size"
# -> terminate -> SIGABRT); the others then fail with "Connection reset by peer". In a ring
# all_reduce or reduce_scatter that is the odd rank's predecessor (odd - 1), in an all_gather
# its successor (odd + 1). On 4 ranks the survivors' dumps hold a 2:1 majority.


def _mismatched(ctx: Ctx, kind: str, numel: int = 8) -> torch.Tensor:
    if not ctx.is_culprit:
        return torch.ones(numel)
    if kind == "size":
        return torch.ones(2 * numel)
    return torch.ones(numel, dtype=torch.float64)


def abort_all_reduce(kind: str, group_desc: str | None = None) -> Callable[[Ctx], None]:
    def fault(ctx: Ctx) -> None:
        group = None
        if group_desc is not None:
            group = dist.new_group(list(range(ctx.world_size)), group_desc=group_desc)
            dist.all_reduce(step_tensor(), group=group)
        dist.all_reduce(_mismatched(ctx, kind), group=group)  # MARK abort-all_reduce
        dist.all_reduce(step_tensor())

    return fault


def ran_on_past_all_reduce(kind: str) -> Callable[[Ctx], None]:
    """Every rank starts an asynchronous all_reduce, the culprit's of the wrong size or dtype,
    and runs its own code on before waiting: where a rank is at the dump is not where it issued
    the mismatched call."""

    def fault(ctx: Ctx) -> None:
        work = dist.all_reduce(_mismatched(ctx, kind), async_op=True)  # MARK ahead-all_reduce
        model, opt = ddp_model()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        assert work is not None
        work.wait()
        dist.all_reduce(step_tensor())

    return fault


def abort_all_gather(kind: str, into_tensor: bool) -> Callable[[Ctx], None]:
    def fault(ctx: Ctx) -> None:
        t = _mismatched(ctx, kind)
        if into_tensor:
            out = torch.zeros(t.numel() * ctx.world_size, dtype=t.dtype)
            dist.all_gather_into_tensor(out, t)  # MARK abort-all_gather_into_tensor
        else:
            outs = [torch.zeros_like(t) for _ in range(ctx.world_size)]
            dist.all_gather(outs, t)  # MARK abort-all_gather
        dist.all_reduce(step_tensor())

    return fault


def abort_reduce_scatter(ctx: Ctx) -> None:
    n = 16 if ctx.is_culprit else 8
    dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(n * ctx.world_size))  # MARK abort-rs
    dist.all_reduce(step_tensor())


# -- 2. a dead rank -------------------------------------------------------------------------

DEATH_STEP = 2


def die_in_loop(how: str) -> Callable[[Ctx], None]:
    def fault(ctx: Ctx) -> None:
        for step in range(DEATH_STEP + 3):
            if ctx.is_culprit and step == DEATH_STEP:
                if how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)  # MARK dead-sigkill
                elif how == "sigsegv":
                    ctypes.string_at(0)  # MARK dead-sigsegv
                else:
                    os.abort()  # MARK dead-sigabrt
            dist.all_reduce(step_tensor())

    return fault


def die_in_pair_group(ctx: Ctx) -> None:
    """Ranks 1 and 2 all_reduce in their pair group in a loop while the others wait in a world
    all_reduce; the culprit (2) is SIGKILLed at step 2 of the pair's loop."""
    pair = dist.new_group([1, 2], group_desc="pair12")
    if ctx.rank in (1, 2):
        for step in range(DEATH_STEP + 3):
            if ctx.is_culprit and step == DEATH_STEP:
                os.kill(os.getpid(), signal.SIGKILL)  # MARK dead-in-pair
            dist.all_reduce(step_tensor(), group=pair)
    dist.all_reduce(step_tensor())


# -- 3. stuck C code ------------------------------------------------------------------------


def stuck_in(how: str) -> Callable[[Ctx], None]:
    def fault(ctx: Ctx) -> None:
        if ctx.is_culprit:
            if how == "gil-sleep":  # sleep(3) returns early on a signal: no retry on EINTR
                libc().sleep(int(HOLD_S))  # MARK stuck-gil-sleep
            elif how == "gil-poll":
                libc().poll(None, 0, int(HOLD_S * 1000))  # MARK stuck-gil-poll
            elif how == "gil-read":  # a pipe nobody writes
                rfd, _wfd = os.pipe()
                libc().read(rfd, ctypes.create_string_buffer(1), 1)  # MARK stuck-gil-read
            else:  # time.sleep retries after a signal, and releases the GIL
                time.sleep(HOLD_S)  # MARK stuck-sleep
        dist.all_reduce(step_tensor())

    return fault


# -- 4. busy side groups, a late arrival ----------------------------------------------------


def _side_loop(group: dist.ProcessGroup, stop: threading.Event) -> None:
    t = torch.ones(4)
    while not stop.is_set():
        try:
            dist.all_reduce(t, group=group)
        except Exception:  # the job's abort broke the group: this thread is done
            return
        time.sleep(0.002)  # busy, yet leaving the two cores some room


def busy_side_groups(pairs: tuple[tuple[int, ...], ...]) -> Callable[[Ctx], None]:
    """Every rank of ``pairs`` drives its side group from a thread while the main threads run
    world all_reduces; the culprit stops before one of them."""

    def fault(ctx: Ctx) -> None:
        groups = [dist.new_group(list(p), group_desc=f"side{i}") for i, p in enumerate(pairs)]
        mine = [g for g, p in zip(groups, pairs, strict=True) if ctx.rank in p]
        stop = threading.Event()
        for group in mine:
            threading.Thread(
                target=_side_loop, args=(group, stop), name="side-group", daemon=True
            ).start()
        for _ in range(3):  # world ops while the side groups run
            dist.all_reduce(step_tensor())
        if ctx.is_culprit:
            time.sleep(HOLD_S)  # MARK busy-hold
        dist.all_reduce(step_tensor())
        stop.set()

    return fault


def late_arrival(ctx: Ctx) -> None:
    """The culprit holds the GIL (a C sleep) until past the alarm, then joins the all_reduce."""
    if ctx.is_culprit:
        libc().sleep(int(ctx.hang_timeout + LATE_S + 0.5))  # MARK late-wait
    dist.all_reduce(step_tensor())  # MARK late-arrive
    dist.all_reduce(step_tensor())  # MARK late-next


def dies_during_the_abort(victim: int) -> Callable[[Ctx], None]:
    """The culprit stops before an all_reduce; once the hang's abort is decided on ``victim``,
    a thread of it calls os.abort(): a rank dying of something else mid-teardown (as a late
    rank whose interpreter finalized under its responder did)."""

    def fault(ctx: Ctx) -> None:
        if ctx.rank == victim:
            from tether.job.alarm import raw_store

            store = raw_store(dist.distributed_c10d._get_default_store())
            key = f"tether/alarm/1/aborting/{victim}"  # the first alarm's, as the responder says

            def abort_once_aborting() -> None:
                store.wait([key], timedelta(seconds=HOLD_S))
                os.abort()

            threading.Thread(target=abort_once_aborting, name="victim", daemon=True).start()
        if ctx.is_culprit:
            hold()
        dist.all_reduce(step_tensor())

    return fault


# -- 5. what real training code showed ------------------------------------------------------


def fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def fsdp_train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, stall: bool) -> None:
    loss = model(torch.randn(4, 16)).sum()
    if stall:
        time.sleep(HOLD_S)  # MARK fsdp-stall
    loss.backward()  # MARK fsdp-backward
    opt.step()
    opt.zero_grad()


def fsdp_until_sigterm(ctx: Ctx) -> None:
    """A healthy FSDP2 run; the runner stops ``tether run`` with SIGTERM once it trains."""
    model, opt = fsdp_model()
    deadline = time.monotonic() + HEALTHY_LIMIT_S
    step = 0
    while time.monotonic() < deadline:
        fsdp_train_step(model, opt, stall=False)
        step += 1
        if step == 2:
            mark(ctx.sync, "ready", ctx.rank)
    sys.exit(NOT_STOPPED_EXIT)


def fsdp_backward_hang(ctx: Ctx) -> None:
    """The culprit stops before its backward; the others wait in the backward's collective."""
    model, opt = fsdp_model()
    for step in range(3):
        fsdp_train_step(model, opt, stall=ctx.is_culprit and step == 2)


def frozen(ctx: Ctx) -> None:
    """The culprit stops itself with SIGSTOP: alive, never answering."""
    for step in range(3):
        if ctx.is_culprit and step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # MARK frozen-stop
        dist.all_reduce(step_tensor())


def child_process(ctx: Ctx) -> None:
    """The culprit waits in subprocess.run for a child ``sleep 300``."""
    if ctx.is_culprit:
        pidfile = ctx.sync / f"child_{ctx.rank}"
        child = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"]
        subprocess.run(child, check=False)  # MARK child-run
    dist.all_reduce(step_tensor())


def _framework() -> Any:
    site.addsitedir(str(FRAMEWORK_SITE))
    import minitrainer

    return minitrainer


def hf_style(ctx: Ctx) -> None:
    """HF Trainer's shape: the framework runs the loop; the culprit's callback calls a framework
    helper that waits for a checkpoint that never comes."""
    mt = _framework()
    never = ctx.sync / "never"

    class Model(mt.Module):
        def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
            return batch * 2

    class Checkpointing(mt.Callback):
        def on_step_end(self, trainer: object, step: int) -> None:
            if ctx.is_culprit and step == 1:
                trainer.wait_for_checkpoint(never, timeout=HOLD_S)  # MARK hf-callback

    mt.Trainer(Model(), callbacks=[Checkpointing()], max_steps=4).fit()


def lightning_style(ctx: Ctx) -> None:
    """Lightning's shape: the user's training_step calls a framework helper that waits for a
    data shard that never comes."""
    mt = _framework()
    never = ctx.sync / "never"

    class Model(mt.Module):
        def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
            if ctx.is_culprit and step == 2:
                batch = batch + self.fetch_shard(never, timeout=HOLD_S)  # MARK pl-step
            return batch.sum().reshape(1)

    mt.Trainer(Model(), max_steps=4).fit()


# -- 6. an exception in one rank --------------------------------------------------------------


def ddp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def check_shard(name: str, shards: dict[str, int]) -> int:
    return shards[name]  # MARK raise-helper


def raise_in_loop(kind: str, ddp: bool) -> Callable[[Ctx], None]:
    """Every rank trains (DDP, or plain all_reduces); the culprit raises in the script's own code
    between two collectives at step 2, as a bad batch or a missing shard would."""

    def fault(ctx: Ctx) -> None:
        model, opt = ddp_model() if ddp else (None, None)
        for step in range(DEATH_STEP + 3):
            if model is not None and opt is not None:
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            if ctx.is_culprit and step == DEATH_STEP:
                if kind == "value":
                    raise ValueError(f"bad batch at step {step}")  # MARK raise-value
                check_shard(f"shard_{step}", {})
            dist.all_reduce(step_tensor())

    return fault


def absent_at_init(ctx: Ctx) -> None:
    """The culprit never calls init_process_group (held up before it); the others do."""
    if ctx.is_culprit:
        time.sleep(HOLD_S)  # MARK absent-init


def absent_at_new_group(members: list[int], desc: str) -> Callable[[Ctx], None]:
    """Every rank creates a group of ``members``, the culprit only after it is held up (the
    others wait in the creation; a non-member goes on to torch's own barrier)."""

    def fault(ctx: Ctx) -> None:
        if ctx.is_culprit:
            time.sleep(HOLD_S)  # MARK absent-new_group
        group = dist.new_group(members, group_desc=desc)
        if ctx.rank in members:
            dist.all_reduce(step_tensor(), group=group)

    return fault


def leave_early(ddp: bool, then: str) -> Callable[[Ctx], None]:
    """Every rank trains on its data; the culprit's runs out at step 2 and its script ends
    (exit code 0, its groups never destroyed) while the others go on to the next collective."""

    def fault(ctx: Ctx) -> None:
        model, opt = ddp_model() if ddp else (None, None)
        for step in range(DEATH_STEP + 3):
            if ctx.is_culprit and step == DEATH_STEP:
                sys.exit(0)  # the end of its script, without destroy_process_group
            if model is not None and opt is not None:
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            if then == "barrier" and step == DEATH_STEP:
                dist.barrier()
            dist.all_reduce(step_tensor())

    return fault


# -- the table ------------------------------------------------------------------------------

JOBS: dict[str, FaultJob] = {
    # 1. backend aborts
    "abort-allreduce-size": FaultJob(
        "backend-abort", 4, (2,), "desync", "crash", abort_all_reduce("size"),
        "rank 2 all_reduces 16 floats, the others 8; gloo aborts rank 1",
        op="all_reduce", marker="abort-all_reduce", victims=(1,), sides=("[[16]]", "[[8]]"),
    ),
    "abort-allreduce-dtype": FaultJob(
        "backend-abort", 4, (1,), "desync", "crash", abort_all_reduce("dtype"),
        "rank 1 all_reduces float64, the others float32; gloo aborts rank 0",
        op="all_reduce", marker="abort-all_reduce", victims=(0,), sides=("Double", "Float"),
    ),
    "abort-allreduce-ran-on": FaultJob(
        "backend-abort", 3, (1,), "desync", "crash", ran_on_past_all_reduce("size"),
        "rank 1 starts an async all_reduce of 16 floats, the others 8; each trains a step "
        "before waiting on it; gloo aborts rank 0",
        op="all_reduce", marker="ahead-all_reduce", victims=(0,), sides=("[[16]]", "[[8]]"),
    ),
    "abort-allreduce-ran-on-4": FaultJob(
        "backend-abort", 4, (3,), "desync", "crash", ran_on_past_all_reduce("size"),
        "rank 3 starts an async all_reduce of 16 floats, the others 8; each trains a step "
        "before waiting on it; gloo aborts rank 2",
        op="all_reduce", marker="ahead-all_reduce", victims=(2,), sides=("[[16]]", "[[8]]"),
    ),
    "abort-allgather-size": FaultJob(
        "backend-abort", 4, (3,), "desync", "crash", abort_all_gather("size", False),
        "rank 3 all_gathers 16 floats, the others 8; gloo aborts rank 0",
        op="all_gather", marker="abort-all_gather", victims=(0,),
        sides=("[[4, 16]]", "[[4, 8]]"),
    ),
    "abort-allgather-dtype": FaultJob(
        "backend-abort", 4, (0,), "desync", "crash", abort_all_gather("dtype", True),
        "rank 0 all_gather_into_tensor's float64, the others float32; gloo aborts rank 1",
        op="all_gather", marker="abort-all_gather_into_tensor", victims=(1,),
        sides=("Double", "Float"),
    ),
    "abort-subgroup-size": FaultJob(
        "backend-abort", 4, (3,), "desync", "crash", abort_all_reduce("size", "dp"),
        "in a group 'dp' of all 4 ranks, rank 3 all_reduces 16 floats, the others 8; "
        "gloo aborts rank 2",
        op="all_reduce", marker="abort-all_reduce", victims=(2,), sides=("[[16]]", "[[8]]"),
        group="dp",
    ),
    "abort-reducescatter-size": FaultJob(
        "backend-abort", 4, (2,), "desync", "crash", abort_reduce_scatter,
        "rank 2 reduce_scatters into 16 floats, the others 8; gloo aborts rank 1",
        op="reduce_scatter", marker="abort-rs", victims=(1,),
        sides=("[[64]]->[[16]]", "[[32]]->[[8]]"),
    ),
    # 2. dead ranks
    "dead-sigkill": FaultJob(
        "dead-rank", 4, (2,), "crash", "crash", die_in_loop("sigkill"),
        "rank 2 kills itself (SIGKILL) at step 2 of a loop of all_reduces",
    ),
    "dead-sigsegv": FaultJob(
        "dead-rank", 3, (1,), "crash", "crash", die_in_loop("sigsegv"),
        "rank 1 reads address 0 (SIGSEGV) at step 2 of a loop of all_reduces",
        marker="dead-sigsegv", stacks="fatal-signal",
    ),
    "dead-sigabrt": FaultJob(
        "dead-rank", 4, (0,), "crash", "crash", die_in_loop("sigabrt"),
        "rank 0 calls os.abort() (SIGABRT) at step 2 of a loop of all_reduces",
        marker="dead-sigabrt", stacks="fatal-signal",
    ),
    "dead-sigkill-pair": FaultJob(
        "dead-rank", 3, (2,), "crash", "crash", die_in_pair_group,
        "rank 2 is SIGKILLed in a loop of all_reduces in group [1, 2]; rank 0 waits in the world",
        group="pair12",
    ),
    # 3. stuck C code
    "stuck-gil-sleep": FaultJob(
        "stuck-c", 3, (2,), "hang", "hang", stuck_in("gil-sleep"),
        "rank 2 calls libc sleep(120) holding the GIL (returns early on a signal)",
        op="all_reduce", marker="stuck-gil-sleep", stacks="py-spy", exit_code=HANG_EXIT_CODE,
    ),
    "stuck-gil-poll": FaultJob(
        "stuck-c", 4, (0,), "hang", "hang", stuck_in("gil-poll"),
        "rank 0 calls libc poll(NULL, 0, 120 s) holding the GIL (returns EINTR on a signal)",
        op="all_reduce", marker="stuck-gil-poll", stacks="py-spy", exit_code=HANG_EXIT_CODE,
    ),
    "stuck-gil-read": FaultJob(
        "stuck-c", 4, (1,), "hang", "hang", stuck_in("gil-read"),
        "rank 1 calls libc read() on a pipe nobody writes, holding the GIL",
        op="all_reduce", marker="stuck-gil-read", stacks="py-spy", exit_code=HANG_EXIT_CODE,
    ),
    "stuck-sleep": FaultJob(
        "stuck-c", 3, (1,), "hang", "hang", stuck_in("sleep"),
        "rank 1 calls time.sleep(120) (retries on EINTR, releases the GIL)",
        op="all_reduce", marker="stuck-sleep", exit_code=HANG_EXIT_CODE,
    ),
    # 4. busy side groups, a late arrival
    "busy-side-4": FaultJob(
        "busy-groups", 4, (3,), "hang", "hang", busy_side_groups(((0, 1), (2, 3))),
        "threads all_reduce in side groups [0,1] and [2,3] in a loop; rank 3's main thread "
        "stops before a world all_reduce",
        op="all_reduce", marker="busy-hold", exit_code=HANG_EXIT_CODE,
    ),
    "busy-side-3": FaultJob(
        "busy-groups", 3, (2,), "hang", "hang", busy_side_groups(((0, 1),)),
        "a thread all_reduces in side group [0,1] in a loop; rank 2 (outside it) stops before "
        "a world all_reduce",
        op="all_reduce", marker="busy-hold", exit_code=HANG_EXIT_CODE,
    ),
    "busy-side-overlap": FaultJob(
        "busy-groups", 4, (1,), "hang", "hang", busy_side_groups(((0, 1, 2), (1, 3))),
        "threads all_reduce in side groups [0,1,2] and [1,3]; rank 1 (in both) stops before "
        "a world all_reduce",
        op="all_reduce", marker="busy-hold", exit_code=HANG_EXIT_CODE,
    ),
    "late-arrival-3": FaultJob(
        "busy-groups", 3, (0,), "hang", "hang", late_arrival,
        "rank 0 holds the GIL in a C sleep until past the alarm, then joins the all_reduce",
        op="all_reduce", marker=("late-wait", "late-arrive", "late-next"),
    ),
    "late-arrival-4": FaultJob(
        "busy-groups", 4, (2,), "hang", "hang", late_arrival,
        "rank 2 holds the GIL in a C sleep until past the alarm, then joins the all_reduce",
        op="all_reduce", marker=("late-wait", "late-arrive", "late-next"),
    ),
    "busy-ring-4": FaultJob(
        "busy-groups", 4, (2,), "hang", "hang", busy_side_groups(((0, 1), (2, 3))),
        "threads all_reduce in side groups [0,1] and [2,3] in a loop through a ring of 32 "
        "entries; rank 2 stops before a world all_reduce, which the side traffic pushes out of "
        "every ring within milliseconds",
        op="all_reduce", marker="busy-hold", exit_code=HANG_EXIT_CODE, flags=("--ring-size=32",),
    ),
    "busy-ring-metrics-3": FaultJob(
        "busy-groups", 3, (0,), "hang", "hang", busy_side_groups(((0, 1, 2),)),
        "a metrics thread all_reduces in a group of every rank in a loop through a ring of 16 "
        "entries; rank 0's main thread stops before a world all_reduce",
        op="all_reduce", marker="busy-hold", exit_code=HANG_EXIT_CODE, flags=("--ring-size=16",),
    ),
    "abort-teardown-death": FaultJob(
        "busy-groups", 3, (1,), "hang", "hang", dies_during_the_abort(2),
        "rank 1 stops before an all_reduce; rank 2 dies (SIGABRT) once the hang's abort is "
        "decided: the job ended by the hang, not by a crash",
        op="all_reduce", marker="hold", exit_code=HANG_EXIT_CODE,
    ),
    # 5. real training code
    "sigterm-fsdp": FaultJob(
        "real-code", 3, (), "healthy", "signal", fsdp_until_sigterm,
        "a healthy FSDP2 run (fully_shard); tether run gets SIGTERM once it trains",
        action="sigterm", exit_code=128 + signal.SIGTERM, group=None,
    ),
    "frozen-sigstop": FaultJob(
        "real-code", 4, (2,), "hang", "hang", frozen,
        "rank 2 stops itself with SIGSTOP before an all_reduce",
        op="all_reduce", marker="frozen-stop", ends_fast=True, exit_code=HANG_EXIT_CODE,
    ),
    "child-process": FaultJob(
        "real-code", 3, (1,), "hang", "hang", child_process,
        "rank 1 waits in subprocess.run for a child `sleep 300`",
        op="all_reduce", marker="child-run", child=True, exit_code=HANG_EXIT_CODE,
    ),
    "hf-callback": FaultJob(
        "real-code", 3, (2,), "hang", "hang", hf_style,
        "HF-Trainer shape: rank 2's callback calls a framework helper waiting for a file",
        op="all_reduce", marker="hf-callback", exit_code=HANG_EXIT_CODE,
    ),
    "lightning-step": FaultJob(
        "real-code", 4, (1,), "hang", "hang", lightning_style,
        "Lightning shape: rank 1's training_step calls a framework helper waiting for a file",
        op="all_reduce", marker="pl-step", exit_code=HANG_EXIT_CODE,
    ),
    "fsdp-backward": FaultJob(
        "real-code", 3, (0,), "hang", "hang", fsdp_backward_hang,
        "FSDP2: rank 0 stops before loss.backward(); the others wait in the backward's "
        "collective",
        marker="fsdp-stall", backward_frame=True, exit_code=HANG_EXIT_CODE, group=None,
    ),
    # 6. an exception in one rank
    "raise-ddp-3": FaultJob(
        "exception", 3, (1,), "crash", "crash", raise_in_loop("value", ddp=True),
        "DDP: rank 1 raises ValueError in the training loop at step 2",
        marker="raise-value", exception="ValueError: bad batch at step 2",
    ),
    "raise-plain-4": FaultJob(
        "exception", 4, (3,), "crash", "crash", raise_in_loop("key", ddp=False),
        "rank 3 raises KeyError in a helper of its own between two all_reduces",
        marker="raise-helper", exception="KeyError: 'shard_2'",
    ),
    "raise-ddp-4-rank0": FaultJob(
        "exception", 4, (0,), "crash", "crash", raise_in_loop("key", ddp=True),
        "DDP: rank 0 raises KeyError in a helper of its own at step 2",
        marker="raise-helper", exception="KeyError: 'shard_2'",
    ),
    "raise-no-linger-3": FaultJob(
        "exception", 3, (2,), "crash", "crash", raise_in_loop("value", ddp=False),
        "rank 2 raises ValueError, with TETHER_EXIT_LINGER=0: every rank exits at once, "
        "without dumping (the others on the broken connection)",
        marker="raise-value", exception="ValueError: bad batch at step 2",
        env=(("TETHER_EXIT_LINGER", "0"),), group=None,
    ),
    # 7. a rank that leaves early
    "leave-plain-3": FaultJob(
        "left", 3, (1,), "crash", "crash|hang", leave_early(ddp=False, then="all_reduce"),
        "rank 1 runs out of data at step 2 and returns (exit code 0); the others all_reduce on",
    ),
    "leave-barrier-4": FaultJob(
        "left", 4, (2,), "crash", "crash|hang", leave_early(ddp=False, then="barrier"),
        "rank 2 runs out of data at step 2 and returns; the others go on to a barrier",
    ),
    "leave-ddp-4": FaultJob(
        "left", 4, (0,), "crash", "crash|hang", leave_early(ddp=True, then="all_reduce"),
        "DDP: rank 0 runs out of data at step 2 and returns; the others train on",
    ),
    # 8. a rank that never arrives at a group's creation
    "absent-new-group-3": FaultJob(
        "absent", 3, (1,), "hang", "hang", absent_at_new_group([0, 1, 2], "dp"),
        "rank 1 is held up before new_group of every rank; the others wait in its creation",
        op="new_group", marker="absent-new_group", group="dp", exit_code=75,
    ),
    "absent-subgroup-4-rank0": FaultJob(
        "absent", 4, (0,), "hang", "hang", absent_at_new_group([0, 2, 3], "tp"),
        "rank 0 is held up before new_group([0, 2, 3]); ranks 2 and 3 wait in its creation; "
        "rank 1 (no member) goes on, destroys its groups and exits: its launcher answers for it",
        op="new_group", marker="absent-new_group", group="tp", exit_code=75, ends_fast=True,
    ),
    "absent-init-3": FaultJob(
        "absent", 3, (2,), "hang", "hang", absent_at_init,
        "rank 2 is held up before init_process_group; the others wait in the default group's "
        "creation (no responder yet: each dumps itself, the launcher reads rank 2's stacks)",
        op="init_process_group", marker="absent-init", exit_code=75, before_init=True,
    ),
}  # fmt: skip

CLASSES = tuple(dict.fromkeys(job.cls for job in JOBS.values()))


# -- a rank ---------------------------------------------------------------------------------


def mark(sync: Path, what: str, rank: int) -> None:
    """``sync/<what>_<rank>`` holding this pid, written under a temporary name first."""
    tmp = sync / f".{what}_{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(sync / f"{what}_{rank}")


def run_rank(name: str, sync: Path) -> int:
    job = JOBS[name]
    rank = int(os.environ["RANK"])
    mark(sync, "pid", rank)
    assert job.fault is not None
    if job.before_init:
        job.fault(Ctx(job, rank, int(os.environ["WORLD_SIZE"]), sync))
    dist.init_process_group("gloo")
    ctx = Ctx(job, rank, dist.get_world_size(), sync)
    for _ in range(WARMUP):
        dist.all_reduce(step_tensor())
    if job.action is None:
        mark(sync, "ready", rank)
    if not job.before_init:
        job.fault(ctx)
    dist.destroy_process_group()
    return 0


# -- the runner (the test's and the benchmark's) --------------------------------------------


def job_env() -> dict[str, str]:
    # TETHER_RECORDER stays: the corpus runs on either recorder.
    env = {
        k: v
        for k, v in os.environ.items()
        if k == "TETHER_RECORDER" or not k.startswith(("TETHER_", "TORCH_FR"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def command(name: str, job: FaultJob, dumps: Path, sync: Path) -> list[str]:
    script = list(job.argv) or [str(SCRIPT), "--job", name, "--sync", str(sync)]
    return [
        sys.executable, "-m", "tether.cli.main", "run", "--standalone",
        f"--nproc-per-node={job.world_size}", f"--dump-dir={dumps}",
        f"--hang-timeout={job.hang_timeout}", "--debug-port=off", "--monitor-interval=0.5",
        *job.flags, *script,
    ]  # fmt: skip


@dataclasses.dataclass
class Outcome:
    name: str
    job: FaultJob
    dumps: Path
    sync: Path
    exit_code: int | None
    """``tether run``'s exit code; None when the runner killed it at its deadline."""
    log: str
    wall_s: float
    end_after_event_s: float | None
    """From the first event directory seen to ``tether run``'s exit."""
    children_left: list[int]
    """Pids of the culprit's children still running once ``tether run`` had exited."""

    def events(self) -> list[Path]:
        if not self.dumps.is_dir():
            return []
        return sorted(p for p in self.dumps.iterdir() if p.is_dir() and p.name[0] != ".")

    def event(self) -> Path | None:
        """The event of the expected reason (else the first one)."""
        events = self.events()
        wanted = [e for e in events if e.name.endswith(tuple(f"-{r}" for r in reasons(self.job)))]
        return (wanted or events or [None])[0]


@dataclasses.dataclass
class _Running:
    name: str
    job: FaultJob
    proc: subprocess.Popen[bytes]
    root: Path
    started: float
    deadline: float
    acted: bool = False
    killed: bool = False
    event_seen: float | None = None

    @property
    def sync(self) -> Path:
        return self.root / "sync"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    def poll(self) -> bool:
        """One look at the job: does its action, notes its first event; True once it ended."""
        job = self.job
        now = time.monotonic()
        if self.event_seen is None and any(p.name[0] != "." for p in _entries(self.dumps)):
            self.event_seen = now
        ready = len(list(self.sync.glob("ready_*"))) == job.world_size
        if job.action == "sigterm" and not self.acted and ready:
            self.proc.send_signal(signal.SIGTERM)
            self.acted = True
        if self.proc.poll() is not None:
            return True
        if now > self.deadline:
            self.kill()
            return True
        return False

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def children_left(self) -> list[int]:
        return [pid for pid in _pids(self.sync, "child_") if _alive(pid)]

    def clean_up(self) -> None:
        """Nothing of the job stays behind, whatever it did."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in _pids(self.sync, "pid_") + _pids(self.sync, "child_"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def _pids(sync: Path, prefix: str) -> list[int]:
    pids = []
    for path in sync.glob(f"{prefix}*"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text().strip()))
    return pids


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def start(name: str, job: FaultJob, root: Path, deadline_s: float) -> _Running:
    root.mkdir(parents=True)
    (root / "sync").mkdir()
    with open(root / "launcher.log", "wb") as log:
        proc = subprocess.Popen(
            command(name, job, root / "dumps", root / "sync"),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=job_env() | dict(job.env),
            start_new_session=True,  # its own process group: the runner can end all of it
        )
    now = time.monotonic()
    return _Running(name, job, proc, root, now, now + deadline_s)


def run_jobs(
    jobs: dict[str, FaultJob], root: Path, parallel: int = 3, deadline_s: float = 75.0
) -> dict[str, Outcome]:
    """Run ``jobs`` (name -> job), ``parallel`` at once, each in ``root/<name>``; past
    ``deadline_s`` a job is killed (its exit code is then None)."""
    # A job judged healthy runs alone, last: beside two others on 2 cores one of its ranks is
    # starved of CPU, really lags (18 ms a collective, measured) and is rightly named a straggler.
    pending = sorted(jobs.items(), key=lambda item: item[1].verdict == "healthy")
    done: dict[str, Outcome] = {}
    running: list[_Running] = []

    def may_start(job: FaultJob) -> bool:
        if job.verdict == "healthy" or any(r.job.verdict == "healthy" for r in running):
            return not running
        return len(running) < parallel

    try:
        while pending or running:
            while pending and may_start(pending[0][1]):
                name, job = pending.pop(0)
                running.append(start(name, job, root / name, deadline_s))
            for run in list(running):
                if not run.poll():
                    continue
                running.remove(run)
                ended = time.monotonic()
                children = run.children_left()  # before the clean-up ends them
                run.clean_up()
                done[run.name] = Outcome(
                    name=run.name,
                    job=run.job,
                    dumps=run.dumps,
                    sync=run.sync,
                    exit_code=None if run.killed else run.proc.returncode,
                    log=(run.root / "launcher.log").read_text(errors="replace"),
                    wall_s=ended - run.started,
                    end_after_event_s=None if run.event_seen is None else ended - run.event_seen,
                    children_left=children,
                )
            time.sleep(0.05)
    finally:
        for run in running:
            run.clean_up()
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, choices=sorted(JOBS))
    parser.add_argument("--sync", type=Path, required=True)
    args = parser.parse_args()
    return run_rank(args.job, args.sync)


if __name__ == "__main__":
    sys.exit(main())
