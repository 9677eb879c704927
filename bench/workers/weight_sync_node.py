"""One node's process of ``bench/weight_sync.py``: a sync's publisher or subscriber, a gloo rank
broadcasting the same bytes, or one side of a bulk tcp read. Node 0's process hosts the store.
Prints ``RESULT <json>`` with wall-clock times (every node shares this machine's clock).

    --mode fanout|star|gloo|link   --index K (0: node 0)   --nodes N   --store ADDR:PORT
    --host ADDR (this node's)  --mb M   --kill-host K (fanout: host K dies half way)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tether.transport as tt  # noqa: E402
from tether.transport.fanout import Publisher, Subscriber  # noqa: E402

TIMEOUT = timedelta(seconds=300)


def weights(mb: float, seed: int) -> dict[str, torch.Tensor]:
    """A model's worth of bytes in a few tensors (float32), different on every side at first."""
    n = int(mb * (1 << 20)) // 4
    g = torch.Generator().manual_seed(seed)
    return {f"layer{k}.weight": torch.rand(n // 8, generator=g) for k in range(8)}


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in tensors.values()))


def fanout(args: argparse.Namespace, store: dist.Store, config: tt.TransportConfig) -> dict:
    if args.index == 0:
        tensors = weights(args.mb, 0)
        with Publisher(tensors, store=store, config=config) as pub:
            store.wait([f"ready/{k}" for k in range(1, args.nodes)], TIMEOUT)
            start = time.time()
            pub.publish()
            store.set("published", str(start))
            store.wait(["done"], TIMEOUT)
            return {"start": start, "sum": checksum(tensors)}
    tensors = weights(args.mb, args.index)
    hosts = args.nodes - 1 - (args.kill_host >= 1)
    with Subscriber(tensors, store=store, index=args.index - 1, config=config) as sub:
        if args.index == args.kill_host:  # dies half way through the version
            half = sub.chunks // 2
            threading.Thread(target=die_at, args=(sub, half), daemon=True).start()
        store.set(f"ready/{args.index}", "1")
        sub.pull(timeout=TIMEOUT.total_seconds())
        end = time.time()
        if store.add("pulled", 1) == hosts:
            store.set("done", "1")
        store.wait(["done"], TIMEOUT)  # serve the ones after this one until all have it
        return {"end": end, "sum": checksum(tensors)}


def die_at(sub: Subscriber, chunks: int) -> None:
    while int(sub._side.head[1]) < chunks:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)


def star(args: argparse.Namespace, store: dist.Store, config: tt.TransportConfig) -> dict:
    """Every host reads node 0's buffer whole, all at once (one-to-one transfers, as torch 2.15's
    transport API offers them: node 0's link carries every copy)."""
    data = weights(args.mb, args.index)
    flat = torch.cat([t.reshape(-1) for t in data.values()])
    if args.index == 0:
        t = tt.new_transport("tcp", config=config)
        store.set("url", t.bind())
        store.set("desc", t.register_memory(flat).to_remote_buffer().serialize())
        store.wait(["done"], TIMEOUT)
        return {"sum": float(flat.double().sum())}
    t = tt.new_transport("tcp", config=config)
    t.connect(store.get("url"))
    mem = t.register_memory(flat)
    remote = tt.RemoteRange.deserialize(store.get("desc"))
    store.add("ready", 1)
    while int(store.add("ready", 0)) < args.nodes - 1:  # every host starts at once
        time.sleep(0.001)
    start = time.time()
    t.read(mem.to_mutable_view(), remote)
    end = time.time()
    if store.add("pulled", 1) == args.nodes - 1:
        store.set("done", "1")
    t.close()
    return {"start": start, "end": end, "sum": float(flat.double().sum())}


def gloo(args: argparse.Namespace, store: dist.Store) -> dict:
    dist.init_process_group("gloo", store=store, rank=args.index, world_size=args.nodes)
    tensors = weights(args.mb, args.index)
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    dist.barrier()
    start = time.time()
    dist.broadcast(flat, src=0)
    end = time.time()
    dist.barrier()
    dist.destroy_process_group()
    return {"start": start, "end": end, "sum": float(flat.double().sum())}


def link(args: argparse.Namespace, store: dist.Store, config: tt.TransportConfig) -> dict:
    """Node 1 reads node 0's buffer whole with tether's tcp backend."""
    data = (
        torch.rand(int(args.mb * (1 << 20)) // 4)
        if args.index == 0
        else torch.zeros(int(args.mb * (1 << 20)) // 4)
    )
    t = tt.new_transport("tcp", config=config)
    store.set(f"url/{args.index}", t.bind())
    mem = t.register_memory(data)
    if args.index == 0:
        store.set("desc", mem.to_remote_buffer().serialize())
        store.wait(["done"], TIMEOUT)
        t.close()
        return {"sum": float(data.double().sum())}
    t.connect(store.get("url/0"))
    remote = tt.RemoteRange.deserialize(store.get("desc"))
    t.read(mem.to_mutable_view(0, 4096), remote.view(0, 4096))  # connections warm
    start = time.perf_counter()
    t.read(mem.to_mutable_view(), remote)
    seconds = time.perf_counter() - start
    store.set("done", "1")
    t.close()
    return {"s": seconds, "sum": float(data.double().sum())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("fanout", "gloo", "link", "star"), required=True)
    parser.add_argument("--kill-host", type=int, default=0, help="fanout: this host dies")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--mb", type=float, default=1024)
    parser.add_argument("--flows", type=int, default=4)
    args = parser.parse_args()
    addr, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        addr, int(port), is_master=args.index == 0, wait_for_workers=False, timeout=TIMEOUT
    )
    config = tt.TransportConfig(host=args.host, timeout=120, flows=args.flows)
    if args.mode == "fanout":
        result = fanout(args, store, config)
    elif args.mode == "star":
        result = star(args, store, config)
    elif args.mode == "gloo":
        result = gloo(args, store)
    else:
        result = link(args, store, config)
    print("RESULT " + json.dumps(result), flush=True)
    # Node 0 hosts the store: it leaves once everyone has read what it needs from it.
    alive = args.nodes - (args.kill_host >= 1)
    if store.add("left", 1) < alive and args.index == 0:
        while int(store.add("left", 0)) < alive:
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
