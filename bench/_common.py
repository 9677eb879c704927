"""What the benchmarks share: the environment their job processes run in, and how a spread of
repetitions is printed. Imported as ``_common`` (a benchmark runs as ``python bench/<name>.py``,
so this folder is on its path)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

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
