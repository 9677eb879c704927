"""A healthy recorded job whose store is hosted by rank 0, as without torchrun: rank 0 exits as
soon as every rank is done, while the others are finalizing (each holds its interpreter's
finalization until the store's port closes). No rank may die of it."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import _common
import torch
import torch.distributed as dist

import tether

args = _common.parse()
rank, world = args.rank, args.world_size
store = dist.TCPStore(
    "127.0.0.1", args.port, world, is_master=rank == 0, timeout=timedelta(seconds=60)
)
tether.init_process_group("gloo", store=store, rank=rank, world_size=world, dump_dir=args.dump_dir)
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
store.set(f"done/{rank}", "1")
if rank == 0:  # the store goes with this process
    store.wait([f"done/{r}" for r in range(world)])
print(f"rank {rank} done", flush=True)


class _UntilStoreGone:
    """Freed as the interpreter finalizes (a module global): waits there, up to 10 s, until
    rank 0's store no longer accepts connections."""

    def __del__(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", args.port), timeout=0.5).close()
            except OSError:
                return
            time.sleep(0.02)


if rank != 0:
    _until_store_gone = _UntilStoreGone()
