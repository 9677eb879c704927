"""Completion for ``Work`` objects that never say they are done.

Some backends return works whose ``is_completed()`` stays False even after ``wait()`` succeeds
(gloo's ``reduce_scatter`` and ``_reduce_scatter_base`` in torch 2.13), so polling cannot see
them finish. For those we hand the caller a thin ``Work`` that reports completion when its
``wait()`` returns. Whether a backend's works report is probed once per operation type and group.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["WaitReportingWork", "reports_completion"]


def reports_completion(work: Any) -> bool:
    """False for works that implement neither a future nor a completion flag we can trust."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


class WaitReportingWork(dist.Work):
    """Delegates to ``inner``; calls ``on_done`` once ``wait()`` has returned successfully."""

    def __init__(self, inner: Any, on_done: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._on_done: Callable[[], None] | None = on_done

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        ok = bool(self._inner.wait(timeout))
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        return ok

    def is_completed(self) -> bool:
        return self._on_done is None or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    # What torch's own Python calls on a work, besides the above: dist.recv(src=None) asks
    # _source_rank(); the rest are the Work API's too.
    def _source_rank(self) -> int:
        return int(self._inner._source_rank())

    def _get_op_type(self) -> Any:
        return self._inner._get_op_type()

    def _get_duration(self) -> float:
        return float(self._inner._get_duration())

    def get_future_result(self) -> Any:
        return self._inner.get_future_result()

    def block_current_stream(self) -> None:
        self._inner.block_current_stream()

    def result(self) -> list[Any]:
        return list(self._inner.result())

    def get_future(self) -> Any:
        return self._inner.get_future()

    def synchronize(self) -> None:
        self._inner.synchronize()
