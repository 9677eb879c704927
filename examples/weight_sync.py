"""RL-style weight sync with ``tether.transport.fanout``: one trainer publishes its model's weights
after every optimizer step; inference hosts pull each version along a chain, so the trainer's
link carries the weights once however many hosts there are.

    python examples/weight_sync.py                     # a trainer and 3 hosts, on this host
    python examples/weight_sync.py --steps 5 --hosts 4

On a cluster, one process per host (the trainer hosts the store at its own address)::

    trainer$  python examples/weight_sync.py --role trainer --hosts 4 --host-store \
                  --store 10.0.0.1:29600 --host 10.0.0.1
    host k$   python examples/weight_sync.py --role inference --hosts 4 --index K \
                  --store 10.0.0.1:29600 --host <its address>

The trainer registers a packed copy of its ``state_dict`` once (``Publisher``) and, after each
step, ``publish()`` packs the new weights as the next version. Each inference host registers its
own model's ``state_dict`` (``Subscriber``) and ``pull()`` brings the newest version whole into
it: a host never serves from a mix of two updates, and one that dies is gone round by the next.
The model's ``steps_seen`` buffer is the version tag a host can check: it equals the version.

Here the trainer waits for every host to have each version before its next step, so that every
process prints the same digest for every step (``tests/transport/test_transport_example.py``
checks it); a real trainer goes on, and a host slower than its updates gets the newest.
Every process prints ``rank R step S sha256 DIGEST`` (the trainer is rank 0, host k rank k + 1).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.transport import TransportConfig
from tether.transport.fanout import Publisher, Subscriber

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


def trainer(store: TCPStore, args: argparse.Namespace) -> None:
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = model.state_dict()  # the optimizer updates these tensors in place
    config = TransportConfig(host=args.host, timeout=TIMEOUT.total_seconds())
    with Publisher(state, store=store, config=config) as pub:
        for _ in range(args.steps):
            loss = model(torch.randn(32, 256)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["steps_seen"] += 1
            version = pub.publish()
            print(f"rank 0 step {version} sha256 {digest(state)}", flush=True)
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while pub.pulled(version) < args.hosts:  # see the module's docstring
                if time.monotonic() > deadline:
                    raise SystemExit(f"trainer: version {version} reached only some hosts")
                time.sleep(0.01)
        store.wait(["hosts/done"], TIMEOUT)  # serve until the last host has the last version


def inference(store: TCPStore, args: argparse.Namespace) -> None:
    model = make_model(seed=args.index + 1)  # different weights until the first sync
    state = model.state_dict()
    config = TransportConfig(host=args.host, timeout=TIMEOUT.total_seconds())
    with Subscriber(state, store=store, index=args.index, config=config) as sub:
        while sub.version < args.steps:
            version = sub.pull()
            if int(state["steps_seen"]) != version:  # the version tag travels with the weights
                raise SystemExit(f"host {args.index}: version {version} mixed with another")
            with torch.no_grad():
                model(torch.randn(4, 256))  # serve with the new weights
            print(f"rank {args.index + 1} step {version} sha256 {digest(state)}", flush=True)
        if store.add("hosts/finished", 1) == args.hosts:
            store.set("hosts/done", "1")
        store.wait(["hosts/done"], TIMEOUT)  # the hosts after this one pull from it


def launch(args: argparse.Namespace) -> int:
    """Hosts the store and runs the trainer and every inference host on this host."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    common = ["--store", f"127.0.0.1:{store.port}", "--steps", str(args.steps)]
    common += ["--hosts", str(args.hosts)]
    roles = [["--role", "trainer"]]
    roles += [["--role", "inference", "--index", str(k)] for k in range(args.hosts)]
    procs = [subprocess.Popen([sys.executable, __file__, *common, *role]) for role in roles]
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
    parser.add_argument("--hosts", type=int, default=3, help="inference hosts")
    parser.add_argument("--role", choices=("trainer", "inference"))
    parser.add_argument("--index", type=int, default=0, help="an inference host's: 0, 1, ...")
    parser.add_argument("--store", help="ADDR:PORT of the store (the trainer hosts it)")
    parser.add_argument("--host", default="127.0.0.1", help="the address this process serves on")
    parser.add_argument("--host-store", action="store_true", help="host the store at --store")
    args = parser.parse_args()
    if args.role is None:
        raise SystemExit(launch(args))
    addr, port = args.store.rsplit(":", 1)
    store = TCPStore(
        addr, int(port), is_master=args.host_store, wait_for_workers=False, timeout=TIMEOUT
    )
    if args.role == "trainer":
        trainer(store, args)
    else:
        inference(store, args)


if __name__ == "__main__":
    main()
