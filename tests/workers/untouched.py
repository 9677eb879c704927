"""A plain torch.distributed script with no tether import, for `tether run` tests.

Writes what it saw to ``$RESULT_DIR/<rank>.json`` (workers share one stdout under torchrun)."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
dist.barrier()
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
result = {
    # Recording shows as tether's group class (Python recorder) or its backend (native core).
    "recorder": f"{type(dist.group.WORLD).__name__}/{type(backend).__name__}",
    "sum": t.tolist(),
}
Path(os.environ["RESULT_DIR"], f"{dist.get_rank()}.json").write_text(json.dumps(result))
# A backend still referenced here would outlive the group, and gloo's worker threads with it:
# one freeing its last work's tensor as the interpreter finalizes aborts the process (torch's
# own exit race, pytorch#179291).
del backend
dist.destroy_process_group()
