"""Shared fixtures (a TCPStore on port 0 per test, and jobs launched against it) and the tiers.

Each test carries the marker of its part, its folder's name (``pytest -m analyze``), and ``job``
when its file is a ``*_integ.py`` (real multi-process jobs). What else a test needs or where else
it runs is marked in its file: ``slow`` (left to ``make test-all``), ``root``, ``every_torch``,
``python_recorder``, ``regroup``; pyproject.toml describes each.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests._jobs import JobResult, launch, new_store

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        part = item.path.relative_to(TESTS).parts[0]
        item.add_marker(part)
        if item.path.stem.endswith("_integ"):
            item.add_marker("job")


@pytest.fixture(scope="session", autouse=True)
def _scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's temporary files, and its jobs' (torchrun's log directories, job logs,
    simulated nodes' disks), go under the session's pytest directory, which pytest removes three
    sessions later: a CI run of six sessions leaves at most three behind."""
    scratch = str(tmp_path_factory.mktemp("tmp", numbered=False))
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = scratch, scratch
    yield
    tempfile.tempdir = None
    if before is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = before


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
