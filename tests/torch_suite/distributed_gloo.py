"""torch's own ``distributed_test.py`` (shipped in the wheel, under
``torch/testing/_internal/distributed/``) on gloo with two ranks, set up the way torch's
``test/distributed/test_distributed_spawn.py`` runs it: each test spawns its ranks, which form
their group through a file store. Not collected by ``make test``: ``run.py`` runs it, with and
without tether."""

import os
import tempfile

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch-suite-"))

from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
