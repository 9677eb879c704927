"""The far side of the transport contract tests: registers buffers and answers commands that the
test sets in the store (``cmd/N`` -> ``res/N``), so the test process can drive a real peer."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from tether.transport import TransportError, new_transport


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    args = parser.parse_args()
    store = dist.PrefixStore(
        args.prefix,
        dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=60)),
    )
    transport = new_transport(args.backend)
    store.set("url/peer", transport.bind())
    transport.connect(store.get("url/test"))
    memories = {}
    n = 0
    while True:
        n += 1
        cmd = json.loads(store.get(f"cmd/{n}"))
        result: object = None
        if cmd["op"] == "register":
            memory = transport.register_memory(pattern(cmd["nbytes"], cmd["seed"]))
            memories[memory.id] = memory
            result = memory.to_remote_buffer().serialize().decode()
        elif cmd["op"] == "digest":
            result = hashlib.sha256(memories[cmd["id"]].tensor.numpy().tobytes()).hexdigest()
        elif cmd["op"] == "unregister":
            try:
                transport.unregister_memory(memories[cmd["id"]])
                result = "ok"
            except TransportError as exc:
                result = f"{type(exc).__name__}: {exc}"
        elif cmd["op"] == "exit":
            store.set(f"res/{n}", json.dumps(None))
            transport.close()
            return
        store.set(f"res/{n}", json.dumps(result))


if __name__ == "__main__":
    main()
