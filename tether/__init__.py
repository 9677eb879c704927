"""tether: keeps a distributed PyTorch job's ranks connected and accountable.

import tether
tether.init_process_group("gloo")   # same parameters as torch.distributed's
...                                  # plain torch.distributed calls, DDP, FSDP2, ...
tether.dump()                        # this rank's flight-recorder dump, now
"""

from tether._exceptions import (
    ConfigError,
    DumpError,
    GroupFormationError,
    TetherError,
    UnsafeDumpError,
)
from tether.api import init_process_group
from tether.config import Config, load_config
from tether.recorder import dump, install, load_dump, uninstall

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DumpError",
    "GroupFormationError",
    "TetherError",
    "UnsafeDumpError",
    "__version__",
    "dump",
    "init_process_group",
    "install",
    "load_config",
    "load_dump",
    "uninstall",
]
