"""Rank 0's cluster page and ``/metrics/job`` at 64 to 1,024 ranks: answered from what rank 0
holds, against a round of asking every rank per request (what rank 0 did before, and what a
frontend that pulls each rank per request does).

    python bench/cluster_page.py [--ranks 64,256,1024] [--reps 3]

The ranks are simulated (``tether.testing.fleet``: 1,023 debug servers in one process, each
rank's ``/health`` and ``/metrics`` of a real rank's shape and size, 16 ranks to a node, one rank
holding the job back); rank 0 is tether's own ``Cluster`` and debug server. Each size runs in a
fresh process per repetition; per process:

- ``page``: ``GET /api/cluster?brief=1`` (what the page asks each refresh), median of 20;
- ``first``: the first such request after a quiet spell (it waits for a round);
- ``per request``: one round of asking every rank and the view built from it (the same code),
  median of 3: what each request cost before;
- ``drawn``: the page in headless Chromium, ``performance.now()`` when it first drew the job
  (navigation, the request and the drawing; Chromium's clock runs in virtual time between
  tasks, so this is the page's own work, not Chromium's start);
- ``metrics``: ``GET /metrics/job`` (folded per node above 64 ranks) against a round, parsing
  and writing every rank's samples per request, and the size of each answer.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import env, spread

PER_NODE = 16


def _get(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        body = response.read()
    return time.perf_counter() - start, body


def one(world: int) -> dict[str, Any]:
    """One size, measured in this process."""
    import torch.distributed as dist

    from tether.job.alarm import AlarmBoard
    from tether.server import DebugServer
    from tether.server.auth import Guard
    from tether.server.cluster import Cluster, fetch_health, fetch_metrics
    from tether.server.jobmetrics import job_exposition, parse_exposition
    from tether.server.web import App
    from tether.testing.fleet import FleetSpec, RankFleet, RankSource, host_of

    spec = FleetSpec(world=world, per_node=PER_NODE, culprit=world // 2 + 5)

    out: dict[str, Any] = {}
    board = AlarmBoard(dist.HashStore())  # type: ignore[attr-defined]
    with RankFleet(spec) as fleet, tempfile.TemporaryDirectory() as tmp:
        for rank, url in fleet.urls.items():
            board.publish_proc(rank, {"host": host_of(rank, PER_NODE), "debug_url": url})
        local = RankSource(spec)
        cluster = Cluster(
            board,
            local=local,
            rank=0,
            world_size=world,
            token=None,
            dump_dir=Path(tmp),
            job_id="bench",
        )
        server = DebugServer(App(cluster.routes(), Guard(None)), host="127.0.0.1", port=0)
        server.on_close.append(cluster.close)
        server.start()
        board.publish_proc(0, {"host": host_of(0, PER_NODE), "debug_url": server.url()})
        base = server.url()
        try:
            out["first_s"], body = _get(f"{base}/api/cluster?brief=1")
            out["page_s"] = statistics.median(
                _get(f"{base}/api/cluster?brief=1")[0] for _ in range(20)
            )
            out["page_bytes"] = len(body)
            view = json.loads(body)
            assert view["holding_back"][0]["rank"] == spec.culprit, view["holding_back"]

            rounds = []
            for _ in range(3):
                start = time.perf_counter()
                asked = cluster._ask_all(local.health, fetch_health)
                assert sum(h is not None for h, _ in asked.answers.values()) == world
                cluster.view(brief=True)  # built from the held round: the rest of a request
                rounds.append(time.perf_counter() - start)
            out["per_request_s"] = statistics.median(rounds)

            with tempfile.TemporaryDirectory() as profile:
                dom = subprocess.run(
                    [
                        "/usr/bin/chromium",
                        "--headless",
                        "--no-sandbox",
                        "--disable-gpu",
                        "--no-first-run",
                        "--disable-dev-shm-usage",
                        f"--user-data-dir={profile}",
                        "--virtual-time-budget=3000",
                        "--dump-dom",
                        f"{base}/",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                ).stdout
            drawn = re.search(r'data-first-drawn-ms="(\d+)"', dom)
            out["drawn_ms"] = int(drawn.group(1)) if drawn else None

            _get(f"{base}/metrics/job")  # the first scrape waits for a round
            out["metrics_s"] = statistics.median(_get(f"{base}/metrics/job")[0] for _ in range(5))
            out["metrics_bytes"] = len(_get(f"{base}/metrics/job")[1])
            out["metrics_rank_bytes"] = len(_get(f"{base}/metrics/job?by=rank")[1])
            start = time.perf_counter()
            texts = cluster._ask_all(local.metrics, fetch_metrics)
            parsed = {
                r: parse_exposition(t)[0] if t is not None else None
                for r, (t, _) in texts.answers.items()
            }
            job_exposition(parsed)
            out["metrics_per_request_s"] = time.perf_counter() - start
        finally:
            server.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    sizes = [int(n) for n in args.ranks.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for _ in range(args.reps):
        for n in sizes:
            done = subprocess.run(
                [sys.executable, __file__, "--one", str(n)],
                capture_output=True,
                text=True,
                timeout=600,
                env=env(),
                check=True,
            )
            runs[n].append(json.loads(done.stdout.splitlines()[-1]))

    def col(n: int, key: str) -> list[float]:
        return [r[key] for r in runs[n] if r.get(key) is not None]

    def med(n: int, key: str) -> float:
        return statistics.median(col(n, key))

    print(
        f"{'ranks':>6} {'page ms':>18} {'per request ms':>20} {'ratio':>6} {'first ms':>16} "
        f"{'drawn ms':>14} {'metrics ms':>16} {'per request ms':>18} {'KB':>6} {'by rank KB':>10}"
    )
    for n in sizes:
        print(
            f"{n:>6} {spread([v * 1e3 for v in col(n, 'page_s')], '{:.1f}'):>18} "
            f"{spread([v * 1e3 for v in col(n, 'per_request_s')], '{:.0f}'):>20} "
            f"{med(n, 'per_request_s') / med(n, 'page_s'):>5.0f}x "
            f"{spread([v * 1e3 for v in col(n, 'first_s')], '{:.0f}'):>16} "
            f"{spread(col(n, 'drawn_ms'), '{:.0f}'):>14} "
            f"{spread([v * 1e3 for v in col(n, 'metrics_s')], '{:.1f}'):>16} "
            f"{spread([v * 1e3 for v in col(n, 'metrics_per_request_s')], '{:.0f}'):>18} "
            f"{med(n, 'metrics_bytes') / 1e3:>6.0f} {med(n, 'metrics_rank_bytes') / 1e3:>10.0f}"
        )
    figures = {
        key: {str(n): round(med(n, key), 4) for n in sizes if col(n, key)}
        for key in (
            "page_s",
            "per_request_s",
            "first_s",
            "drawn_ms",
            "page_bytes",
            "metrics_s",
            "metrics_per_request_s",
            "metrics_bytes",
            "metrics_rank_bytes",
        )
    }
    print(json.dumps({"bench": "cluster_page", "reps": args.reps, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
