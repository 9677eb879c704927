"""The flight recorder: every collective and p2p operation of every process group, per rank.

The public names resolve on first use (PEP 562), so that reading dumps (``tether analyze``,
:func:`load_dump`) never imports torch; recording does.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from tether._lazy import lazy_getattr

if TYPE_CHECKING:
    from tether.events.load import load_dump
    from tether.recorder.dump import dump
    from tether.recorder.install import current, install, uninstall

__all__ = ["current", "dump", "install", "load_dump", "uninstall"]

_WHERE = {
    "current": "tether.recorder.install",
    "dump": "tether.recorder.dump",
    "install": "tether.recorder.install",
    "load_dump": "tether.events.load",
    "uninstall": "tether.recorder.install",
}


__getattr__ = lazy_getattr(globals(), _WHERE)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_SHADOWED = ("dump", "install")
"""Submodules named like the function they export."""


class _Package(types.ModuleType):
    """Keeps ``tether.recorder.dump`` and ``.install`` the functions, as eager imports did:
    importing the submodule ``tether.recorder.install`` (the launcher's bootstrap does) would
    otherwise bind the package's ``install`` attribute, and so ``tether.install``, to the
    module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
