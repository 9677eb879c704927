"""One side of a ``tether.transport.fanout`` sync, for the tests: a publisher or a subscriber.

    --store HOST:PORT    the TCPStore the sides meet in (hosted by the test)
    --role publisher|subscriber, --index K (a subscriber's place in the chain)
    --host ADDR          the address this side serves from (its node's; loopback by default)
    --mb M               the tensors' size (a few tensors of float32 and one int64)
    --versions V         the publisher publishes V versions, each once every subscriber has the
                         one before (or --subscribers are known gone); a subscriber pulls V
    --die-at-chunk N     a subscriber SIGKILLs itself once it holds N chunks of version 2
    --kill-publisher-at N  a subscriber SIGKILLs the publisher once it holds N chunks of version 2
    --mark-at N --mark-file PATH  a subscriber writes PATH once it holds N chunks of version 2
    --retries N          a subscriber whose pull fails tries again, up to N times
    --io-timeout S       the transport's timeout (a link down that long is gone round)
    --host-store         the publisher hosts the store (at --store: its own address)
    --supersede          the publisher publishes each next version as soon as subscriber 0
                         holds 4 chunks of the one before (not once every subscriber has it);
                         subscribers pull until they have the last one

Each side prints ``<role> <index> version V sha256 DIGEST`` for every version it has whole, and a
subscriber whose pull fails prints ``subscriber K failed: <error>`` and its tensors' digest, then
exits 3. Version v's tensors are a function of v alone, so digests can be compared across sides.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: E402

from tether._exceptions import TransportError  # noqa: E402
from tether.transport import TransportConfig  # noqa: E402
from tether.transport.fanout import Publisher, Subscriber  # noqa: E402

CHUNK = 256 << 10


def weights(mb: float) -> dict[str, torch.Tensor]:
    n = max(int(mb * (1 << 20)) // 4 // 3, 1)
    return {
        "a.weight": torch.zeros(n),
        "b.weight": torch.zeros(n // 2, 2),
        "c.bias": torch.zeros(n - 7),
        "steps": torch.zeros(1, dtype=torch.int64),
    }


def fill(tensors: dict[str, torch.Tensor], version: int) -> None:
    for k, (_, tensor) in enumerate(sorted(tensors.items())):
        if tensor.dtype == torch.int64:
            tensor.fill_(version)
        else:
            g = torch.Generator().manual_seed(version * 100 + k)
            tensor.copy_(torch.rand(tensor.shape, generator=g))


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def watch(sub: Subscriber, chunks: int, act: Callable[[int], None], version: int = 2) -> None:
    """Runs ``act`` once the subscriber holds ``chunks`` chunks of ``version``."""

    def run() -> None:
        while True:
            now, have = int(sub._side.head[0]), int(sub._side.head[1])
            if now == version and have >= chunks:
                act(have)
                return
            time.sleep(0.0005)

    threading.Thread(target=run, name="fanout-fault", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--role", choices=("publisher", "subscriber"), required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--subscribers", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--mb", type=float, default=8)
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--die-at-chunk", type=int, default=0)
    parser.add_argument("--kill-publisher-at", type=int, default=0)
    parser.add_argument("--mark-at", type=int, default=0)
    parser.add_argument("--mark-file", default="")
    parser.add_argument("--retries", type=int, default=0)
    parser.add_argument("--io-timeout", type=float, default=10)
    parser.add_argument("--host-store", action="store_true")
    parser.add_argument("--supersede", action="store_true")
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = TCPStore(
        host,
        int(port),
        is_master=args.host_store,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout),
    )
    config = TransportConfig(host=args.host, timeout=args.io_timeout)
    tensors = weights(args.mb)
    if args.role == "publisher":
        with Publisher(tensors, store=store, config=config, chunk_bytes=CHUNK) as pub:
            store.set("publisher/pid", str(os.getpid()))
            for version in range(1, args.versions + 1):
                fill(tensors, version)
                made = digest(tensors)
                if args.supersede and version > 1:  # the next one ready: published at once
                    store.wait([f"holding/{version - 1}"], timedelta(seconds=args.timeout))
                pub.publish()
                print(f"publisher 0 version {version} sha256 {made}", flush=True)
                if args.supersede:
                    continue
                # The next version once every live subscriber has this one (the test says
                # which are gone), so each pulls every version.
                gone = int(store.add("gone", 0))
                deadline = time.monotonic() + args.timeout
                while pub.pulled(version) < args.subscribers - gone:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"publisher: version {version} was not pulled")
                    time.sleep(0.01)
                    gone = int(store.add("gone", 0))
            store.wait(["subscribers/done"], timedelta(seconds=args.timeout))
        return
    with Subscriber(tensors, store=store, index=args.index, config=config) as sub:
        if args.die_at_chunk:

            def die(have: int) -> None:
                print(f"subscriber {args.index} dies holding {have} of {sub.chunks}", flush=True)
                store.add("gone", 1)
                os.kill(os.getpid(), signal.SIGKILL)

            watch(sub, args.die_at_chunk, die)
        if args.kill_publisher_at:

            def kill_publisher(have: int) -> None:
                print(f"publisher killed at {have} of {sub.chunks}", flush=True)
                os.kill(int(store.get("publisher/pid")), signal.SIGKILL)

            watch(sub, args.kill_publisher_at, kill_publisher)
        if args.supersede and args.index == 0:
            for v in range(1, args.versions):
                watch(sub, 4, lambda _, v=v: store.set(f"holding/{v}", "1"), version=v)
        if args.mark_at:
            watch(sub, args.mark_at, lambda have: Path(args.mark_file).write_text(str(have)))
        failures = 0
        while sub.version < args.versions:
            try:
                version = sub.pull(timeout=args.timeout)
            except TransportError as exc:
                print(f"subscriber {args.index} failed: {type(exc).__name__}: {exc}", flush=True)
                print(f"subscriber {args.index} holds sha256 {digest(tensors)}", flush=True)
                failures += 1
                if failures <= args.retries:
                    continue
                with contextlib.suppress(RuntimeError):  # the store may be gone with its host
                    store.add("subscribers/left", 1)
                raise SystemExit(3) from None
            print(f"subscriber {args.index} version {version} sha256 {digest(tensors)}", flush=True)
        print(f"subscriber {args.index} superseded {sub.superseded}", flush=True)
        if int(store.add("subscribers/left", 1)) == args.subscribers - int(store.add("gone", 0)):
            store.set("subscribers/done", "1")
        # Serve the next ones until every subscriber is done.
        store.wait(["subscribers/done"], timedelta(seconds=args.timeout))


if __name__ == "__main__":
    main()
