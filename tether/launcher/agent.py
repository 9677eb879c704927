"""torchrun's elastic agent, with the survivors' dumps taken before every teardown.

The seam: ``torch.distributed.launcher.api.launch_agent`` builds its agent by calling the module
name ``LocalElasticAgent``; :func:`tether_agent` points that name at :class:`TetherAgent` while
``tether run`` runs torchrun in-process. The subclass adds two hooks, both before any worker is
stopped:

- a crash: torch's process context stops the survivors *inside* its poll, the moment it sees a
  failed worker (``SubprocessContext._poll`` calls ``close()``), so by the time
  ``_monitor_workers`` returns FAILED they are gone. We therefore wrap that context's ``close``:
  when it is about to stop workers and some have failed, the survivors dump first.
- a death signal (SIGTERM, SIGINT to the launcher): torch raises ``SignalException`` in the
  agent's run loop and then stops the workers; ``_invoke_run`` catches it on the way out.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from tether.launcher.teardown import (
    DUMP_GRACE_S,
    Incident,
    JobView,
    describe_exit,
    dump_before_teardown,
)
from tether.watchdog.responder import HANG_EXIT_CODE

__all__ = ["TetherAgent", "tether_agent"]

_AGENT_NAME = "LocalElasticAgent"


class _Started:
    """One start of the workers (its process context): the dumps are asked for at most once,
    before its first close."""

    def __init__(self, pcontext: Any, worker_group: WorkerGroup) -> None:
        self.pcontext = pcontext
        self.worker_group = worker_group
        self.closing = False


class TetherAgent(LocalElasticAgent):
    def __init__(
        self, *args: Any, dump_dir: Path, grace: float = DUMP_GRACE_S, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tether_dump_dir = dump_dir
        self._tether_grace = grace
        self._tether_started: _Started | None = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        pcontext = self._pcontext
        if pcontext is not None:
            started = self._tether_started = _Started(pcontext, worker_group)
            close = pcontext.close

            def close_after_dumps(
                death_sig: signal.Signals | None = None, timeout: int = 30
            ) -> None:
                try:
                    self._before_close(started)
                finally:
                    close(death_sig, timeout)

            # An instance attribute, because the context calls self.close() from its own poll.
            pcontext.close = close_after_dumps  # type: ignore[method-assign]
        return pids

    def _before_close(self, started: _Started) -> None:
        if started.closing:
            return
        started.closing = True
        # SubprocessContext records failures here before it closes; a clean end records none.
        failures: dict[int, Any] = getattr(started.pcontext, "_failures", None) or {}
        if not failures:
            return  # every worker succeeded, or a planned restart: nothing to explain
        if any(f.exitcode == HANG_EXIT_CODE for f in failures.values()):
            return  # tether aborted the job after a hang: every rank has dumped already
        workers = started.worker_group.workers
        dead = {
            workers[local].global_rank: describe_exit(f.exitcode) for local, f in failures.items()
        }
        incident = Incident("crash", f"{len(dead)} worker(s) failed", dead)
        self._dump(started, incident)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            result: RunResult = super()._invoke_run(role)
        except SignalException as exc:
            started = self._tether_started
            if started is not None and not started.closing:
                started.closing = True
                incident = Incident("signal", f"the launcher received {exc.sigval.name}")
                self._dump(started, incident)
            raise
        return result

    def _dump(self, started: _Started, incident: Incident) -> None:
        dump_before_teardown(
            self._job(started),
            incident,
            dump_dir=self._tether_dump_dir,
            grace=self._tether_grace,
            # A second SIGTERM while we wait must still stop the launcher.
            interrupts=(SignalException,),
        )

    def _job(self, started: _Started) -> JobView:
        group = started.worker_group
        pids = started.pcontext.pids()
        return JobView(
            store_host=str(group.master_addr),
            store_port=int(group.master_port or 0),
            world_size=int(group.workers[0].world_size) if group.workers else 0,
            local_pids={w.global_rank: int(pids[w.local_rank]) for w in group.workers},
        )


@contextlib.contextmanager
def tether_agent(dump_dir: Path, *, grace: float = DUMP_GRACE_S) -> Iterator[None]:
    """While inside, torchrun (run in this process) builds a :class:`TetherAgent`."""
    import torch.distributed.launcher.api as launcher_api

    # launch_agent looks the class up by this module-level name each time it builds an agent.
    namespace = vars(launcher_api)
    original = namespace[_AGENT_NAME]

    def build(*args: Any, **kwargs: Any) -> TetherAgent:
        return TetherAgent(*args, dump_dir=dump_dir, grace=grace, **kwargs)

    namespace[_AGENT_NAME] = build
    try:
        yield
    finally:
        namespace[_AGENT_NAME] = original
