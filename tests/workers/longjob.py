"""A long job for the launcher's fault tests, run by `tether run` (it never imports tether).

Every rank runs a few all_reduce steps, writes ``SYNC/ready_<rank>`` (holding its pid), then
keeps running small collectives until something ends the job:

  --victim R --die sigkill|exit3   rank R waits for ``SYNC/die`` and dies that way; the others
                                   run all_reduce on a group without R, so none of their
                                   collectives fails when it dies: only the launcher notices
  --with-victim                    ... on the world group instead: R's death breaks the others'
                                   collective, and they die of gloo's error
  (no victim)                      every rank runs all_reduce on the world group until
                                   ``SYNC/stop`` appears; the ranks agree on when through the
                                   collective itself, then exit cleanly

Every loop also ends after --max-seconds, so a broken test never leaves workers behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", type=Path, required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--die", choices=("sigkill", "exit3"), default="sigkill")
    parser.add_argument("--with-victim", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    survivors = dist.new_group([r for r in range(world_size) if r != args.victim])
    for _ in range(3):
        dist.all_reduce(torch.ones(4))  # STEP:warm-up
    write_atomically(args.sync / f"ready_{rank}", str(os.getpid()))
    deadline = time.monotonic() + args.max_seconds

    if rank == args.victim:
        while not (args.sync / "die").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if args.die == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)

    group = survivors if args.victim >= 0 and not args.with_victim else None
    while True:
        over = (args.sync / "stop").exists() or time.monotonic() > deadline
        flag = torch.tensor([float(over)])
        dist.all_reduce(flag, group=group)  # STEP:loop
        if flag.item() > 0:
            break
        time.sleep(0.02)  # two cores for three workers and the launcher
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
