"""RL-style weight sync with ``tether.transport``: one trainer pushes its model's weights straight
into two inference processes' memory after every optimizer step.

    python examples/weight_sync.py                  # 3 processes on this host, backend "auto"
    python examples/weight_sync.py --steps 5 --backend tcp

Each inference process registers the tensors of its own ``state_dict`` and publishes their
descriptors in the store; the trainer registers its ``state_dict``'s tensors (the optimizer
updates them in place, so the registration stays valid) and, after each step, writes all of them
into each inference process as one batch. Nothing runs on the inference side during the write.
The store carries only the control messages: "step N is in your memory" (with a digest, so each
process checks the weights arrived bit-exact) and "I have read step N" (so the trainer does not
overwrite weights that are being read; a real system would double-buffer instead).

Every process prints ``rank R step S sha256 DIGEST``;
``tests/transport/test_transport_example.py`` checks that the three agree at every step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tether.transport as tt

INFERENCE_RANKS = (1, 2)
TIMEOUT = timedelta(seconds=60)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.LayerNorm(512),
        torch.nn.Linear(512, 64),
    )
    model.register_buffer("steps_seen", torch.zeros(1, dtype=torch.int64))
    return model


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer(store: Store, steps: int, backend: str) -> None:
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = model.state_dict()
    peers = {}
    for rank in INFERENCE_RANKS:
        t = tt.new_transport_rank(
            backend, store=store, rank=0, peer_rank=rank, bootstrap_timeout=TIMEOUT
        )
        mine = [t.register_memory(state[name]).to_view() for name in sorted(state)]
        theirs = json.loads(store.get(f"weights/{rank}"))
        remote = [tt.RemoteRange.deserialize(theirs[name].encode()) for name in sorted(state)]
        peers[rank] = (t, mine, remote)
        print(f"trainer: rank {rank} over {t.name}", flush=True)
    for step in range(1, steps + 1):
        loss = model(torch.randn(32, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["steps_seen"] += 1
        # One batch per inference process, both in flight at once.
        works = [t.write(mine, remote, async_op=True) for t, mine, remote in peers.values()]
        for work in works:
            work.wait()
        d = digest(state)
        print(f"rank 0 step {step} sha256 {d}", flush=True)
        store.set(f"step/{step}", d)
        for rank in INFERENCE_RANKS:  # they have read it: the next write may overwrite it
            store.wait([f"ack/{step}/{rank}"], TIMEOUT)
    for t, _, _ in peers.values():
        t.close()
    store.set("done", "1")


def inference(store: Store, rank: int, steps: int, backend: str) -> None:
    model = make_model(seed=rank)  # different weights until the first sync
    state = model.state_dict()
    t = tt.new_transport_rank(
        backend, store=store, rank=rank, peer_rank=0, bootstrap_timeout=TIMEOUT
    )
    memories = {name: t.register_memory(tensor) for name, tensor in state.items()}
    descriptors = {name: m.to_remote_buffer().serialize().decode() for name, m in memories.items()}
    store.set(f"weights/{rank}", json.dumps(descriptors))
    for step in range(1, steps + 1):
        store.wait([f"step/{step}"], TIMEOUT)
        expected = store.get(f"step/{step}").decode()
        with torch.no_grad():
            model(torch.randn(4, 256))  # serve with the new weights
        d = digest(state)
        print(f"rank {rank} step {step} sha256 {d}", flush=True)
        if d != expected:
            raise SystemExit(f"rank {rank}: step {step} weights differ from the trainer's")
        store.set(f"ack/{step}/{rank}", "1")
    store.wait(["done"], TIMEOUT)  # the trainer no longer writes here
    t.close()


def launch(steps: int, backend: str) -> int:
    """Hosts the store and runs the trainer and both inference processes."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *("--rank", str(rank), "--port", str(store.port)),
                *("--steps", str(steps), "--backend", backend),
            ]
        )
        for rank in (0, *INFERENCE_RANKS)
    ]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=TIMEOUT.total_seconds() * 2))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return max(abs(code) for code in codes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="auto, local, tcp or nixl")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        raise SystemExit(launch(args.steps, args.backend))
    store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=TIMEOUT)
    if args.rank == 0:
        trainer(store, args.steps, args.backend)
    else:
        inference(store, args.rank, args.steps, args.backend)


if __name__ == "__main__":
    main()
