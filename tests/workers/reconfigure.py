"""One recorded 3-rank gloo job through torch's reconfigure (``enable_reconfigure=True``), the
stages modelled on torch's own fault-tolerance tests, one after the other:

  uuid 1  all three (a list: ranks by position), then all_reduce
  uuid 2  identity: the same members again
  uuid 3  shrink, leaving out the middle rank (2 becomes 1), then all_reduce and send/recv
  uuid 4  grow back to all three (a set: gloo sorts it)
  uuid 5  shrink, leaving out the last rank
  uuid 5  again, on rank 0 alone: refused as reused; the group still works afterwards
  uuid 6, 7  split: ranks 0 and 1 together, rank 2 alone (it joins late: it sat out uuid 5)
  uuid 8  merge the two back into one
  uuid 9-11, 12  single to all: each rank alone, then all three
  uuid 13  after every rank aborted the group
  then a subgroup of all three reconfigured alone to ranks 0 and 2 (its own uuid 1): the world
  group is untouched

Handles go through the job's store; a rank left out waits for the stage to end. Each rank prints
``RESULT <json>`` of what it saw, and its dump's path (every rank dumps at the end).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import _common
import torch
import torch.distributed as dist

import tether

args = _common.parse()
me, world = args.rank, args.world_size
store = _common.connect(args)
tether.init_process_group(
    "gloo",
    store=store,
    rank=me,
    world_size=world,
    dump_dir=args.dump_dir,
    enable_reconfigure=True,
    timeout=timedelta(seconds=30),
)
out: dict[str, Any] = {"handle": [dist._get_reconfigure_handle()]}
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as exc:
    out["before"] = str(exc)


def stage(uuid: int, members: list[int], *, ordered: bool = True) -> None:
    """Reconfigure ``members`` (stable ranks) under ``uuid``; the others wait it out."""
    if me in members:
        store.set(f"h/{uuid}/{me}", dist._get_reconfigure_handle())
        store.wait([f"h/{uuid}/{m}" for m in members])
        handles = [store.get(f"h/{uuid}/{m}").decode() for m in members]
        dist._reconfigure(uuid, handles if ordered else set(handles)).wait()
        t = torch.ones(1)
        dist.all_reduce(t)
        out[str(uuid)] = {
            "rank": dist.get_rank(),
            "size": dist.get_world_size(),
            "sum": t.item(),
            "handle": dist._get_reconfigure_handle(),
        }
    store.set(f"stage/{uuid}/{me}", "1")
    store.wait([f"stage/{uuid}/{r}" for r in range(world)])


stage(1, [0, 1, 2])
stage(2, [0, 1, 2])
stage(3, [0, 2])
if me == 0:
    dist.send(torch.arange(3.0), dst=1)
elif me == 2:
    got = torch.zeros(3)
    dist.recv(got, src=0)
    out["received"] = got.tolist()
stage(4, [0, 1, 2], ordered=False)
stage(5, [0, 1])
if me == 0:
    try:
        dist._reconfigure(5, [dist._get_reconfigure_handle()]).wait()
    except RuntimeError as exc:
        out["reused"] = str(exc)
if me in (0, 1):  # rolled back: still the group of uuid 5
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after_refusal"] = [dist.get_rank(), dist.get_world_size(), t.item()]
stage(6, [0, 1])
stage(7, [2])
stage(8, [0, 1, 2])
for alone in range(world):
    stage(9 + alone, [alone])
stage(12, [0, 1, 2])
dist.group.WORLD.abort()
stage(13, [0, 1, 2])
sub = dist.new_group([0, 1, 2])
if me != 1:
    store.set(f"sub/{me}", dist._get_reconfigure_handle(sub))
    store.wait(["sub/0", "sub/2"])
    dist._reconfigure(1, [store.get(f"sub/{m}").decode() for m in (0, 2)], group=sub).wait()
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    out["sub"] = [sub.rank(), sub.size(), t.item(), dist.get_rank(), dist.get_world_size()]
store.set(f"subdone/{me}", "1")
store.wait([f"subdone/{r}" for r in range(world)])
out["dump"] = str(tether.dump(reason="reconfigured"))
print("RESULT " + json.dumps(out), flush=True)
store.set(f"exit/{me}", "1")
store.wait([f"exit/{r}" for r in range(world)])
