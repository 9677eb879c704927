"""torch's flight-recorder variables under tether, in real recorded gloo processes: a job set up
for torch's recorder (``TORCH_FR_BUFFER_SIZE``, ``TORCH_FR_DUMP_ON_TIMEOUT``, ...) behaves the
same under tether. What each variable parses to is in tests/core/test_config.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests._jobs import new_store, worker_env

pytestmark = [pytest.mark.timeout(120), pytest.mark.every_torch]

RANK = """
    import json, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import tether
    from tether.runtime import current, link, report
    port, rank, world, dump_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    tether.init_process_group("gloo", store=store, rank=rank, world_size=world, dump_dir=dump_dir,
                              hang_timeout=1.0, on_hang="dump", debug_port="off",
                              timeout=timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)
    recorder = current()
    out = {"sum": t.tolist(), "recorded": recorder is not None,
           "ring": recorder.ring.capacity if recorder is not None else None}
    if world == 2 and rank == 1:
        store.wait(["test/done"])  # joins the next all_reduce only once rank 0 saw the hang
        dist.all_reduce(t)
    elif world == 2:
        work = dist.all_reduce(t, async_op=True)  # waits for rank 1: a hang after 1 s
        deadline = time.monotonic() + 60
        while report().c10d_health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        out["health"] = report().c10d_health()
        out["alarms"] = len(link().responder.handled)
        store.set("test/done", "1")
        work.wait()
    print(json.dumps(out), flush=True)
    # As torch asks of a program: a gloo group left alive at exit aborted this process once in
    # about 30 runs on torch 2.14.1 ("terminate called without an active exception").
    dist.destroy_process_group()
"""


def args(port: int, rank: int, world: int, tmp: Path) -> list[str]:
    return [str(port), str(rank), str(world), str(tmp / "dumps")]


def run(world: int, tmp: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    store = new_store()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(RANK), *args(store.port, rank, world, tmp)],
            env=worker_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            outs.append({**json.loads(out.strip().splitlines()[-1]), "log": err})
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    return outs


def test_a_torch_ring_size_is_the_recorders(tmp_path: Path) -> None:
    (out,) = run(1, tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "7"})
    assert out["recorded"] and out["ring"] == 7


def test_a_torch_ring_of_zero_turns_recording_off(tmp_path: Path) -> None:
    (out,) = run(1, tmp_path, {"TORCH_FR_BUFFER_SIZE": "0"})
    assert out["sum"] == [1.0] * 4, "the job runs as without tether"
    assert not out["recorded"]
    assert "recording is off" in out["log"]
    assert not (tmp_path / "dumps").exists() or not any((tmp_path / "dumps").iterdir())


def test_without_dump_on_timeout_a_hang_is_reported_not_dumped(tmp_path: Path) -> None:
    """torch 2.15's TORCH_FR_DUMP_ON_TIMEOUT=0: the rank says it is unhealthy (what torch's
    frontend polls) and raises no job-wide dump; the debug server asks for dumps."""
    waiter, culprit = run(2, tmp_path, {"TORCH_FR_DUMP_ON_TIMEOUT": "0"})
    assert waiter["health"] == {"healthy": False, "unhealthy_backends": ["gloo"]}
    assert "not dumping for this hang: dump_on_hang is off" in waiter["log"]
    assert waiter["alarms"] == 0, "no hang alarm was raised"
    assert not list((tmp_path / "dumps").glob("*-hang"))
    assert culprit["sum"] == [1.0 * 2] * 4
