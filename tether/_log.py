"""Logging with rank context: every tether record says which rank wrote it."""

from __future__ import annotations

import logging

__all__ = ["get_logger", "set_rank"]

_rank: str = "?"


def set_rank(rank: int) -> None:
    global _rank
    _rank = str(rank)


class _RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: object, kwargs: object) -> tuple[str, object]:  # type: ignore[override]
        return f"[rank {_rank}] {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    return _RankAdapter(logging.getLogger(name), {})
