"""A recorded job with an injected fault on one rank (the culprit).

  --fault sleep     the culprit sleeps (GIL released) instead of joining the step's all_reduce
  --fault inside    the culprit waits inside a receive that nobody answers
  --fault gil       the culprit is stuck in a C call that holds the GIL
  --fault subgroup  the culprit skips an all_reduce on group "sub" (ranks 0 and the culprit);
                    the other ranks keep running collectives on their own group "pair"
  --fault evict     like sleep, and while the hang lasts the healthy ranks flood another group
                    with traffic, more than the ring holds
  --fault raise     the culprit raises (its own crash alarm); its exit then waits until every
                    other rank's watchdog has judged the all_reduce they wait in (a dead rank
                    whose process is slow to go); with --after-crash the others issue that
                    all_reduce only once they have answered the crash alarm
  --fault none      no fault
The job runs --steps steps of all_reduce; the fault hits at --fault-step.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import threading
import time
from datetime import timedelta

import _common
import torch
import torch.distributed as dist

import tether
from tether.runtime import current
from tether.runtime import monitor as tether_monitor


def hold_the_gil(seconds: int) -> None:
    # PyDLL calls keep the GIL held, like a C extension that never releases it. A signal ends
    # sleep() early, so sleep again: between two calls other threads may briefly run.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctypes.PyDLL(None).sleep(seconds)  # STUCK:gil


def flood_once_suspected(group: dist.ProcessGroup, ops: int) -> None:
    """Wait until the watchdog suspects a hang, then issue ``ops`` collectives on ``group``."""
    recorder = current()
    assert recorder is not None
    deadline = time.monotonic() + 30
    while not recorder.suspicion and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(ops):
        dist.all_reduce(torch.ones(1), group=group)


JUDGED = "test/judged/{rank}"


def say_when_judged(store: dist.TCPStore, rank: int) -> None:
    """Set ``JUDGED`` once this rank's watchdog has seen an operation outlive the hang timeout
    and its hang policy has returned (the watchdog's next pass)."""
    monitor = tether_monitor()
    assert monitor is not None
    watchdog = monitor.watchdog
    deadline = time.monotonic() + 30
    while watchdog.hung is None and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = time.monotonic_ns()
    while watchdog.heartbeat_ns < seen and time.monotonic() < deadline:
        time.sleep(0.01)
    store.set(JUDGED.format(rank=rank), "1")


def crash_answered() -> None:
    """Return once this rank's responder has answered a crash alarm, its dump written (30 s at
    most). The alarm is in ``handled`` as soon as the answer starts: the dump comes after."""
    monitor = tether_monitor()
    assert monitor is not None and monitor.responder is not None
    responder = monitor.responder
    deadline = time.monotonic() + 30
    while (
        crash := next((i for i, a in enumerate(responder.handled) if a.reason == "crash"), None)
    ) is None:
        assert time.monotonic() < deadline, "no crash alarm answered"
        time.sleep(0.01)
    # Alarms are answered one at a time, in order: the crash's is done once more than its index are.
    assert responder.wait_answered(crash, max(deadline - time.monotonic(), 0.1)), "no crash dump"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="sleep")
    parser.add_argument("--culprit", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hang-timeout", type=float, default=2.0)
    parser.add_argument("--on-hang", default="abort")
    parser.add_argument("--sleep-seconds", type=float, default=600)
    parser.add_argument("--gil-seconds", type=int, default=8)
    parser.add_argument("--ring-size", type=int, default=None)
    parser.add_argument("--dump-at-start", action="store_true")
    parser.add_argument("--after-crash", action="store_true")
    args = _common.parse(parser)
    rank, culprit, world = args.rank, args.culprit, args.world_size
    if args.fault == "raise" and rank == culprit:
        # Registered before tether's own exit hook, so it runs after it (after the crash dump).
        others = [JUDGED.format(rank=r) for r in range(world) if r != culprit]
        atexit.register(lambda: store.wait(others, timedelta(seconds=60)))
    store = _common.init_recorded(
        args,
        hang_timeout=args.hang_timeout,
        on_hang=args.on_hang,
        ring_size=args.ring_size,
        timeout=timedelta(seconds=120),
    )
    if args.dump_at_start:
        tether.dump(reason="start")
    rest = dist.new_group([r for r in range(world) if r != culprit], group_desc="rest")
    sub = dist.new_group([0, culprit], group_desc="sub")
    pair = dist.new_group([r for r in range(world) if r not in (0, culprit)], group_desc="pair")
    t = torch.ones(8)
    for step in range(args.steps):
        faulty = rank == culprit and step == args.fault_step
        if args.fault == "raise" and step == args.fault_step and rank != culprit:
            threading.Thread(target=say_when_judged, args=(store, rank), daemon=True).start()
            if args.after_crash:  # reach the collective only once the crash's dumps are taken
                crash_answered()
        if faulty and args.fault == "raise":
            raise ValueError(f"bad batch at step {step}")  # STUCK:raise
        if args.fault == "evict" and step == args.fault_step and rank != culprit:
            threading.Thread(target=flood_once_suspected, args=(rest, 40), daemon=True).start()
        if faulty and args.fault in ("sleep", "evict"):
            time.sleep(args.sleep_seconds)  # STUCK:sleep
        elif faulty and args.fault == "inside":
            dist.recv(torch.zeros(1), src=(rank + 1) % world)  # STUCK:inside
        elif faulty and args.fault == "gil":
            hold_the_gil(args.gil_seconds)
        if args.fault == "subgroup" and step == args.fault_step:
            if rank == 0:
                dist.all_reduce(t, group=sub)  # the culprit never joins: hangs here
            elif rank == culprit:
                time.sleep(args.sleep_seconds)  # STUCK:subgroup
            else:
                for _ in range(20):  # the other ranks' own group keeps running
                    dist.all_reduce(torch.ones(1), group=pair)
        dist.all_reduce(t)  # STEP:all_reduce
    print("RESULT " + json.dumps({"pid": os.getpid(), "finished": True}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
