"""A recorded job issuing one of each common operation, then dumping.

Modes (--scenario):
  ops       every common collective, a send/recv pair, then two dumps
  wrap      more operations than the ring holds
  anysource rank 0 receives from whichever rank sends (recv/irecv without a source)
  monitored two monitored_barriers (synchronous, no work), then a dump
  formation rank 2 never joins the new group (it waits on the store instead)
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import _common
import torch
import torch.distributed as dist

import tether


def ops(args: argparse.Namespace) -> dict[str, object]:
    rank, world = args.rank, args.world_size
    t = torch.ones(4)
    dist.all_reduce(t)  # LINE:all_reduce
    dist.broadcast(t, src=0)
    out = torch.zeros(4 * world)
    dist.all_gather_into_tensor(out, torch.ones(4))
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.ones(2 * world))
    pair = dist.new_group([0, 1], group_desc="pair")
    dist.all_reduce(torch.ones(3, dtype=torch.float64), group=pair)
    if rank == 0:
        dist.send(torch.arange(5.0), dst=1)
    elif rank == 1:
        dist.recv(torch.zeros(5), src=0)
    dist.barrier()
    first = tether.dump(reason="manual")
    dist.all_reduce(t)
    second = tether.dump(reason="manual")
    return {"first": str(first), "second": str(second)}


def wrap(args: argparse.Namespace) -> dict[str, object]:
    t = torch.ones(1)
    for _ in range(50):
        dist.all_reduce(t)
    return {"dump": str(tether.dump(reason="wrap"))}


def pinned(args: argparse.Namespace) -> dict[str, object]:
    """Rank 1 posts a receive, then 40 all_reduces pass through a small ring: the receive, still
    in flight, stays in rank 1's dump; once it completed, the next dump drops it."""
    work = dist.irecv(torch.zeros(2), src=0) if args.rank == 1 else None
    for _ in range(40):
        dist.all_reduce(torch.ones(1))
    dumps = [tether.load_dump(tether.dump(reason="pinned"))]
    if work is not None:
        work.wait()
    else:
        dist.send(torch.ones(2), dst=1)
    dist.all_reduce(torch.ones(1))
    dumps.append(tether.load_dump(tether.dump(reason="pinned")))
    return {
        "dumps": [
            {
                "ids": [e["record_id"] for e in d["entries"]],
                "recvs": [e["state"] for e in d["entries"] if "recv" in e["profiling_name"]],
                "dropped": d["tether"]["dropped"],
            }
            for d in dumps
        ]
    }


def anysource(args: argparse.Namespace) -> dict[str, object]:
    t = torch.zeros(2)
    if args.rank == 1:
        dist.send(torch.ones(2), dst=0)
        dist.send(torch.ones(2), dst=0)
        return {}
    if args.rank != 0:
        return {}
    src = dist.recv(t)  # torch asks the work for its _source_rank()
    work = dist.irecv(t)
    assert work is not None
    work.wait()
    dump = tether.load_dump(tether.dump(reason="anysource"))
    return {
        "src": src,
        "source_rank": work._source_rank(),
        "op": int(work._get_op_type()),  # an int on torch 2.13
        "recvanysource": int(torch._C._distributed_c10d.OpType.RECVANYSOURCE),
        "ops": [e["profiling_name"] for e in dump["entries"]],
    }


def monitored(args: argparse.Namespace) -> dict[str, object]:
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    dump = tether.load_dump(tether.dump(reason="monitored"))
    return {"ops": [(e["profiling_name"], e["collective_seq_id"], e["state"])
                    for e in dump["entries"]]}  # fmt: skip


def formation(args: argparse.Namespace, store: dist.TCPStore) -> dict[str, object]:
    if args.rank == 2:
        # Stand in for a rank that never reaches new_group; released by the others' verdict.
        store.wait(["test/formation-done-0", "test/formation-done-1"], timedelta(seconds=60))
        return {"skipped": True}
    try:
        dist.new_group([0, 1, 2], timeout=timedelta(seconds=3))
    except tether.GroupFormationError as exc:
        store.set(f"test/formation-done-{args.rank}", "1")
        return {"error": str(exc), "missing": exc.missing_ranks}
    store.set(f"test/formation-done-{args.rank}", "1")
    return {"error": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="ops")
    parser.add_argument("--ring-size", type=int, default=None)
    args = _common.parse(parser)
    store = _common.init_recorded(args, ring_size=args.ring_size)
    if args.scenario == "formation":
        result = formation(args, store)
    else:
        scenarios = {
            "ops": ops,
            "wrap": wrap,
            "pinned": pinned,
            "anysource": anysource,
            "monitored": monitored,
        }
        result = scenarios[args.scenario](args)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
