"""``DUMP_DIR/.jobs/``: how a running job is found from outside it.

Rank 0 writes two files there and removes both when the job exits cleanly:

- ``<job>.json``: the job's store address and world size, for ``tether dump``;
- ``<job>.targets.json``: every rank's debug server, in Prometheus' file-based service discovery
  format (``file_sd_configs``), once every rank has published its address.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from tether.events.layout import JOBS_DIR, write_atomic

__all__ = [
    "JOBS_DIR",
    "TARGETS_SUFFIX",
    "default_job_id",
    "ended_here",
    "job_file",
    "job_files",
    "targets_file",
    "write_json",
]

TARGETS_SUFFIX = ".targets.json"


def default_job_id(host: str, pid: int) -> str:
    """A job's id where none was given: rank 0's host and pid."""
    return f"{host}-{pid}"


def ended_here(host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` is known to have ended: it ran on this host and is
    gone. (A process of another host, sharing the directory, is never known to be.)"""
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def job_file(dump_dir: Path, job_id: str) -> Path:
    return dump_dir / JOBS_DIR / f"{job_id}.json"


def targets_file(dump_dir: Path, job_id: str) -> Path:
    return dump_dir / JOBS_DIR / f"{job_id}{TARGETS_SUFFIX}"


def job_files(dump_dir: Path) -> list[Path]:
    """Every job file in ``dump_dir``, sorted by name; the targets files are not job files."""
    found = (dump_dir / JOBS_DIR).glob("*.json")
    return sorted(p for p in found if not p.name.endswith(TARGETS_SUFFIX))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` in one step: a reader (``tether dump``, Prometheus) sees the
    old file or the new one, never half of one."""
    write_atomic(path, json.dumps(data, sort_keys=True))
