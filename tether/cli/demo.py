"""``tether demo``: a real multi-rank CPU job under tether, with a fault injected on one rank."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from tether.analyze import Diagnosis, analyze, render
from tether.cli.elastic_demo import elastic_demo
from tether.cli.main import plain_help
from tether.cli.show import summarize
from tether.demo.job import FAULTS
from tether.events.load import load_event, resolve_event
from tether.launcher import run as launcher

__all__ = ["EXPECTED_VERDICT", "main"]

EXPECTED_VERDICT = {
    "hang": "hang",
    "gil": "hang",
    "crash": "crash",
    "desync": "desync",
    "straggler": "straggler",
    "none": "healthy",
}
"""What the analyzer must say about each fault for the demo to succeed."""


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tether demo", description=plain_help(__doc__))
    parser.add_argument("--world-size", type=int, default=4, help="ranks (at least 2)")
    parser.add_argument("--culprit", type=int, default=2, help="the rank that misbehaves")
    parser.add_argument(
        "--fault",
        choices=(*FAULTS, "node"),
        default="hang",
        help="what it does (node, with --elastic: its whole node is killed, then started again)",
    )
    parser.add_argument("--fault-step", type=int, default=5, help="the training step it happens")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="seconds, see tether run")
    parser.add_argument("--dump-dir", default="tether-dumps", help="where dump events go")
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="with --fault crash: the job goes on without the dead rank, takes a replacement "
        "back, and its losses are checked against a fault-free run",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="run the job across this many simulated nodes (network namespaces with their own "
        "hostname, address and dump directory; needs root) and diagnose it from node 0's "
        "directory alone",
    )
    args = parser.parse_args(list(argv))
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if not 0 <= args.culprit < args.world_size:
        parser.error("--culprit must be a rank of the job")
    if args.fault == "node":
        if not args.elastic:
            parser.error("--fault node needs --elastic: the job that survives a node's loss")
        from tether.cli.nodes_demo import elastic_nodes_demo

        return elastic_nodes_demo(args)
    if args.elastic:
        if args.fault != "crash":
            parser.error(
                "--elastic shows a job surviving a rank's or a node's death: use it with "
                "--fault crash or --fault node"
            )
        return elastic_demo(args)
    if args.nodes > 1:
        from tether.cli.nodes_demo import nodes_demo

        return nodes_demo(args, _judge)

    if args.fault == "none":
        fault = "no fault"
    elif args.fault == "straggler":
        fault = f"rank {args.culprit}: straggler (late to every collective, every step)"
    else:
        fault = f"rank {args.culprit}: {args.fault} at step {args.fault_step}"
    print(
        f"tether demo: {args.world_size} ranks on CPU (gloo): DDP training, a world and a subgroup "
        f"all_reduce and a send/recv pair every step; {fault}; "
        f"hang timeout {args.hang_timeout:g}s",
        flush=True,
    )
    dump_dir = Path(args.dump_dir)
    before = _events(dump_dir)
    started = time.monotonic()
    rc = launcher.main(
        [
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            f"--dump-dir={dump_dir}",
            f"--hang-timeout={args.hang_timeout}",
            "--dump-on-exit",
            "-m",
            "tether.demo.job",
            f"--steps={args.steps}",
            f"--fault={args.fault}",
            f"--culprit={args.culprit}",
            f"--fault-step={args.fault_step}",
        ]
    )
    new = sorted(set(_events(dump_dir)) - set(before))
    if not new:
        print(f"tether demo: the job ended (exit {rc}) and no rank dumped", flush=True)
        return 1
    event = resolve_event(dump_dir, _incident(new))
    print(summarize(event), flush=True)
    dumps, _ = load_event(event)
    reason = next(iter(dumps.values()))["tether"]["reason"] if dumps else "?"
    print(
        f"\nthe job ended with exit {rc}; {len(dumps)} of {args.world_size} ranks dumped into "
        f"{event} ({reason}) in {time.monotonic() - started:.1f}s",
        flush=True,
    )
    diagnosis = analyze(event)
    print(f"\n$ tether analyze {event}\n{render(diagnosis)}", flush=True)
    # fr_trace refuses an event with a rank's dump missing unless told it may be.
    incomplete = " --allow-incomplete-ranks" if len(dumps) < args.world_size else ""
    print(
        "\ntorch's analyzer reads it too: python -m torch.distributed.flight_recorder.fr_trace "
        f"{event} -p rank_{incomplete}",
        flush=True,
    )
    verdict = _judge(diagnosis, args.fault, args.culprit)
    print(f"\ntether demo: {verdict}", flush=True)
    return 0 if verdict.startswith("ok") else 1


def _incident(new: list[str]) -> str:
    """The event to analyze among those the job left: the newest one a hang or a crash caused
    (ranks that exit on the error a crash causes also leave an ``exit`` dump, often first)."""
    trouble = [e for e in new if not e.endswith("-exit")]
    return (trouble or new)[-1]


def _judge(d: Diagnosis, fault: str, culprit: int) -> str:
    """Say "ok: ..." when the diagnosis names the injected fault and culprit, else what differs."""
    want_verdict = EXPECTED_VERDICT[fault]
    want_ranks = [] if fault == "none" else [culprit]
    said = f"the analyzer says {d.verdict}, culprit rank(s) {d.culprit_ranks or 'none'}"
    if (d.verdict, d.culprit_ranks) == (want_verdict, want_ranks):
        return f"ok: {said}, as injected"
    wanted = f"{want_verdict}, culprit rank(s) {want_ranks or 'none'}"
    return f"MISMATCH: {said}; injected {fault!r} should give {wanted}"


def _events(dump_dir: Path) -> list[str]:
    if not dump_dir.is_dir():
        return []
    return sorted(p.name for p in dump_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
