"""A short healthy job for `tether run` that exits cleanly; rank 0 first notes what tether left
in DUMP_DIR/.jobs and .stacks while the job runs (``$RESULT_DIR/files.json``), once the targets
file for Prometheus lists every rank."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(2))
dump_dir = Path(os.environ["TETHER_DUMP_DIR"])
if dist.get_rank() == 0:
    deadline = time.monotonic() + 60
    while not list(dump_dir.glob(".jobs/*.targets.json")) and time.monotonic() < deadline:
        time.sleep(0.05)  # written by rank 0's own server thread once every rank is published
    files = {
        "jobs": sorted(p.name for p in dump_dir.glob(".jobs/*")),
        "stacks": sorted(p.name for p in dump_dir.glob(".stacks/*")),
        "targets": [json.loads(p.read_text()) for p in dump_dir.glob(".jobs/*.targets.json")],
    }
    Path(os.environ["RESULT_DIR"], "files.json").write_text(json.dumps(files))
dist.barrier()  # rank 1 exits after rank 0 has looked
sys.exit(int(os.environ.get("EXIT_CODE", "0")))  # not 0: a failed exit, which keeps its files
