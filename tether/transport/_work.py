"""Completion of asynchronous transfers: a ``torch.distributed.Work`` and the thread behind it."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tether import _log
from tether._exceptions import TransportTimeoutError
from tether.transport.config import validate_timeout

__all__ = ["AsyncRunner", "TransferWork", "Work", "wait_all"]

Work = dist.Work
"""What an asynchronous transfer returns: ``torch.distributed.Work``, as in torch 2.15."""

logger = _log.get_logger(__name__)


class TransferWork(dist.Work):
    """One asynchronous transfer (or batch). ``wait()`` raises the transfer's error; a timeout
    bounds the wait only, it never cancels the transfer (its memory stays registered until it
    ends)."""

    def __init__(self, what: str, deadline: float) -> None:
        super().__init__()
        self._what = what
        self._deadline = deadline
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        # The future is completed last: its callbacks (asyncio bridges) may read _error.
        if error is None:
            self._future.set_result([])  # torch's: an empty list on success
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Blocks until the transfer ends; ``timeout`` 0 means the transfer's own deadline."""
        secs = timeout.total_seconds()
        if secs <= 0:
            secs = max(self._deadline - time.monotonic(), 0.0)
        if not self._done.wait(secs):
            raise TransportTimeoutError(
                f"{self._what} did not complete within {secs:.3f} s (it is not cancelled: its "
                "memory stays registered until it ends)"
            )
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> list[Any]:
        return []

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


async def wait_all(works: Iterable[dist.Work], *, timeout: float | None = None) -> None:
    """Awaits every work without blocking the event loop (torch 2.15's ``wait_all``), through
    each work's future alone: never ``wait()`` or ``is_completed()``, which a work may not
    implement or may block in. ``timeout`` bounds this wait, never the transfers: on
    ``TimeoutError`` they go on, their memory registered. Cancelling the waiter cancels nothing
    else (a work awaited twice, a transfer). The first failed work's error is raised."""
    secs = validate_timeout(timeout)
    futures = [work.get_future() for work in works]
    # What is done already needs no loop turn (a zero timeout still sees it).
    pending = [_loop_future(f) for f in futures if not f.done()]
    if pending:
        done, _ = await asyncio.wait(pending, timeout=secs)
        if len(done) < len(pending):
            raise TimeoutError("transport wait timed out; operations remain pending")
    for future in futures:
        future.wait()  # done: returns at once, or raises the work's error


def _loop_future(future: torch.futures.Future[Any]) -> asyncio.Future[None]:
    """An asyncio future of the running loop that is done once ``future`` is. It carries no
    result or error (those are read from ``future``), so a waiter that gave up leaves nothing
    unretrieved behind."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake(_: object) -> None:
        # Runs on the thread completing the work; the loop may have closed if the waiter left.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, done)

    future.add_done_callback(wake)
    return done


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class AsyncRunner:
    """One named daemon thread running queued transfers in order; stopped with a sentinel."""

    _STOP = object()

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is self._STOP:
                return
            try:
                fn()
            except BaseException:  # each job completes its own work; this is a bug guard
                logger.exception("transfer job failed outside its work")

    def close(self, timeout: float) -> bool:
        self._queue.put(self._STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()
