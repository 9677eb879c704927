"""The DDP job of ``bench/elastic.py``, in the three ways a user would make it survive a death.

    --mode tether       tether.elastic (under ``tether run --elastic``); with ``--hsdp``, FSDP2
                        sharded within each node and replicated across nodes
                        (``tether.elastic.hsdp_mesh``) instead of DDP; with ``--no-manager``,
                        tether's elastic DDP in a plain loop (what the Manager adds, measured)
    --mode plain        torch's DDP (under ``tether run``, ``tether run --elastic`` or torchrun
                        with ``--max-restarts``): a checkpoint every ``--ckpt-every`` steps, and
                        a restart resumes from the last one
    --mode torchft      torchft's Manager (its allreduce averages the gradients) and optimizer
                        wrapper; one replica group per process, a lighthouse at ``--lighthouse``

Every process appends one JSON line per event to ``OUT/events.jsonl``: ``start`` (taken before
torch is imported), ``step`` (a step committed, with its index), ``kill`` (just before the
``--kill-rank`` sends itself SIGKILL at ``--kill-step``), ``heal`` (bytes and seconds).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a replacement's start includes them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WIDTH = 512
BATCH = 32


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * WIDTH, 4 * WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * WIDTH, WIDTH),
    )
    return model, optimizer(model)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer over ``model``'s parameters (made again once FSDP2 sharded them)."""
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


class Log:
    def __init__(self, out: str, who: str) -> None:
        self.path = Path(out, "events.jsonl")
        self.who = who

    def __call__(self, what: str, **fields: object) -> None:
        line = json.dumps({"who": self.who, "what": what, "t": time.time(), **fields})
        with self.path.open("a") as f:  # one short write per line: whole lines
            f.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("tether", "plain", "torchft"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--replica", type=int, default=-1)
    parser.add_argument("--until-world", type=int, default=0)
    parser.add_argument("--hsdp", action="store_true")
    parser.add_argument("--no-manager", action="store_true")
    args = parser.parse_args()
    rank = args.replica if args.mode == "torchft" else int(os.environ["RANK"])
    first = (
        int(os.environ.get("TETHER_ELASTIC_REPLACEMENT", "0")) == 0
        and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        and not os.environ.get("BENCH_REPLACEMENT")
    )
    log = Log(args.out, f"{rank}{'' if first else '+'}")
    log("start", t=STARTED, rank=rank, pid=os.getpid())
    model, opt = model_and_optimizer()

    def maybe_die(step: int) -> None:
        # >=: torchft's step counter jumps when a replica heals from one further ahead
        if first and rank == args.kill_rank and step >= args.kill_step >= 0:
            log("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

    if args.mode == "tether":
        run_tether(args, model, opt, log, maybe_die)
    elif args.mode == "plain":
        run_plain(args, model, opt, log, maybe_die)
    else:
        run_torchft(args, model, opt, log, maybe_die)


def run_tether(args, model, opt, log, maybe_die) -> None:  # type: ignore[no-untyped-def]
    import tether.elastic

    dist.init_process_group("gloo")
    if args.hsdp:
        from tether.demo.elastic_job import shard_across_nodes

        net = shard_across_nodes(model)
        opt = optimizer(model)  # over the shards
    else:
        net = tether.elastic.DistributedDataParallel(model)
    if args.no_manager:
        for step in range(args.steps):
            x, y = batch(step, dist.get_rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            log("step", step=step, world=dist.get_world_size())
        dist.destroy_process_group()
        return
    manager = tether.elastic.Manager(state={"model": model, "optimizer": opt})
    logged = 0  # entries of manager.history already logged
    full_since = None  # the first step of the world of --until-world ranks
    cost = LoopCost()
    steps = manager.steps(50 * args.steps if args.until_world else args.steps)
    while (step := cost.call(next, steps, None)) is not None:
        if step == COST_FROM:
            cost.start()
        if manager.world_size < args.until_world:
            full_since = None
        elif full_since is None:
            full_since = step  # every member sees the same world at the same step
        if step >= args.steps and (full_since is not None and step >= full_since + 2):
            break  # past --steps, and the world has been whole again for two steps
        with manager.attempt():
            x, y = batch(step, manager.rank)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            maybe_die(step)
            loss.backward()
            if cost.call(manager.should_commit):
                opt.step()
                log("step", step=step, world=manager.world_size)
        for entry in manager.history[logged:]:
            if entry["heal_bytes"]:
                log("heal", bytes=entry["heal_bytes"], seconds=entry["heal_s"])
        logged = len(manager.history)
    log("loop_cost", **cost.figures())
    dist.destroy_process_group()


COST_FROM = 10
"""The first step whose loop cost counts (the step times' too): before it, the first boundary's
parameter sync and warm-up."""


class LoopCost:
    """The CPU the ``tether.elastic`` loop takes from step :data:`COST_FROM` on: the training
    thread's inside the Manager's calls (the step boundary, the vote's start; a wait for the
    vote or a regroup takes no CPU), and the heartbeat thread's, from its own CPU clock; and the
    training thread's time inside those calls, waits included."""

    def __init__(self) -> None:
        self.main_s = 0.0
        self.main_wall_s = 0.0
        self._heartbeat_clock: int | None = None
        self._heartbeat_from = self._wall_from = 0.0

    def start(self) -> None:
        import threading

        beat = next(t for t in threading.enumerate() if t.name == "tether-elastic-heartbeat")
        assert beat.ident is not None
        self._heartbeat_clock = time.pthread_getcpuclockid(beat.ident)
        self._heartbeat_from = time.clock_gettime(self._heartbeat_clock)
        self._wall_from = time.monotonic()

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        began, began_wall = time.thread_time(), time.monotonic()
        try:
            return fn(*args)
        finally:
            if self._heartbeat_clock is not None:  # counting since start()
                self.main_s += time.thread_time() - began
                self.main_wall_s += time.monotonic() - began_wall

    def figures(self) -> dict[str, float]:
        if self._heartbeat_clock is None:
            return {}
        return {
            "main_cpu_s": self.main_s,
            "main_wall_s": self.main_wall_s,
            "heartbeat_cpu_s": time.clock_gettime(self._heartbeat_clock) - self._heartbeat_from,
            "wall_s": time.monotonic() - self._wall_from,
        }


def run_plain(args, model, opt, log, maybe_die) -> None:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ckpt = Path(args.out, "checkpoint.pt")
    start = 0
    if ckpt.exists():  # a restart: every step since the checkpoint is done again
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    for step in range(start, args.steps):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        maybe_die(step)
        loss.backward()
        opt.step()
        log("step", step=step, world=dist.get_world_size())
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and dist.get_rank() == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp
            )
            tmp.replace(ckpt)
    dist.destroy_process_group()


def run_torchft(args, model, opt, log, maybe_die) -> None:  # type: ignore[no-untyped-def]
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            opt.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{args.replica}",
        lighthouse_addr=args.lighthouse,
        store_addr="localhost",
        store_port=int(os.environ["BENCH_STORE_PORT"]),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=5),
    )
    optimizer = OptimizerWrapper(manager, opt)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        x, y = batch(step, args.replica)
        loss = torch.nn.functional.mse_loss(model(x), y)
        maybe_die(step)
        loss.backward()
        # torchft 0.2.0's DistributedDataParallel fails an assertion (ddp.py:76, `assert
        # fut._fut`) when a peer dies: gradients are averaged with Manager.allreduce instead.
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        if manager.should_commit():
            opt.step()
            log("step", step=step, world=manager.num_participants())
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
