"""A small DDP job for ``tether run --elastic`` tests, with faults injected on request.

The training is the elastic demo's (:mod:`tether.demo.elastic_job`): every step's global batch
is fixed by the step number and re-sharded over the ranks alive, so the committed losses must
equal its single-process ``reference_losses``. Each worker writes
``OUT/<rank>.<incarnation>.json``: the losses of the steps it committed, its final parameters'
digest, and what its manager went through.

    --fault RANK:STEP:SIGNAL   rank RANK (launch-time, first incarnation) sends itself SIGNAL
                               in the middle of step STEP (after its forward, while the others
                               are in the gradient allreduce)
    --stuck RANK:STEP          in step STEP, after its forward, RANK waits in an all_reduce on a
                               group of its own with RANK+1, which never joins it (a wait that
                               no shut connection of the world group ends); a --fault of that
                               step waits for it to be issued
    --die-in-regroup RANK      RANK dies as it starts regrouping after the first death
    --die-healing RANK         RANK dies while packing its state to heal a replacement
    --replacement-fails        every replacement exits 3 before joining
    --until-world N            run past --steps until N ranks are members (a replacement joined)
    --until-epoch E            run past --steps until the job reached membership decision E
    --until-file PATH          run past --steps until PATH exists (a failed replacement writes it)
    --ready-dir DIR            after step 0, write DIR/<rank> holding this process's pid
    --save-on-stop SECONDS     on WorldTooSmallError, take SECONDS to "save" (write
                               OUT/saved.<rank>) before raising it on
    --hsdp                     FSDP2 sharded within a node, replicated across nodes
                               (tether.elastic.hsdp_mesh) instead of DDP
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests._jobs import until
from tether._exceptions import RankFailedError, WorldTooSmallError
from tether.demo.elastic_job import (
    digest,
    model_and_optimizer,
    optimizer,
    shard,
    shard_across_nodes,
)


class _DiesWhenHealing:
    """Registered state whose ``state_dict`` kills the healer (it is asked only to heal)."""

    def __init__(self, armed: bool) -> None:
        self.armed = armed

    def state_dict(self) -> dict[str, int]:
        if self.armed:
            print(f"rank {os.environ['RANK']} dies while healing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        del state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--miss-step", default="")
    parser.add_argument("--stuck", default="")
    parser.add_argument("--die-in-regroup", type=int, default=-1)
    parser.add_argument("--die-healing", type=int, default=-1)
    parser.add_argument("--replacement-fails", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--until-world", type=int, default=0)
    parser.add_argument("--until-epoch", type=int, default=0)
    parser.add_argument("--until-file", default="")
    parser.add_argument("--ready-dir", default="")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--linger-at-exit", type=float, default=0.0)
    parser.add_argument("--hsdp", action="store_true")
    parser.add_argument("--save-on-stop", type=float, default=0.0)
    args = parser.parse_args()
    if args.linger_at_exit:  # registered before tether's handler, so it runs after it (LIFO)
        atexit.register(time.sleep, args.linger_at_exit)
    import tether.elastic

    stable = int(os.environ["RANK"])
    incarnation = int(os.environ.get("TETHER_ELASTIC_REPLACEMENT", "0"))
    if incarnation and args.replacement_fails:
        print(f"replacement {incarnation} of rank {stable} fails", flush=True)
        if args.until_file:
            Path(args.until_file).write_text("failed")
        sys.exit(3)
    faults = {}
    for spec in args.fault:
        rank, step, sig = spec.split(":")
        faults[(int(rank), int(step))] = getattr(signal, sig)

    missed = tuple(map(int, args.miss_step.split(":"))) if args.miss_step else None
    dist.init_process_group("gloo")
    stuck: tuple[int, ...] = (-1, -1)
    aside = None
    if args.stuck and not incarnation:
        stuck = tuple(map(int, args.stuck.split(":")))
        aside = dist.new_group([stuck[0], stuck[0] + 1])  # every launch-time rank takes part
    model, opt = model_and_optimizer()
    part = 0  # the replicas of one part of the state are bit-identical
    if args.hsdp:
        net = shard_across_nodes(model)
        opt = optimizer(model)
        part = tether.elastic.current_world().shard_of(stable)
    else:
        net = tether.elastic.DistributedDataParallel(model)
    state = {"model": model, "optimizer": opt}
    if args.die_healing >= 0:
        state["probe"] = _DiesWhenHealing(armed=stable == args.die_healing and not incarnation)
    manager = tether.elastic.Manager(state=state)
    losses: dict[int, float] = {}
    started = time.time()
    full_since = None
    try:
        for step in manager.steps(args.max_steps):
            if manager.world_size < args.until_world or manager.epoch < args.until_epoch:
                full_since = None
            elif full_since is None:
                full_since = step  # every member sees the same world at the same step
            if step >= args.steps and full_since is not None and step >= full_since + 2:
                if not args.until_file:
                    break
                seen = torch.tensor([float(Path(args.until_file).exists())])
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # every member stops at the same step
                if seen.item():
                    break
            with manager.attempt():
                if step % 4 == 0:  # a checkpoint's place: every step before this one is the job's
                    committed = manager.wait_committed()
                    assert committed == step, f"step {step}: {committed} steps committed"
                x, y = shard(step, manager.rank, manager.world_size)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                if (stable, step) == stuck:
                    print(
                        f"rank {stable} waits on rank {stable + 1}, which never comes", flush=True
                    )
                    work = dist.all_reduce(torch.ones(1), group=aside, async_op=True)
                    Path(args.out, "stuck").write_text(str(stable))
                    work.wait()
                sig = faults.get((stable, step)) if incarnation == 0 else None
                if sig is not None:
                    if step == stuck[1]:  # once the stuck rank's wait is issued
                        until(Path(args.out, "stuck").exists, "the stuck rank never waited")
                    print(f"rank {stable} sends itself {sig.name} at step {step}", flush=True)
                    os.kill(os.getpid(), sig)
                loss.backward()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                mean /= manager.world_size
                commit = (
                    manager.should_commit()
                )  # starts the step's vote: the others' boundary waits
                if (stable, step) == missed and incarnation == 0:
                    print(f"rank {stable} misses step {step}", flush=True)
                    raise RankFailedError("the last result did not arrive", dead_ranks=[], epoch=0)
                if commit:
                    opt.step()
                    losses[step] = float(mean)
            if args.ready_dir and step == 0:
                Path(args.ready_dir, str(stable)).write_text(str(os.getpid()))
            if manager.last_failure is not None and args.die_in_regroup == stable:
                print(f"rank {stable} dies as it regroups", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except WorldTooSmallError:
        if args.save_on_stop:  # what a job that saves a checkpoint before it ends takes
            time.sleep(args.save_on_stop)
            Path(args.out, f"saved.{stable}").write_text(digest(model))
            print(f"rank {stable} saved its state", flush=True)
        raise
    out = {
        "rank": stable,
        "incarnation": incarnation,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "digest": digest(model),
        "part": part,
        "final_world_size": manager.world_size,
        "history": manager.history,
        "seconds": time.time() - started,
        "heartbeat_to": tether.elastic.current_world().heartbeat_to,
        "etcd": bool(tether.elastic.current_world().address.etcd),
    }
    Path(args.out, f"{stable}.{incarnation}.json").write_text(json.dumps(out))
    print(f"rank {stable}.{incarnation} done: world {manager.world_size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
