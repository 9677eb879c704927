"""A job of one that ends cleanly, then dies of SIGSEGV late in the interpreter's shutdown (as a
C extension's destructor may), after tether has removed its empty stacks file."""

import atexit
import os
import signal

import torch
import torch.distributed as dist

# Registered before tether's own exit handler, so it runs after it (atexit runs last-in first).
atexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))

import tether  # noqa: E402

tether.install()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
