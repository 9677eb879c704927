"""The analyzer's corpus: real fault scenarios, each a real multi-rank gloo job recorded by tether.

:data:`SCENARIOS` is the table: a name, the job's size, the culprit rank, and what goes wrong
(the function, whose docstring says it in one line). Every rank first runs :data:`WARMUP` world
all_reduces, so each event has a matched history before the fault. A scenario whose job survives
its fault ends with every rank dumping into one event (reason ``end``); a hang ends with the
watchdog's job-wide alarm (reason ``hang``) and every rank aborting; a crash ends with
``tether run``'s dumps before teardown (reason ``crash``).

Two ways to run it:

  python scenarios.py --dump-dir D --log-dir L [--gate FILE] [--deadline S] NAME=PORT ...
      the named scenarios, each against the TCPStore the caller hosts on PORT, all at once except
      the timing ones (see :func:`run_forked`); events go to D/NAME/, rank R's output to
      L/NAME/rank_R.log; prints one JSON line: NAME -> every rank's exit code.
      This process imports torch once and forks every rank: importing torch costs about 4 s of
      CPU per process, and thirty of them would not fit the test's budget on two cores. The ranks
      are still separate processes, joined by gloo over TCP.
  tether run --nproc-per-node=N scenarios.py --scenario NAME
      one scenario under the launcher (``crash`` needs it: the launcher has the survivors dump).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import tether

WARMUP = 3
"""World all_reduces every rank runs before the fault (sequence numbers 1..3)."""
HANG_TIMEOUT_S = 1.5
"""The watchdog's hang timeout in the forked jobs."""
HOLD_S = 90.0
"""How long a stuck rank waits; the hang's abort (or the caller's deadline) ends it first."""
STRAGGLER_STEPS = 12
STRAGGLER_DELAY_S = 0.04


@dataclasses.dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    culprit: int

    @property
    def is_culprit(self) -> bool:
        return self.rank == self.culprit


@dataclasses.dataclass(frozen=True)
class Scenario:
    world_size: int
    culprit: int
    """The rank at fault; -1 when none is."""
    fault: Callable[[Rank], None]
    """What every rank does after the warm-up (its docstring says what goes wrong)."""
    launcher: str = "fork"
    """"fork" (the runner in this file) or "tether run"."""
    timing: bool = False
    """Its diagnosis reads timestamps: the runner starts it alone, after the others."""


def step() -> torch.Tensor:
    return torch.ones(8)


def hold() -> None:
    time.sleep(HOLD_S)  # STUCK:hold


# -- the faults: each runs on every rank, after the warm-up -------------------------------------


def hang_before(r: Rank) -> None:
    """The culprit sleeps instead of joining an all_reduce; the others wait inside it."""
    if r.is_culprit:
        hold()
    dist.all_reduce(step())


def hang_inside(r: Rank) -> None:
    """The culprit waits inside a recv that nobody sends; the others wait in an all_reduce."""
    if r.is_culprit:
        dist.recv(torch.zeros(1), src=(r.rank + 1) % r.world_size)  # STUCK:recv
    dist.all_reduce(step())


def desync_op(r: Rank) -> None:
    """The culprit calls all_gather where the others call all_reduce; gloo then waits forever."""
    t = step()
    if r.is_culprit:
        dist.all_gather([torch.zeros_like(t) for _ in range(r.world_size)], t)  # DESYNC:op
    else:
        dist.all_reduce(t)
    dist.all_reduce(step())


def desync_size(r: Rank) -> None:
    """The culprit receives a broadcast into 16 floats where the others use 8; gloo carries on.

    (An all_reduce of mismatched sizes makes gloo abort whichever process receives more than it
    expects, often a healthy one: a crash, not a desync, in the dumps.)"""
    dist.broadcast(torch.ones(16 if r.is_culprit else 8), src=0)
    dist.all_reduce(step())


