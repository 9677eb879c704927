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


# Everything else of the Work API goes to the wrapped work unchanged, the private methods torch's
# own Python calls included (dist.recv(src=None) asks _source_rank()). dist.Work's C++ methods
# would shadow a __getattr__, so each is overridden by name.
_FORWARDED = (
    "is_success", "exception", "source_rank", "_source_rank", "_get_op_type", "_get_duration",
    "result", "get_future", "get_future_result", "synchronize", "block_current_stream",
)  # fmt: skip


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WaitReportingWork, *args: Any) -> Any:
        return getattr(self._inner, name)(*args)

    method.__name__ = name
    return method


for _name in _FORWARDED:
    setattr(WaitReportingWork, _name, _forward(_name))
