"""``dist.split_group`` on a 3-rank gloo job, plain or recorded (``--mode``): each rank reports
what the split gave it (the child's size and an all-reduce over it, or the error torch raised),
and under tether which groups its dump recorded. Prints ``RESULT <json>``."""

from __future__ import annotations

import argparse
import json
from typing import Any

import _common
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["tether", "plain"], required=True)
args = _common.parse(parser)
if args.mode == "tether":
    store = _common.init_recorded(args)
else:
    store = _common.connect(args)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)
out: dict[str, Any] = {}
try:
    child = dist.split_group(split_ranks=[[0, 1], [2]], group_desc="halves")
    t = torch.full((2,), float(args.rank + 1))
    dist.all_reduce(t, group=child)
    out["split"] = {"size": dist.get_world_size(child), "sum": t.tolist()}
except Exception as exc:  # torch's own refusal, compared with plain torch's
    out["split"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
if args.mode == "tether":
    import tether

    dump = tether.load_dump(tether.dump(reason="split"))
    configs = {name: c for name, c in dump["pg_config"].items()}
    out["recorded"] = sorted(
        (configs[e["process_group"][0]]["desc"], configs[e["process_group"][0]]["ranks"],
         e["profiling_name"], e["state"])
        for e in dump["entries"]
    )  # fmt: skip
dist.barrier()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