def desync_dtype(r: Rank) -> None:
    """The culprit all_reduces int32 where the others use float32; gloo adds the bits."""
    dist.all_reduce(torch.ones(8, dtype=torch.int32 if r.is_culprit else torch.float32))
    dist.all_reduce(step())


def crash(r: Rank) -> None:
    """The culprit dies from SIGKILL; the others' all_reduce fails ("Connection closed by peer")
    and they die of it, after dumping into the launcher's crash event (``tether run`` has a rank
    dying of an exception linger for the launcher's alarm)."""
    if r.is_culprit:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(step())


def straggler(r: Rank) -> None:
    """The culprit sleeps 40 ms before each of 12 all_reduces; the job ends normally."""
    for _ in range(STRAGGLER_STEPS):
        if r.is_culprit:
            time.sleep(STRAGGLER_DELAY_S)
        dist.all_reduce(step())


def subgroup_cascade(r: Rank) -> None:
    """On 4 ranks: the culprit (3) never joins group [2, 3]'s all_reduce; 2 waits in it, 0 and 1
    wait in a world all_reduce that 2 and 3 never reach."""
    sub = dist.new_group([2, 3], group_desc="pair23")
    if r.rank in (2, 3):
        dist.all_reduce(step(), group=sub)  # once, by both members: the group works
    if r.is_culprit:
        hold()
    if r.rank == 2:
        dist.all_reduce(step(), group=sub)  # waits for 3
    dist.all_reduce(step())


def p2p_unmatched(r: Rank) -> None:
    """The culprit sends the next rank two tensors, which receives one; the culprit then waits
    in its second send while the others wait in an all_reduce it never joins."""
    peer = (r.culprit + 1) % r.world_size
    if r.is_culprit:
        dist.send(torch.ones(4), dst=peer)
        dist.send(torch.ones(4), dst=peer)  # STUCK:send
    elif r.rank == peer:
        dist.recv(torch.zeros(4), src=r.culprit)
    dist.all_reduce(step())


def healthy(r: Rank) -> None:
    """Nothing goes wrong: more all_reduces and a broadcast."""
    for _ in range(6):
        dist.all_reduce(step())
    dist.broadcast(step(), src=0)


SCENARIOS: dict[str, Scenario] = {
    "hang-before": Scenario(world_size=3, culprit=1, fault=hang_before),
    "hang-inside": Scenario(world_size=3, culprit=1, fault=hang_inside),
    "desync-op": Scenario(world_size=3, culprit=2, fault=desync_op),
    "desync-size": Scenario(world_size=3, culprit=2, fault=desync_size),
    "desync-dtype": Scenario(world_size=3, culprit=1, fault=desync_dtype),
    "crash": Scenario(world_size=3, culprit=1, fault=crash, launcher="tether run"),
    "straggler": Scenario(world_size=3, culprit=2, fault=straggler, timing=True),
    "subgroup-cascade": Scenario(world_size=4, culprit=3, fault=subgroup_cascade),
    "p2p-unmatched": Scenario(world_size=3, culprit=0, fault=p2p_unmatched),
    "healthy": Scenario(world_size=3, culprit=-1, fault=healthy, timing=True),
}


# -- running a rank ---------------------------------------------------------------------------


def run_rank(name: str, r: Rank) -> int:
    """The rank's part of the scenario, once its default group is up."""
    for _ in range(WARMUP):
        dist.all_reduce(step())
    SCENARIOS[name].fault(r)
    # The job survived its fault: every rank dumps into one event (the n-th dump of a reason
    # goes to the same event on every rank).
    path = tether.dump(reason="end")
    print(f"rank {r.rank}: dumped {path}", flush=True)
    dist.destroy_process_group()
    return 0


