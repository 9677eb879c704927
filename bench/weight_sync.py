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
- **fanout, a host killed**: the same, the first host of the chain SIGKILLed half way through
  the version (the others go round it): the others' last ``pull()``;
- **one-to-one**: every host reads node 0's bytes at once with tether's ``tcp`` backend (what
  torch 2.15's transport API offers: transfers between pairs; node 0's link carries every copy);
- **gloo broadcast**: ``dist.broadcast`` of the same bytes (one flat tensor) from node 0 to the
  H hosts in a gloo group of H + 1, from the call to the last rank's return.

Every host's bytes are checked against node 0's (a sum of the tensors). torch 2.15.0's own
transport ships one backend, NIXL (the tcp backend its registry lists here is tether's, through
the entry point): not run on the simulated nodes; its API moves bytes pair by pair, as the
one-to-one row does.
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


def run(
    cluster: SimCluster, mode: str, nodes: int, mb: float, timeout: float, *extra: str
) -> list[dict]:
    """One repetition of ``mode`` on nodes 0..nodes-1: every node's RESULT, by node (a host
    told to die, ``--kill-host K``, left out)."""
    killed = {int(x.split("=")[1]) for x in extra if x.startswith("--kill-host=")}
    store = f"{cluster.nodes[0].address}:{PORT}"
    procs = []
    for k in range(nodes):
        node = cluster.nodes[k]
        argv = [
            sys.executable, str(WORKER), f"--mode={mode}", f"--index={k}", f"--nodes={nodes}",
            f"--store={store}", f"--host={node.address}", f"--mb={mb}", *extra,
        ]  # fmt: skip
        procs.append(
            cluster.start(node, argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    results, logs = [], []
    deadline = time.monotonic() + timeout
    for k, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"{mode}: a node did not finish in {timeout:g} s") from None
        text = out.decode(errors="replace")
        logs.append(text)
        if k in killed:
            if proc.returncode != -9:  # it must have died in the middle, as told
                raise SystemExit(f"{mode}: host {k} was to die: {proc.returncode}\n{text}")
            continue
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
    link_frac: list[float] = []
    times: dict[str, list[float]] = {"fanout": [], "killed": [], "star": [], "gloo": []}
    mid = 1  # the host killed half way through: the first of the chain, the others behind it
    with simulated_cluster(args.hosts + 1) as cluster:
        for node in cluster.nodes:
            cluster.limit_rate(node, args.rate)
        for rep in range(args.reps):
            r = run(cluster, "link", 2, args.mb, timeout)
            link_frac.append(nbytes * 8 / r[1]["s"] / args.rate)
            for name, mode, extra in (
                ("fanout", "fanout", ()),
                ("killed", "fanout", (f"--kill-host={mid}",) if args.hosts > 1 else ()),
                ("star", "star", ()),
                ("gloo", "gloo", ()),
            ):
                r = run(cluster, mode, args.hosts + 1, args.mb, timeout, *extra)
                start = r[0]["start"] if "start" in r[0] else min(x["start"] for x in r[1:])
                times[name].append(max(x["end"] for x in r[1:]) - start)
            print(
                f"rep {rep + 1}: link {link_frac[-1]:.3f} of the rate, "
                + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()),
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
    fan_s = times["fanout"]
    fan = [t / floor_s for t in fan_s]
    vs_gloo = [f / g for f, g in zip(fan_s, times["gloo"], strict=True)]
    vs_star = [f / g for f, g in zip(fan_s, times["star"], strict=True)]
    killed = [k / f for k, f in zip(times["killed"], fan_s, strict=True)]
    gb = nbytes / 1e9
    link_s = [nbytes * 8 / (f * args.rate) for f in link_frac]
    rows = [
        ("tcp read, node 0 -> node 1", link_s),
        (f"fanout to {args.hosts} hosts", fan_s),
        (f"fanout, host 1 killed half way: the {args.hosts - 1} others", times["killed"]),
        ("every host reads from node 0 (one-to-one, tether tcp)", times["star"]),
        (f"gloo broadcast to {args.hosts} hosts", times["gloo"]),
    ]
    print(
        f"\n{gb:.2f} GB from node 0 to {args.hosts} hosts, links at {args.rate / 1e9:g} Gb/s "
        f"(bytes / rate = {floor_s:.2f} s), {args.reps} repetition(s), fresh processes each"
    )
    print("| path | seconds | x bytes / link rate |\n| --- | --- | --- |")
    for name, seconds in rows:
        print(
            f"| {name} | {spread(seconds, '{:.2f}')} | {spread([x / floor_s for x in seconds])} |"
        )
    for rate, fractions in by_rate.items():
        print(f"tcp read at {rate / 1e9:g} Gb/s: {spread(fractions)} of the link's rate")
    print(f"fanout / gloo broadcast: {spread(vs_gloo)}; fanout / one-to-one: {spread(vs_star)}")
    print(f"fanout with a host killed / without: {spread(killed)}")
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
        "sync_vs_one_to_one": figure(vs_star),
        "sync_host_killed_vs_not": figure(killed),
        "seconds": {name: [round(x, 3) for x in t] for name, t in times.items()},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
