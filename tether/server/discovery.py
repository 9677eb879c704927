"""``DUMP_DIR/.jobs/<job>.targets.json``: every rank's debug server for Prometheus' file-based
service discovery, written by rank 0 once every rank has published its address.

The format is ``file_sd_configs``' JSON: one target group, every rank's ``host:port``, and the
label ``tether_job_id``. No ``rank`` label on the targets: each sample already carries one, and a
target label of the same name would make Prometheus rename the sample's to ``exported_rank``.
No ``job`` label either: Prometheus takes it from the scrape config's ``job_name``, which a target
label would override.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tether._log import get_logger
from tether.job.alarm import AlarmBoard
from tether.job.jobfile import write_json

__all__ = ["TargetsWriter", "targets"]

logger = get_logger(__name__)

WAIT_S = 300.0
"""How long rank 0 waits for every rank's address; then it writes the ones it has."""
POLL_S = 0.5
"""The first wait between two looks at the store; it doubles up to :data:`MAX_POLL_S` (a large
job's ranks cost a store round trip each per look)."""
MAX_POLL_S = 5.0


def targets(urls: dict[int, str], job_id: str) -> list[dict[str, Any]]:
    """The file's content: ``urls`` (rank -> debug server) as one target group."""
    hosts = [urlsplit(url).netloc for _, url in sorted(urls.items())]
    return [{"targets": hosts, "labels": {"tether_job_id": job_id}}]


class TargetsWriter:
    """Waits, on a named daemon thread and a store connection of its own, until every rank of
    this attempt has published a debug server, then writes ``path``."""

    def __init__(
        self,
        board: AlarmBoard,
        path: Path,
        *,
        job_id: str,
        world_size: int,
        attempt: int,
        wait_s: float = WAIT_S,
        poll_s: float = POLL_S,
        on_written: Callable[[Path], None] | None = None,
    ) -> None:
        self.board = board
        self.path = path
        self.job_id = job_id
        self.world_size = world_size
        self.attempt = attempt
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.on_written = on_written
        """Told of the file once written (the rank's job link removes it at a clean exit)."""
        self.written = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tether-targets", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        deadline = time.monotonic() + self.wait_s
        urls: dict[int, str] = {}
        poll = self.poll_s
        while not self._stop.is_set():
            try:
                procs = self.board.procs(self.world_size, attempt=self.attempt)
            except Exception as exc:  # the store is gone: the job is ending
                logger.debug("no targets file: the store did not answer: %s", exc)
                return
            urls = {r: str(i["debug_url"]) for r, i in procs.items() if i.get("debug_url")}
            if len(urls) == self.world_size:
                break
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.world_size)) - set(urls))
                logger.warning(
                    "ranks %s published no debug server within %.0f s; %s lists the others",
                    ", ".join(map(str, missing)),
                    self.wait_s,
                    self.path,
                )
                break
            self._stop.wait(min(poll, max(deadline - time.monotonic(), 0.0)))
            poll = min(2 * poll, MAX_POLL_S)
        if self._stop.is_set() or not urls:
            return
        try:
            write_json(self.path, targets(urls, self.job_id))
        except OSError as exc:  # the job runs on; only Prometheus loses its way in
            logger.warning("could not write %s: %s", self.path, exc)
            return
        if self.on_written is not None:
            self.on_written(self.path)
        self.written.set()
