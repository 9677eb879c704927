"""Shared fixtures: a TCPStore on port 0 per test, and jobs launched against it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests._jobs import JobResult, launch, new_store


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield new_store()


@pytest.fixture
def run_job(store: dist.TCPStore, tmp_path: Path):  # type: ignore[no-untyped-def]
    """``launch`` bound to this test's store and a fresh dump directory."""

    def run(script: str, world_size: int, *args: str, **kwargs: Any) -> JobResult:
        return launch(
            script, world_size, *args, port=store.port, dump_dir=tmp_path / "dumps", **kwargs
        )

    return run
