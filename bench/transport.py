"""How fast ``tether.transport`` moves bytes between two processes, against what else could.

Run from the repository root::

    python bench/transport.py            # 5 fresh process pairs: about 1 minute on 2 cores
    python bench/transport.py --once     # one pair, its own table
    python bench/transport.py --quick    # a smoke run, numbers meaningless

In ONE run, between the same two processes (this one and a peer it starts, coordinated through a
TCPStore that carries no data), for 256 MiB and for 16 B, a write (this process's bytes into the
peer's) and a read (the peer's bytes into this process's):

- tether ``local``, ``tcp`` and ``nixl``, 16 B two ways: a registration of its own (16 bytes, in
  a page it shares with other allocations: the headline figure, the worst case of ``local``)
  and 16 bytes in the middle of the 256 MiB registration (``in buffer``: how small messages move
  through a registered arena or KV cache; the peer's checksum covers those bytes too);
- NIXL used directly (its own API, a transfer handle prepared once and reposted: NIXL's best
  case; same agent settings as tether's ``nixl`` backend);
- gloo ``send``/``recv`` (a write ends when the peer has received it and acknowledged with 1 B;
  16 B: ping-pong round trip);
- a plain loopback socket (``sendall`` / ``recv_into`` in 8 MiB pieces with 8 MiB socket buffers
  and TCP_NODELAY; a write ends with a 1 B acknowledgement; 16 B: ping-pong);
- an in-process ``memcpy``: ``torch`` ``copy_`` into warm pages (the ceiling of any copy);
  ``local_vs_memcpy`` pairs each ``local`` 256 MiB transfer with such a copy just after it and
  takes the median of the pairs' ratios (torch's copy runs on every core, so measured apart the
  two moved with whatever else the machine did).

256 MiB figures are the median GB/s of ``--reps`` transfers after one warm-up; 16 B figures the
p50 (and p99) of ``--small`` sync transfers. Every path's data is verified: a checksum of the
peer's buffer after the writes, an exact compare after the reads. The last line of output is one
JSON object; ratios compare the worse of the two directions.

The whole run is repeated in ``--pairs`` fresh pairs of processes (a process on these VMs runs
either at full speed or about 1.7x slower throughout, and which it gets is not reproducible):
each figure is reported as its median and spread over the pairs, and a ratio whose spread
exceeds 20 % of its median as unresolved (its median null in the JSON line), not as a figure; a
latency's goal is checked on every pair.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import env, figure, spread  # noqa: E402

import tether.transport as tt  # noqa: E402

BIG = 256 << 20
SMALL = 16
PIECE = 8 << 20
TIMEOUT = timedelta(seconds=120)
TETHER = ("local", "tcp", "nixl")
GOALS: list[tuple[str, str, Callable[[float], bool]]] = [
    ("local_vs_nixl >= 1.5", "local_vs_nixl", lambda x: x >= 1.5),
    ("local_p50_us_16b <= 5", "local_p50_us_16b", lambda x: x <= 5),
    ("tcp_p50_us_16b <= 30", "tcp_p50_us_16b", lambda x: x <= 30),
]


def pattern(seed: int) -> torch.Tensor:
    return torch.arange(BIG // 8, dtype=torch.int64) * 2654435761 + seed


def checksum(t: torch.Tensor) -> int:
    return int(t.view(torch.int64).sum())  # wraps identically on both sides


def nixl_agent(name: str) -> Any:
    from tether.transport import nixl

    api = nixl._import()
    return api, nixl._new_agent(api, name, ["UCX"], tt.TransportConfig().nixl_progress_us)


def recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got : got + PIECE])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIECE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIECE)


# -- the peer -----------------------------------------------------------------------------------


def peer(store: Any, args: argparse.Namespace) -> None:
    target = torch.zeros(BIG // 8, dtype=torch.int64)
    target.fill_(0)  # warm pages
    small = torch.zeros(SMALL, dtype=torch.uint8)
    store.set("peer/ready", "1")
    for name in TETHER:
        if name not in tt.supported_transports():
            continue
        t = tt.new_transport(name)
        store.set(f"{name}/url/1", t.bind())
        t.connect(store.get(f"{name}/url/0"))
        big_m, small_m = t.register_memory(target), t.register_memory(small)
        descs = [m.to_remote_buffer().serialize().decode() for m in (big_m, small_m)]
        store.set(f"{name}/desc", json.dumps(descs))
        store.wait([f"{name}/written"], TIMEOUT)
        store.set(f"{name}/sum", str(checksum(target)))
        store.wait([f"{name}/done"], TIMEOUT)
        t.close()
        target.fill_(0)
    if "nixl" in tt.supported_transports():
        _, agent = nixl_agent("bench-peer")
        regs = [agent.register_memory(x) for x in (target, small)]
        store.set("nixl-direct/md", agent.get_agent_metadata())
        store.set("nixl-direct/addr", json.dumps([target.data_ptr(), small.data_ptr()]))
        store.wait(["nixl-direct/written"], TIMEOUT)
        store.set("nixl-direct/sum", str(checksum(target)))
        store.wait(["nixl-direct/done"], TIMEOUT)
        for reg in regs:
            agent.deregister_memory(reg)
        del agent
        target.fill_(0)
    # gloo
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=1, world_size=2, timeout=TIMEOUT
    )
    ack = torch.zeros(1, dtype=torch.uint8)
    for _ in range(args.reps + 1):  # writes
        dist.recv(target, 0)
        dist.send(ack, 0)
    store.set("gloo/sum", str(checksum(target)))
    for _ in range(args.reps + 1):  # reads
        dist.recv(ack, 0)
        dist.send(target, 0)
    for _ in range(args.small + 100):
        dist.recv(small, 0)
        dist.send(small, 0)
    dist.destroy_process_group()
    target.fill_(0)
    # plain socket
    server = socket.create_server(("127.0.0.1", 0))
    store.set("socket/port", str(server.getsockname()[1]))
    conn, _ = server.accept()
    tune(conn)
    mv = memoryview(target.numpy()).cast("B")
    for _ in range(args.reps + 1):
        recv_exact(conn, mv)
        conn.sendall(b"k")
    store.set("socket/sum", str(checksum(target)))
    one = bytearray(1)
    for _ in range(args.reps + 1):
        recv_exact(conn, memoryview(one))
        conn.sendall(mv)
    buf = memoryview(bytearray(SMALL))
    for _ in range(args.small + 100):
        recv_exact(conn, buf)
        conn.sendall(buf)
    conn.close()
    server.close()


# -- the measuring side -------------------------------------------------------------------------


def gbps(times: list[float]) -> float:
    return BIG / statistics.median(times) / 1e9


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def latency(fn: Callable[[], object], n: int) -> tuple[float, float]:
    for _ in range(100):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    out.sort()
    return out[n // 2] * 1e6, out[int(n * 0.99)] * 1e6


def expect(what: str, ok: bool) -> None:
    if not ok:
        raise SystemExit(f"DATA MISMATCH: {what}")


def measure(store: Any, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    src = pattern(7)
    dst = torch.zeros_like(src)
    dst.fill_(0)
    src_sum = checksum(src)
    mid = BIG // 2  # the start of a large allocation shares its page with malloc's header
    s_src = torch.arange(SMALL, dtype=torch.uint8)
    # The 16 B "in buffer" writes put s_src in the middle of the peer's 256 MiB: its checksum
    # then differs from src's by exactly that (a write that lands elsewhere changes it too).
    mid_sum, s_sum = checksum(src.view(torch.uint8)[mid : mid + SMALL]), checksum(s_src)
    s_dst = torch.zeros(SMALL, dtype=torch.uint8)
    res: dict[str, dict[str, float]] = {}

    def record(
        name: str, w: list[float], r: list[float], ws: Any, rs: Any, inbuf: Any = None
    ) -> None:
        res[name] = {
            "write_gbps": gbps(w),
            "read_gbps": gbps(r),
            "write_p50_us_16b": ws[0],
            "write_p99_us_16b": ws[1],
            "read_p50_us_16b": rs[0],
            "read_p99_us_16b": rs[1],
        }
        if inbuf is not None:
            res[name]["in_buffer_p50_us_16b"] = max(inbuf[0][0], inbuf[1][0])
        print(f"  {name}: done", file=sys.stderr, flush=True)

    def two_sided(
        name: str,
        key: str,
        write: Callable[[], None],
        read: Callable[[], None],
        ping: Callable[[], None],
    ) -> None:
        """A path where the peer takes part (gloo, the plain socket): the 16 B figure is a
        round trip, so it stands for both directions."""
        w = timed(write, args.reps)
        expect(f"{name} write", int(store.get(f"{key}/sum")) == src_sum)
        r = timed(read, args.reps)
        expect(f"{name} read", torch.equal(dst, src))
        ws = latency(ping, args.small)
        expect(f"{name} 16 B", torch.equal(s_dst, s_src))
        record(name, w, r, ws, ws)
        dst.fill_(0)
        s_dst.zero_()

    def pair_with_memcpy(transfer: Callable[[], object]) -> float:
        """The median of ``args.reps`` ratios, each a transfer's time over an in-process copy's
        just after it: the two in the same conditions (torch's copy runs on every core, so
        either alone moves with what else the machine is doing: 0.5x to 4.8x apart between
        runs when measured minutes apart)."""
        ratios = []
        for _ in range(args.reps):
            start = time.perf_counter()
            transfer()
            moved = time.perf_counter() - start
            start = time.perf_counter()
            dst.copy_(src)
            ratios.append((time.perf_counter() - start) / moved)
        return statistics.median(ratios)

    paired: dict[str, float] = {}
    # memcpy, once the peer has started (its imports would take CPU from the copy)
    store.wait(["peer/ready"], TIMEOUT)
    w = timed(lambda: dst.copy_(src), args.reps)
    expect("memcpy", torch.equal(dst, src))
    ws = latency(lambda: s_dst.copy_(s_src), args.small)
    record("memcpy", w, w, ws, ws)
    dst.fill_(0)

    for name in TETHER:
        if name not in tt.supported_transports():
            print(f"  {name}: not available, skipped", file=sys.stderr)
            continue
        t = tt.new_transport(name)
        store.set(f"{name}/url/0", t.bind())
        t.connect(store.get(f"{name}/url/1"))
        big, small = (
            tt.RemoteRange.deserialize(d.encode()) for d in json.loads(store.get(f"{name}/desc"))
        )
        sm, dm = t.register_memory(src), t.register_memory(dst)
        ssm, sdm = t.register_memory(s_src), t.register_memory(s_dst)
        sv, dv, ssv, sdv = sm.to_view(), dm.to_mutable_view(), ssm.to_view(), sdm.to_mutable_view()
        head, hsv, hdv = (
            big.view(mid, SMALL),
            sm.to_view(mid, SMALL),
            dm.to_mutable_view(mid, SMALL),
        )
        w = timed(lambda t=t, sv=sv, big=big: t.write(sv, big), args.reps)
        if name == "local":
            paired["write"] = pair_with_memcpy(lambda t=t, sv=sv, big=big: t.write(sv, big))
        ws = latency(lambda t=t, ssv=ssv, small=small: t.write(ssv, small), args.small)
        wi = latency(lambda t=t, ssv=ssv, head=head: t.write(ssv, head), args.small)
        store.set(f"{name}/written", "1")
        expect(f"{name} write", int(store.get(f"{name}/sum")) == src_sum - mid_sum + s_sum)
        t.write(hsv, head)  # the bulk read below expects src's own bytes there again
        r = timed(lambda t=t, dv=dv, big=big: t.read(dv, big), args.reps)
        expect(f"{name} read", torch.equal(dst, src))
        if name == "local":
            paired["read"] = pair_with_memcpy(lambda t=t, dv=dv, big=big: t.read(dv, big))
        rs = latency(lambda t=t, sdv=sdv, small=small: t.read(sdv, small), args.small)
        expect(f"{name} 16 B read", torch.equal(s_dst, s_src))
        words = slice(mid // 8, (mid + SMALL) // 8)
        dst[words].zero_()
        ri = latency(lambda t=t, hdv=hdv, head=head: t.read(hdv, head), args.small)
        expect(f"{name} 16 B read in buffer", torch.equal(dst[words], src[words]))
        store.set(f"{name}/done", "1")
        t.close()
        record(name, w, r, ws, rs, (wi, ri))
        if name == "local":
            res[name]["vs_memcpy_paired"] = min(paired.values())
        dst.fill_(0)
        s_dst.zero_()

    if "nixl" in tt.supported_transports():
        _, agent = nixl_agent("bench-main")
        regs = [agent.register_memory(x) for x in (src, dst, s_src, s_dst)]
        remote = agent.add_remote_agent(store.get("nixl-direct/md"))
        r_big, r_small = json.loads(store.get("nixl-direct/addr"))

        def handle(op: str, local: torch.Tensor, raddr: int) -> Any:
            n = local.numel() * local.element_size()
            return agent.initialize_xfer(
                op,
                agent.get_xfer_descs([(local.data_ptr(), n, 0)], "DRAM"),
                agent.get_xfer_descs([(raddr, n, 0)], "DRAM"),
                remote,
            )

        def run(h: Any) -> None:
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer failed: {state}")

        hs = [
            handle("WRITE", src, r_big),
            handle("WRITE", s_src, r_small),
            handle("READ", dst, r_big),
            handle("READ", s_dst, r_small),
        ]
        w = timed(lambda: run(hs[0]), args.reps)
        ws = latency(lambda: run(hs[1]), args.small)
        store.set("nixl-direct/written", "1")
        expect("nixl direct write", int(store.get("nixl-direct/sum")) == src_sum)
        r = timed(lambda: run(hs[2]), args.reps)
        expect("nixl direct read", torch.equal(dst, src))
        rs = latency(lambda: run(hs[3]), args.small)
        expect("nixl direct 16 B read", torch.equal(s_dst, s_src))
        for h in hs:
            agent.release_xfer_handle(h)
        for reg in regs:
            agent.deregister_memory(reg)
        agent.remove_remote_agent(remote)
        store.set("nixl-direct/done", "1")
        record("nixl direct", w, r, ws, rs)
        dst.fill_(0)
        s_dst.zero_()

    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=0, world_size=2, timeout=TIMEOUT
    )
    ack = torch.zeros(1, dtype=torch.uint8)

    def g_write() -> None:
        dist.send(src, 1)
        dist.recv(ack, 1)

    def g_read() -> None:
        dist.send(ack, 1)
        dist.recv(dst, 1)

    def g_ping() -> None:
        dist.send(s_src, 1)
        dist.recv(s_dst, 1)

    two_sided("gloo send/recv", "gloo", g_write, g_read, g_ping)
    dist.destroy_process_group()

    sock = socket.create_connection(("127.0.0.1", int(store.get("socket/port"))))
    tune(sock)
    src_mv = memoryview(src.numpy()).cast("B")
    dst_mv = memoryview(dst.numpy()).cast("B")
    one = memoryview(bytearray(1))
    s_src_mv = memoryview(s_src.numpy()).cast("B")
    s_dst_mv = memoryview(s_dst.numpy()).cast("B")

    def s_write() -> None:
        sock.sendall(src_mv)
        recv_exact(sock, one)

    def s_read() -> None:
        sock.sendall(b"r")
        recv_exact(sock, dst_mv)

    def s_ping() -> None:
        sock.sendall(s_src_mv)
        recv_exact(sock, s_dst_mv)

    two_sided("socket", "socket", s_write, s_read, s_ping)
    sock.close()
    return res


def summary(res: dict[str, dict[str, float]]) -> dict[str, Any]:
    def worst(name: str) -> float:
        return min(res[name]["write_gbps"], res[name]["read_gbps"])

    def ratio(a: str, b: str) -> float | None:
        if a not in res or b not in res:
            return None
        return round(min(res[a][k] / res[b][k] for k in ("write_gbps", "read_gbps")), 2)

    def p50(name: str) -> float | None:
        if name not in res:
            return None
        return round(max(res[name]["write_p50_us_16b"], res[name]["read_p50_us_16b"]), 1)

    out: dict[str, Any] = {
        "local_vs_memcpy": (round(res["local"]["vs_memcpy_paired"], 2) if "local" in res else None),
        "local_vs_nixl": ratio("local", "nixl direct"),
        "local_vs_tether_nixl": ratio("local", "nixl"),
        "tcp_vs_socket": ratio("tcp", "socket"),
        "tcp_vs_gloo": ratio("tcp", "gloo send/recv"),
        "local_p50_us_16b": p50("local"),
        "tcp_p50_us_16b": p50("tcp"),
        "nixl_p50_us_16b": p50("nixl"),
        "nixl_direct_p50_us_16b": p50("nixl direct"),
        "socket_p50_us_16b": p50("socket"),
        "gloo_p50_us_16b": p50("gloo send/recv"),
    }
    for name in ("local", "tcp", "nixl"):
        if name in res:
            out[f"{name}_p50_us_16b_in_buffer"] = round(res[name]["in_buffer_p50_us_16b"], 1)
    out["gbps"] = {name: round(worst(name), 2) for name in res}
    return out


def once(args: argparse.Namespace) -> dict[str, Any]:
    """One pair of fresh processes: this one measures, a peer it starts serves."""
    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            *("--peer-port", str(store.port), "--reps", str(args.reps)),
            *("--small", str(args.small)),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        res = measure(store, args)
    finally:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\n{os.cpu_count()} CPUs, torch {torch.__version__}, {time.monotonic() - started:.0f} s")
    head = f"{'path':<16}{'write GB/s':>11}{'read GB/s':>10}{'16 B write p50/p99 us':>23}"
    print(head + f"{'16 B read p50/p99 us':>22}{'in buffer p50 us':>18}")
    for name, r in res.items():
        inbuf = r.get("in_buffer_p50_us_16b")
        print(
            f"{name:<16}{r['write_gbps']:>11.2f}{r['read_gbps']:>10.2f}"
            f"{r['write_p50_us_16b']:>14.1f} / {r['write_p99_us_16b']:<7.0f}"
            f"{r['read_p50_us_16b']:>13.1f} / {r['read_p99_us_16b']:<7.0f}"
            f"{'-' if inbuf is None else f'{inbuf:.1f}':>12}"
        )
    return summary(res)


def pairs(args: argparse.Namespace) -> None:
    """``--pairs`` runs of :func:`once`, each in a fresh pair of processes; every figure with
    its spread over them (unresolved past 20 % of its median)."""
    runs: list[dict[str, Any]] = []
    argv = [
        sys.executable,
        __file__,
        "--once",
        "--reps",
        str(args.reps),
        "--small",
        str(args.small),
    ]
    for k in range(args.pairs):
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env=env(), check=False
        )
        lines = out.stdout.strip().splitlines()
        if out.returncode or not lines or not lines[-1].startswith("{"):
            raise SystemExit(f"pair {k + 1} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
        runs.append(json.loads(lines[-1]))
        print(f"pair {k + 1} of {args.pairs}: {lines[-1]}", flush=True)
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    figures: dict[str, Any] = {"pairs": args.pairs}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            figures[key] = figure(values, 2, ratio="_p50_" not in key)
    figures["goals"] = {
        what: f"met in {sum(check(r[key]) for r in runs if r.get(key) is not None)} of "
        f"{sum(r.get(key) is not None for r in runs)} pairs"
        for what, key, check in GOALS
    }
    paths = sorted({name for r in runs for name in r["gbps"]})
    figures["gbps"] = {
        name: figure([r["gbps"][name] for r in runs if name in r["gbps"]], 2) for name in paths
    }
    print(
        f"\n{args.pairs} fresh process pairs; median [min-max]; * unresolved ratio (spread > 20 %)"
    )
    print(f"{'figure':<28}{'median [min-max]':>28}")
    for key in keys:
        if key in figures:
            values = [r[key] for r in runs if r.get(key) is not None]
            mark = "" if figures[key]["resolved"] else " *"
            print(f"{key:<28}{spread(values, '{:.2f}') + mark:>28}")
    for name in paths:
        values = [r["gbps"][name] for r in runs if name in r["gbps"]]
        mark = "" if figures["gbps"][name]["resolved"] else " *"
        print(f"{name + ' GB/s (worse way)':<28}{spread(values, '{:.2f}') + mark:>28}")
    for what, verdict in figures["goals"].items():
        print(f"goal {what}: {verdict}")
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="fresh process pairs")
    parser.add_argument("--reps", type=int, default=5, help="256 MiB transfers per direction")
    parser.add_argument("--small", type=int, default=2000, help="16 B transfers per direction")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 pair, 1 rep")
    parser.add_argument("--once", action="store_true", help="one pair, its own table")
    parser.add_argument("--peer-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.reps, args.small = 1, 1, 200
    if args.peer_port is not None:
        store = dist.TCPStore("127.0.0.1", args.peer_port, is_master=False, timeout=TIMEOUT)
        peer(store, args)
    elif args.once:
        print(json.dumps(once(args)))
    else:
        pairs(args)


if __name__ == "__main__":
    main()
