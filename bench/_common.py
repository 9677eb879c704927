"""What the benchmarks share: the environment their job processes run in, and how a spread of
repetitions is printed. Imported as ``_common`` (a benchmark runs as ``python bench/<name>.py``,
so this folder is on its path)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def env(strip: tuple[str, ...] = ("TETHER_",), **extra: str) -> dict[str, str]:
    """This process's environment for a job: variables starting with ``strip`` left out (a
    benchmark sets what it measures), this checkout first on ``PYTHONPATH``, ``extra`` added."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(strip)}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    out.update(extra)
    return out


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """``median [min-max]`` of repetitions; the value alone for one, ``-`` for none."""
    if not values:
        return "-"
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


UNRESOLVED = 0.20
"""A figure whose repetitions spread wider than this fraction of their median is unresolved:
these machines are shared, and a ratio that moves that much between runs does not measure what
it names."""


def figure(values: list[float], digits: int = 3, *, ratio: bool = True) -> dict[str, Any]:
    """A figure over repetitions for the JSON line: its median, or None when a ratio is
    unresolved (see :data:`UNRESOLVED`), and its spread. A latency's median stands whatever
    its spread (its goal is checked on every repetition)."""
    median = statistics.median(values)
    resolved = not ratio or max(values) - min(values) <= UNRESOLVED * abs(median)
    return {
        "median": round(median, digits) if resolved else None,
        "spread": [round(min(values), digits), round(max(values), digits)],
        "resolved": resolved,
    }


def run_ranks(
    worker: Path, world: int, args: list[str], *, label: str, timeout: float = 300.0
) -> list[dict[str, Any]]:
    """``world`` fresh processes of ``worker`` (each gets ``--rank --world-size --port`` of a
    TCPStore hosted here, then ``args``), one thread each; every rank's ``RESULT <json>``, by
    rank. A failed or silent rank raises with every rank's log tail."""
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        0,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=120),
    )
    with tempfile.TemporaryDirectory(prefix=f"tether-bench-{label}-") as tmp:
        logs = [Path(tmp, f"rank_{r}.log") for r in range(world)]
        procs = []
        for rank, log in enumerate(logs):
            cmd = [
                sys.executable,
                str(worker),
                f"--rank={rank}",
                f"--world-size={world}",
                f"--port={store.port}",
                *args,
            ]
            with log.open("wb") as out:  # files, not pipes: a full pipe would stall a rank
                procs.append(
                    subprocess.Popen(cmd, env=env(OMP_NUM_THREADS="1"), stdout=out, stderr=out)
                )
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [None] * world
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        texts = [log.read_text(errors="replace") for log in logs]
    results = [
        json.loads(line.removeprefix("RESULT "))
        for text in texts
        for line in text.splitlines()
        if line.startswith("RESULT ")
    ]
    if codes != [0] * world or len(results) != world:
        tails = "\n".join(
            f"--- rank {r} (exit {c}):\n{t[-2000:]}"
            for r, (c, t) in enumerate(zip(codes, texts, strict=True))
        )
        raise RuntimeError(f"the {label} job failed:\n{tails}")
    return sorted(results, key=lambda r: r["rank"])
