"""``tether analyze PATH``: what went wrong in a dump event, and which rank to look at."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tether._exceptions import AnalysisError

__all__ = ["main"]

EXIT_OK = 0
EXIT_UNUSABLE = 2


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tether analyze",
        description="Name the culprit rank, the collective and the line, from a dump event "
        "(tether's dumps or torch's own flight-recorder files). Exit status 0 when the analysis "
        "ran, whatever the verdict; 2 when the input is unusable.",
    )
    parser.add_argument("path", help="an event directory, or a dump directory (newest event)")
    parser.add_argument("--event", help="the event id to analyze, inside a dump directory")
    parser.add_argument(
        "--json", action="store_true", help="print the diagnosis as one JSON object"
    )
    parser.add_argument(
        "--chrome-trace",
        metavar="OUT.json",
        type=Path,
        help="also write every rank's operations as a Chrome trace (opens in Perfetto)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes reading the dump files at once (default: one per CPU for "
        "events of 32 files or more; 0: read in this process)",
    )
    args = parser.parse_args(list(argv))

    from tether.analyze.chrome import write_chrome_trace
    from tether.analyze.engine import analyze_event, load
    from tether.analyze.report import render

    try:
        ev = load(args.path, event=args.event, jobs=args.jobs)
    except AnalysisError as exc:
        print(f"tether analyze: input unusable: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    diagnosis = analyze_event(ev)
    if args.chrome_trace is not None:
        try:
            write_chrome_trace(ev, diagnosis, args.chrome_trace)
        except OSError as exc:
            print(f"tether analyze: cannot write {args.chrome_trace}: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE
    if args.json:
        print(json.dumps(diagnosis.to_json(), sort_keys=False))
    else:
        print(render(diagnosis))
        if args.chrome_trace is not None:
            print(f"chrome trace: {args.chrome_trace}")
    return EXIT_OK
