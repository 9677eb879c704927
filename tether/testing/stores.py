"""A store that counts the requests made through it: what a test or a simulation of the job's
protocol measures the store's load by."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["CountingStore"]


class CountingStore:
    """``inner`` (a torch store), every request made through it counted by method name in
    :attr:`counts`. Its clone is itself: the clones of one share the connection and the counts,
    as the ranks of a simulated node share one connection."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def clone(self) -> CountingStore:
        return self

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return method(*args, **kwargs)

        return counted
