"""16 B transfers only: tether ``local`` and ``tcp`` (busy polling on and off) against a plain
socket ping-pong, each in a fresh pair of processes, rounds interleaved.

Run from the repository root::

    python bench/transport_small.py              # about 30 s
    python bench/transport_small.py --rounds 2   # quicker

``bench/transport.py`` measures 16 B in the same processes as its 256 MiB transfers; this one
isolates the small path, and alternates the configurations so that a slow spell of the machine
hits them all. Each figure is the p50 of ``--small`` sync transfers, the worse of write and read
(data verified: a read of the peer's known bytes, then the written bytes read back); the table
shows the median and range over rounds. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transport import latency  # noqa: E402  (bench/transport.py, beside this file)

import tether.transport as tt  # noqa: E402

SMALL = 16
ARENA = 1 << 20
TIMEOUT = timedelta(seconds=60)
CONFIGS: dict[str, tuple[str, int]] = {  # name: (backend, busy_poll_us)
    "local": ("local", 50),
    "tcp": ("tcp", 50),
    "tcp, busy_poll_us=0": ("tcp", 0),
}


def peer(store: Any, which: str) -> None:
    """The far side of one configuration: registers 16 B and a 1 MiB arena, or echoes 16 B."""
    if which == "socket":
        server = socket.create_server(("127.0.0.1", 0))
        store.set("port", str(server.getsockname()[1]))
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(SMALL)
        while got := conn.recv_into(buf):
            conn.sendall(buf[:got])
        return
    backend, busy = CONFIGS[which]
    t = tt.new_transport(backend, config=tt.TransportConfig(busy_poll_us=busy))
    store.set("url/1", t.bind())
    t.connect(store.get("url/0"))
    own = t.register_memory(torch.arange(SMALL, dtype=torch.uint8))
    arena = t.register_memory(torch.arange(ARENA, dtype=torch.int64).to(torch.uint8))
    descs = [m.to_remote_buffer().serialize().decode() for m in (own, arena)]
    store.set("desc", json.dumps(descs))
    store.wait(["done"], TIMEOUT)
    t.close()


def measure(which: str, n: int) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", which, "--port", str(store.port)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        if which == "socket":
            sock = socket.create_connection(("127.0.0.1", int(store.get("port"))))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out, back = bytes(range(SMALL)), bytearray(SMALL)

            def ping() -> None:
                sock.sendall(out)
                got = 0
                while got < SMALL:
                    more = sock.recv_into(memoryview(back)[got:])
                    if not more:
                        raise SystemExit("socket peer closed the connection")
                    got += more

            p50 = latency(ping, n)[0]
            sock.close()
            if bytes(back) != out:
                raise SystemExit("DATA MISMATCH: socket")
            return {"own": p50}
        backend, busy = CONFIGS[which]
        t = tt.new_transport(backend, config=tt.TransportConfig(busy_poll_us=busy))
        store.set("url/0", t.bind())
        t.connect(store.get("url/1"))
        own, arena = (tt.RemoteRange.deserialize(d.encode()) for d in json.loads(store.get("desc")))
        src = t.register_memory(torch.full((SMALL,), 7, dtype=torch.uint8))
        dst = t.register_memory(torch.zeros(SMALL, dtype=torch.uint8))
        inside = arena.view(ARENA // 2, SMALL)  # fully covered pages: the mapped path of local
        sv, dv, res = src.to_view(), dst.to_mutable_view(), {}
        for name, remote in (("own", own), ("in_buffer", inside)):
            # A read of the peer's known bytes first: it proves the read addresses the right
            # range, and the write below is then checked through the same range.
            t.read(dv, remote)
            first = (remote.offset + torch.arange(SMALL)) % 256
            if not torch.equal(dst.tensor, first.to(torch.uint8)):
                raise SystemExit(f"DATA MISMATCH: {which} {name} (initial read)")
            w = latency(lambda remote=remote: t.write(sv, remote), n)[0]
            dst.tensor.zero_()
            r = latency(lambda remote=remote: t.read(dv, remote), n)[0]
            if not bool(dst.tensor.eq(7).all()):
                raise SystemExit(f"DATA MISMATCH: {which} {name}")
            res[name] = max(w, r)
        store.set("done", "1")
        t.close()
        return res
    finally:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small", type=int, default=2000, help="transfers per direction")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer is not None:
        peer(dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=TIMEOUT), args.peer)
        return
    names = [*CONFIGS, "socket"]
    got: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for _ in range(args.rounds):
        for name in names:
            for kind, p50 in measure(name, args.small).items():
                got[name].setdefault(kind, []).append(p50)
    print(f"\n{args.rounds} rounds, p50 of {args.small} transfers (worse of write and read), µs")
    print(f"{'path':<22}{'own registration':>26}{'inside 1 MiB':>26}")

    def cell(xs: list[float] | None) -> str:
        if not xs:
            return f"{'-':>26}"
        return f"{statistics.median(xs):>10.1f} ({min(xs):.1f}-{max(xs):.1f})".rjust(26)

    for name in names:
        print(f"{name:<22}{cell(got[name].get('own'))}{cell(got[name].get('in_buffer'))}")
    med = {
        f"{name.split(',')[0]}{'_no_busy_poll' if ',' in name else ''}_{kind}": round(
            statistics.median(xs), 1
        )
        for name in names
        for kind, xs in got[name].items()
    }
    print(json.dumps({"p50_us_16b": med, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
