"""One client of the job's etcd store, run on a simulated node: does what its arguments say and
prints one JSON line (the result, or the error's type and text).

    etcd_client.py URL PREFIX TIMEOUT cas KEY EXPECTED DESIRED
    etcd_client.py URL PREFIX TIMEOUT get KEY
    etcd_client.py URL PREFIX TIMEOUT group RANK WORLD   (a gloo group through the store; an
                                                           all_reduce of the ranks, printed)
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    url, prefix, timeout, op, *rest = sys.argv[1:]
    from tether.job.etcd import etcd_store

    store = etcd_store(url, prefix=prefix, timeout=float(timeout))
    started = time.monotonic()
    try:
        if op == "cas":
            result: object = store.compare_set(*rest).decode()
        elif op == "get":
            result = store.get(rest[0]).decode()
        elif op == "group":
            import torch
            import torch.distributed as dist

            rank, world = int(rest[0]), int(rest[1])
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total)
            dist.destroy_process_group()
            result = total.item()
        else:
            raise SystemExit(f"unknown op {op!r}")
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "text": str(exc),
                          "after_s": time.monotonic() - started}))  # fmt: skip
        return
    print(json.dumps({"ok": result, "after_s": time.monotonic() - started}))


if __name__ == "__main__":
    main()
