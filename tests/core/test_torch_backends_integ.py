"""torch's in-process test backends under tether: "threaded" (every rank a thread of one process:
torch's MultiThreadedTestCase, DTensor's test bases) and "fake" (one process stands in for a rank
of a larger world, to trace FSDP and DTensor code). Neither is a job of processes, so tether runs
no formation handshake on them: before, "threaded" hung for the group timeout and "fake" failed
on its empty store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._jobs import worker_env
from tether.recorder.native import load

pytestmark = pytest.mark.every_torch

RECORDERS = ["native", "python"]

PRELUDE = """
import sys
import torch, torch.distributed as dist
import tether
tether.install(tether.Config(dump_dir=sys.argv[1], recorder=sys.argv[2], debug_port=None))
"""

THREADED = """
import unittest
from torch.testing._internal.common_distributed import MultiThreadedTestCase

class Threaded(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 4

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_world_and_subgroup(self):
        t = torch.ones(2) * self.rank
        dist.all_reduce(t)
        self.assertEqual(t.tolist(), [6.0, 6.0])
        sub = dist.new_group([0, 1])
        if self.rank < 2:
            u = torch.ones(1)
            dist.all_reduce(u, group=sub)
            self.assertEqual(u.item(), 2.0)

unittest.main(argv=["threaded"], exit=True)
"""

FAKE = """
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
t = torch.ones(4)
dist.all_reduce(t)
print("FAKE", dist.get_rank(), dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


def run(body: str, recorder: str, dump_dir: str) -> subprocess.CompletedProcess[str]:
    if recorder == "native" and load()[0] is None:
        pytest.skip(f"the native core does not load here: {load()[1]}")
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code, dump_dir, recorder],
        capture_output=True, text=True, timeout=90, env=worker_env(),
    )  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recorder", RECORDERS)
def test_torch_multithreaded_test_case_runs(tmp_path: Path, recorder: str) -> None:
    proc = run(THREADED, recorder, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "Ran 1 test" in proc.stderr and "OK" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recorder", RECORDERS)
def test_fake_backend_initialises(tmp_path: Path, recorder: str) -> None:
    proc = run(FAKE, recorder, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "FAKE 3 8" in proc.stdout, proc.stdout
