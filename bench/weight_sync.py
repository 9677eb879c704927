"""One trainer's weights to several inference hosts over links of a set rate, on simulated nodes.

Run from the repository root, as root (simulated nodes are network namespaces)::

    python bench/weight_sync.py                    # 1 GiB to 4 hosts at 1 Gb/s, 3 reps: ~3 min
    python bench/weight_sync.py --quick            # 64 MiB, 1 rep: a smoke run

Nodes are ``tether.testing.nodes``' (a namespace per node on a bridge), each link shaped to
``--rate`` bits a second both ways (``tc tbf``). Node 0 holds the weights; nodes 1..H want them.
In each repetition, fresh processes, one per node:

- **link**: node 1 reads node 0's buffer of the same size with tether's ``tcp`` backend (its
  default 4 flows): the fraction of the link's rate a bulk transfer reaches, at ``--rate`` and
  again at each of ``--link-rates`` (10 Gb/s);
- **fanout**: ``tether.transport.fanout`` (node 0 publishes, each host pulls along the chain),
  from ``publish()`` to the last host's ``pull()`` returning; against bytes / link rate, the
  least any sync from node 0 can take;
- **gloo broadcast**: ``dist.broadcast`` of the same bytes (one flat tensor) from node 0 to the
  H hosts in a gloo group of H + 1, from the call to the last rank's return.

Every host's bytes are checked against node 0's (a sum of the tensors). torch 2.15's own
transport has no one-to-many path and is not on this machine's torch (2.13): not measured.
Each ratio is reported with its spread over the repetitions; a ratio whose spread exceeds 20 %
of its median is reported as unresolved (``_common.figure``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import REPO, env, figure, spread

sys.path.insert(0, str(REPO))

from tether.testing.nodes import SimCluster, simulated_cluster

WORKER = REPO / "bench" / "workers" / "weight_sync_node.py"
PORT = 29500


def run(cluster: SimCluster, mode: str, nodes: int, mb: float, timeout: float) -> list[dict]:
    """One repetition of ``mode`` on nodes 0..nodes-1: every node's RESULT, by node."""
    store = f"{cluster.nodes[0].address}:{PORT}"
    procs = []
    for k in range(nodes):
        node = cluster.nodes[k]
        argv = [
            sys.executable, str(WORKER), f"--mode={mode}", f"--index={k}", f"--nodes={nodes}",
            f"--store={store}", f"--host={node.address}", f"--mb={mb}",
        ]  # fmt: skip
        procs.append(
            cluster.start(node, argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    results, logs = [], []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"{mode}: a node did not finish in {timeout:g} s") from None
        text = out.decode(errors="replace")
        logs.append(text)
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{mode}: a node failed ({proc.returncode}):\n{text[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    sums = {round(r["sum"], 0) for r in results}
    if len(sums) != 1:
        raise SystemExit(f"{mode}: the hosts' bytes differ from node 0's: {sums}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--mb", type=float, default=1024)
    parser.add_argument("--rate", type=float, default=1e9, help="bits a second per link")
    parser.add_argument(
        "--link-rates", default="1e10", help="more rates (bits a second) to run the tcp read at"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.reps = 64, 1
    nbytes = int(args.mb * (1 << 20)) // 4 * 4
    floor_s = nbytes * 8 / args.rate  # the sender's link, once
    timeout = 30 + 3 * (args.hosts + 1) * floor_s
    link_frac, fan, gloo_s, fan_s = [], [], [], []
    with simulated_cluster(args.hosts + 1) as cluster:
        for node in cluster.nodes:
            cluster.limit_rate(node, args.rate)
        for rep in range(args.reps):
            r = run(cluster, "link", 2, args.mb, timeout)
            link_frac.append(nbytes * 8 / r[1]["s"] / args.rate)
            r = run(cluster, "fanout", args.hosts + 1, args.mb, timeout)
            fan_s.append(max(x["end"] for x in r[1:]) - r[0]["start"])
            fan.append(fan_s[-1] / floor_s)
            r = run(cluster, "gloo", args.hosts + 1, args.mb, timeout)
            gloo_s.append(max(x["end"] for x in r) - r[0]["start"])
            print(
                f"rep {rep + 1}: link {link_frac[-1]:.3f} of the rate, fanout {fan_s[-1]:.2f} s, "
                f"gloo broadcast {gloo_s[-1]:.2f} s",
                flush=True,
            )
        by_rate = {args.rate: link_frac}
        for rate in (float(x) for x in args.link_rates.split(",") if x):
            for node in cluster.nodes[:2]:
                cluster.limit_rate(node, rate)
            fractions = []
            for _ in range(args.reps):
                r = run(cluster, "link", 2, args.mb, 30 + 3 * nbytes * 8 / rate)
                fractions.append(nbytes * 8 / r[1]["s"] / rate)
            by_rate[rate] = fractions
            print(f"tcp read at {rate / 1e9:g} Gb/s: {spread(fractions)} of the rate", flush=True)
    vs_gloo = [f / g for f, g in zip(fan_s, gloo_s, strict=True)]
    gb = nbytes / 1e9
    link_s = [nbytes * 8 / (f * args.rate) for f in link_frac]
    rows = [
        ("tcp read, node 0 -> node 1", link_s, [1 / f for f in link_frac]),
        (f"fanout to {args.hosts} hosts", fan_s, fan),
        (f"gloo broadcast to {args.hosts} hosts", gloo_s, [g / floor_s for g in gloo_s]),
    ]
    print(
        f"\n{gb:.2f} GB from node 0 to {args.hosts} hosts, links at {args.rate / 1e9:g} Gb/s "
        f"(bytes / rate = {floor_s:.2f} s), {args.reps} repetition(s), fresh processes each"
    )
    print("| path | seconds | x bytes / link rate |\n| --- | --- | --- |")
    for name, seconds, against in rows:
        print(f"| {name} | {spread(seconds, '{:.2f}')} | {spread(against)} |")
    for rate, fractions in by_rate.items():
        print(f"tcp read at {rate / 1e9:g} Gb/s: {spread(fractions)} of the link's rate")
    print(f"fanout / gloo broadcast: {spread(vs_gloo)}")
    figures = {
        "bytes": nbytes,
        "hosts": args.hosts,
        "rate_bits_per_s": args.rate,
        "reps": args.reps,
        "tcp_link_fraction": figure(link_frac),
        "tcp_link_fraction_by_gbps": {f"{r / 1e9:g}": figure(f) for r, f in by_rate.items()},
        f"sync_{args.mb:g}mib_{args.hosts}hosts_vs_link": figure(fan),
        "sync_1g_4hosts_vs_link": figure(fan) if (args.hosts, args.mb) == (4, 1024) else None,
        "sync_vs_gloo_broadcast": figure(vs_gloo),
        "sync_s": [round(x, 3) for x in fan_s],
        "gloo_broadcast_s": [round(x, 3) for x in gloo_s],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