def _forked_rank(name: str, rank: int, port: int, dump_dir: Path) -> int:
    scenario = SCENARIOS[name]
    os.environ["TETHER_DEBUG_PORT"] = "off"  # thirty debug servers would only cost CPU here
    store = dist.TCPStore(
        "127.0.0.1", port, scenario.world_size, is_master=False, timeout=timedelta(seconds=60)
    )
    tether.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=scenario.world_size,
        dump_dir=dump_dir,
        hang_timeout=HANG_TIMEOUT_S,
        on_hang="abort",
        timeout=timedelta(seconds=60),  # gloo's own timeout: the watchdog acts long before
    )
    return run_rank(name, Rank(rank, scenario.world_size, scenario.culprit))


@dataclasses.dataclass(frozen=True)
class _Child:
    name: str
    rank: int
    port: int


def _spawn(ports: dict[str, int], log_dir: Path) -> dict[int, tuple[str, int]] | _Child:
    """Fork every rank of every scenario in ``ports``: pid -> (scenario, rank). In a child,
    returns which rank it is."""
    pids: dict[int, tuple[str, int]] = {}
    for name, port in ports.items():
        for rank in range(SCENARIOS[name].world_size):
            log = log_dir / name / f"rank_{rank}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                return _Child(name, rank, port)
            pids[pid] = (name, rank)
    return pids


def _reap(pids: dict[int, tuple[str, int]], codes: dict[str, list[int]], deadline: float) -> None:
    """Wait for every process in ``pids``; past ``deadline`` (monotonic) kill what is left."""
    while pids and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        name, rank = pids.pop(pid)
        codes[name][rank] = os.waitstatus_to_exitcode(status)
    for pid, (name, rank) in pids.items():  # stuck: the exit code says SIGKILL
        os.kill(pid, signal.SIGKILL)
        codes[name][rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run_forked(
    ports: dict[str, int], log_dir: Path, deadline_s: float, gate: Path | None
) -> dict[str, list[int]] | _Child:
    """Run the scenarios in ``ports`` and return each one's exit codes per rank; in a child,
    returns which rank it is. The timing scenarios run last, by themselves, once the file
    ``gate`` exists (the caller's other jobs are over): their diagnosis compares arrival times,
    and a rank descheduled while thirty processes start is late for no fault of its own."""
    deadline = time.monotonic() + deadline_s
    codes = {name: [-1] * SCENARIOS[name].world_size for name in ports}
    waves = (
        {n: p for n, p in ports.items() if not SCENARIOS[n].timing},
        {n: p for n, p in ports.items() if SCENARIOS[n].timing},
    )
    for i, wave in enumerate(waves):
        if i and gate is not None:
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        pids = _spawn(wave, log_dir)
        if isinstance(pids, _Child):
            return pids
        _reap(pids, codes, deadline)
    return codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", help="under tether run: the scenario this job runs")
    parser.add_argument("--dump-dir", type=Path, help="forked: events go to DUMP_DIR/NAME/")
    parser.add_argument("--log-dir", type=Path, help="forked: LOG_DIR/NAME/rank_R.log")
    parser.add_argument("--deadline", type=float, default=60.0, help="forked: seconds")
    parser.add_argument("--gate", type=Path, help="forked: the timing scenarios wait for it")
    parser.add_argument("jobs", nargs="*", metavar="NAME=PORT")
    args = parser.parse_args()
    if args.scenario:  # one rank of a job started by tether run
        dist.init_process_group("gloo")
        scenario = SCENARIOS[args.scenario]
        rank = Rank(dist.get_rank(), dist.get_world_size(), scenario.culprit)
        return run_rank(args.scenario, rank)
    ports = {name: int(port) for name, port in (job.split("=") for job in args.jobs)}
    gc.freeze()  # the children share the parent's objects: their collector leaves them alone
    result = run_forked(ports, args.log_dir, args.deadline, args.gate)
    if isinstance(result, _Child):
        code = 1
        try:
            code = _forked_rank(result.name, result.rank, result.port, args.dump_dir / result.name)
        finally:
            # Exit like the interpreter (tether's exit handler runs), minus the finalization: it
            # touches every object inherited from the parent, and copying those pages on write
            # takes seconds per child.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
