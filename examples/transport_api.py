"""torch 2.15's one-sided transport API, unchanged, on torch 2.13 and 2.14 through tether.

Two processes meet through a TCPStore (no process group, no collectives), each registers an inbox,
hands the other its descriptor, writes into the other's inbox, then reads it back asynchronously.
The program is written against ``torch.distributed._transport``; where torch has none (before
2.15) ``tether.transport`` stands in under the same name, ``_transport``.

    python examples/transport_api.py                       # backend "tether-tcp"
    python examples/transport_api.py --backend nixl        # the one backend torch 2.15 ships

``tether-tcp``, ``tether-local``, ``tether-nixl``, ``tcp`` and ``local`` are names both registries
know (tether's backends are entry points of ``torch.distributed.transports``; torch 2.15 ships
no ``tcp`` or ``local``); ``auto`` is tether's alone. Each process prints ``rank R: ok``;
tests/transport/test_transport_example.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch.distributed._transport as _transport  # type: ignore[import-not-found]
except ImportError:  # torch 2.13 / 2.14
    import tether.transport as _transport

TIMEOUT_S = 60.0


def run(rank: int, port: int, backend: str) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    peer = 1 - rank
    t = _transport.new_transport_rank(
        backend, "cpu", store=store, rank=rank, peer_rank=peer, bootstrap_timeout=TIMEOUT_S
    )
    with t:
        inbox = torch.zeros(1 << 16)
        mem = t.register_memory(inbox)
        store.set(f"inbox/{rank}", mem.to_remote_buffer().serialize())  # JSON, never pickle
        store.wait([f"inbox/{peer}"])
        # A descriptor is parsed by its backend's class: the one of our own registrations.
        remote = type(mem.to_remote_buffer()).deserialize(store.get(f"inbox/{peer}"))

        src = torch.full((1 << 16,), float(rank + 1))
        assert t.write(t.register_memory(src).to_view(), remote) == 0  # into the peer's inbox
        store.set(f"written/{rank}", "1")
        store.wait([f"written/{peer}"])
        assert torch.equal(inbox, torch.full((1 << 16,), float(peer + 1)))

        back = torch.empty(1 << 16)
        view = t.register_memory(back).to_mutable_view()
        work = t.read(view, remote, async_op=True)  # a torch.distributed.Work
        asyncio.run(_transport.wait_all([work], timeout=TIMEOUT_S))
        assert torch.equal(back, src)  # what we wrote, read back from the peer's inbox
        back.zero_()
        asyncio.run(t.read_async(view, remote, timeout=TIMEOUT_S))
        assert torch.equal(back, src)

        store.set(f"done/{rank}", "1")  # the peer may close: we no longer touch its memory
        store.wait([f"done/{peer}"])
    print(f"rank {rank}: ok over {backend} ({_transport.__name__})", flush=True)


def launch(backend: str) -> int:
    """Hosts the store and runs both ranks."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(r),
                "--port",
                str(store.port),
                "--backend",
                backend,
            ]
        )
        for r in (0, 1)
    ]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=2 * TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return max(abs(code) for code in codes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="tether-tcp")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        raise SystemExit(launch(args.backend))
    run(args.rank, args.port, args.backend)


if __name__ == "__main__":
    main()
