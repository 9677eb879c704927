"""tether: keeps a distributed PyTorch job's ranks connected and accountable.

import tether
tether.init_process_group("gloo")   # same parameters as torch.distributed's
...                                  # plain torch.distributed calls, DDP, FSDP2, ...
tether.dump()                        # this rank's flight-recorder dump, now

The names that need torch (``init_process_group``, ``dump``, ``install``, ``uninstall``,
``recorder_status``) are
imported on first use (PEP 562), so tools that only read dumps (``tether analyze``) start
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether._exceptions import (
    AgentGoneError,
    ConfigError,
    DumpError,
    GroupFormationError,
    RankFailedError,
    StoreUnreachableError,
    TetherError,
    UnsafeDumpError,
    UnsupportedTorchError,
    WorldTooSmallError,
)
from tether._lazy import lazy_getattr
from tether.config import Config, load_config

if TYPE_CHECKING:
    from tether.api import init_process_group
    from tether.events.load import load_dump
    from tether.runtime import dump, install, recorder_status, uninstall

__version__ = "0.1.0"

__all__ = [
    "AgentGoneError",
    "Config",
    "ConfigError",
    "DumpError",
    "GroupFormationError",
    "RankFailedError",
    "StoreUnreachableError",
    "TetherError",
    "UnsafeDumpError",
    "UnsupportedTorchError",
    "WorldTooSmallError",
    "__version__",
    "dump",
    "init_process_group",
    "install",
    "load_config",
    "load_dump",
    "recorder_status",
    "uninstall",
]

_LAZY = {
    "init_process_group": "tether.api",
    "dump": "tether.runtime",
    "install": "tether.runtime",
    "load_dump": "tether.events.load",
    "recorder_status": "tether.runtime",
    "uninstall": "tether.runtime",
}


__getattr__ = lazy_getattr(globals(), _LAZY)


def __dir__() -> list[str]:
    # The public names and the package's own; not the subpackages some import has loaded
    # (``tether.analyze``, ``tether.cli``, ...), which are not part of ``import tether``'s API.
    return sorted({*__all__, *(n for n in globals() if n.startswith("_"))})
