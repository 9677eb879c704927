"""A `tether run` job (it never imports tether) whose rank --culprit misbehaves at once.

Every rank runs a few all_reduce steps and writes ``SYNC/ready_<rank>`` (holding its pid); then
the culprit does its --fault instead of the next all_reduce, and the others enter it:

  gil         stuck in a C call that holds the GIL and does not retry on EINTR (libc sleep
              returns early on a handled signal): a signal would free it
  stop        stops itself (SIGSTOP): alive, frozen
  segv        dies of SIGSEGV (a read at address 0)
  abort       dies of SIGABRT (os.abort, as C++'s terminate does)
  subprocess  blocked in subprocess.run on a child that writes its pid to ``SYNC/child``
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def misbehave(fault: str, sync: Path, seconds: int) -> None:
    if fault == "gil":
        ctypes.PyDLL(None).sleep(seconds)  # STUCK:gil
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # STUCK:stop
    elif fault == "segv":
        ctypes.string_at(0)  # STUCK:segv
    elif fault == "abort":
        os.abort()  # STUCK:abort
    elif fault == "subprocess":
        child = f"echo $$ > {sync / '.child'} && mv {sync / '.child'} {sync / 'child'}"
        subprocess.run(["sh", "-c", f"{child} && exec sleep {seconds}"], check=False)  # STUCK:sub
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", type=Path, required=True)
    parser.add_argument("--fault", required=True)
    parser.add_argument("--culprit", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=60, help="how long a stuck culprit stays")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for _ in range(3):
        dist.all_reduce(torch.ones(4))  # STEP:warm-up
    write_atomically(args.sync / f"ready_{rank}", str(os.getpid()))
    if rank == args.culprit:
        misbehave(args.fault, args.sync, args.seconds)
    dist.all_reduce(torch.ones(4))  # STEP:hung
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
