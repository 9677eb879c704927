"""Public names resolved on first use (PEP 562): reading dumps must not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(namespace: dict[str, Any], where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``where[name]`` the first time it is
    asked for and keeps it in ``namespace`` (the module's globals), so it is asked only once."""
    module_name = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    return __getattr__
