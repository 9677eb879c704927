"""Which format a dump's columns are kept in: read time and install weight, on one dump.

    python bench/column_format.py [--entries 2000] [--reps 7] [--reads 200]

One synthetic dump (``bench/analyze_speed.py``'s, as tether writes it: 2,000 entries, 12 frames
each) and its columns in each candidate format:

- ``npz (stdlib)``: tether's column file (numpy's archive format), read and checked whole by
  ``tether.events.columns.read_columns`` with the standard library alone;
- ``npz (numpy.load)``: the same file read by numpy, each array materialised;
- ``feather`` and ``parquet``: the same columns as an Arrow table, read by pyarrow (the header
  and its checks left out: a lower bound on what a reader would cost);
- ``pickle``: the dump itself, through tether's safe unpickler (what the analyzer reads without
  a column file).

Each format is read ``--reads`` times in a fresh process, ``--reps`` processes per format,
interleaved; the median read of each process is a sample. numpy and pyarrow are optional: a
format whose library is not installed is reported as such. The install weight is the size of
each library's package directory as installed here. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import spread

FORMATS = ("npz (stdlib)", "npz (numpy.load)", "feather", "parquet", "pickle")

_READER = r"""
import statistics, sys, time
from pathlib import Path
fmt, event, reads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
dump, cols = event / "rank_5", event / "cols_5.npz"
if fmt == "npz (stdlib)":
    from tether.events.columns import read_columns
    read = lambda: read_columns(cols, dump)
elif fmt == "npz (numpy.load)":
    import numpy as np
    def read():
        with np.load(cols) as z:
            return {k: z[k] for k in z.files}
elif fmt == "feather":
    import pyarrow.feather as fe
    read = lambda: fe.read_table(event / "c.feather")
elif fmt == "parquet":
    import pyarrow.parquet as pq
    read = lambda: pq.read_table(event / "c.parquet")
else:
    from tether.events.load import load_trace
    read = lambda: load_trace(dump)
read()
times = []
for _ in range(reads):
    t = time.perf_counter()
    read()
    times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e6)
"""


def _installed_mb(module: str) -> float | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    root = Path(mod.__file__).parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6


def _arrow_files(event: Path) -> bool:
    """The columns as Arrow files beside the npz; False without pyarrow."""
    try:
        import pyarrow as pa
        import pyarrow.feather as fe
        import pyarrow.parquet as pq
    except ImportError:
        return False
    from tether.events.columns import read_columns

    got = read_columns(event / "cols_5.npz", event / "rank_5")
    table = pa.table(
        {
            k: pa.array(list(v), type=pa.uint8() if type(v) is bytes else pa.int64())
            for k, v in got.cols.items()
        }
    )
    fe.write_feather(table, event / "c.feather", compression="uncompressed")
    pq.write_table(table, event / "c.parquet")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--reads", type=int, default=200)
    args = ap.parse_args()
    from analyze_speed import build_event

    with tempfile.TemporaryDirectory(prefix="tether-colfmt-") as tmp:
        event = Path(tmp) / "20261130T101500.000000Z-hang"
        build_event(event, 8, args.entries)
        arrow = _arrow_files(event)
        sizes = {
            "npz (stdlib)": (event / "cols_5.npz").stat().st_size,
            "npz (numpy.load)": (event / "cols_5.npz").stat().st_size,
            "pickle": (event / "rank_5").stat().st_size,
        }
        if arrow:
            sizes["feather"] = (event / "c.feather").stat().st_size
            sizes["parquet"] = (event / "c.parquet").stat().st_size
        has = {
            "npz (stdlib)": True,
            "npz (numpy.load)": _installed_mb("numpy") is not None,
            "feather": arrow,
            "parquet": arrow,
            "pickle": True,
        }
        samples: dict[str, list[float]] = {f: [] for f in FORMATS if has[f]}
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for _ in range(args.reps):
            for fmt in samples:
                out = subprocess.run(
                    [sys.executable, "-c", _READER, fmt, str(event), str(args.reads)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    env=env,
                    check=True,
                )
                samples[fmt].append(float(out.stdout.split()[-1]))
    base = statistics.median(samples["pickle"])
    weight = {
        "npz (stdlib)": 0.0,
        "npz (numpy.load)": _installed_mb("numpy"),
        "feather": _installed_mb("pyarrow"),
        "parquet": _installed_mb("pyarrow"),
        "pickle": 0.0,
    }
    print(f"one dump of {args.entries} entries; {args.reps} processes x {args.reads} reads each")
    print()
    print("| format | bytes | read, µs: median [min-max] | vs the pickle | library installed |")
    print("| --- | --- | --- | --- | --- |")
    for fmt in FORMATS:
        if fmt not in samples:
            print(f"| {fmt} | - | not installed | - | - |")
            continue
        w = weight[fmt]
        lib = "standard library" if w == 0.0 else f"{w:.0f} MB"
        print(
            f"| {fmt} | {sizes[fmt]:,} | {spread(samples[fmt], '{:.0f}')} | "
            f"{base / statistics.median(samples[fmt]):.1f}x | {lib} |"
        )
    print(
        json.dumps(
            {
                "entries": args.entries,
                "read_us": {f: round(statistics.median(v), 1) for f, v in samples.items()},
                "read_us_spread": {
                    f: [round(min(v), 1), round(max(v), 1)] for f, v in samples.items()
                },
                "bytes": sizes,
                "installed_mb": {f: None if w is None else round(w, 1) for f, w in weight.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
