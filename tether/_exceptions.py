"""tether's exceptions.

TetherError
├── ConfigError          a flag, argument or environment variable is wrong; says what to change
├── DumpError            a dump could not be written (nothing half-written is left behind)
├── UnsafeDumpError      a dump file holds something other than plain data, or is not a dump
└── GroupFormationError  some ranks never arrived while a process group was being created
"""

from __future__ import annotations

__all__ = ["ConfigError", "DumpError", "GroupFormationError", "TetherError", "UnsafeDumpError"]


class TetherError(Exception):
    """Base class of every error tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A configuration value is invalid."""


class DumpError(TetherError, OSError):
    """Writing a dump failed."""


class UnsafeDumpError(TetherError, ValueError):
    """A file could not be loaded as a dump safely."""


class GroupFormationError(TetherError, TimeoutError):
    """Ranks of a new process group did not arrive within the group's timeout."""

    def __init__(self, message: str, *, group_name: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.group_name = group_name
        self.missing_ranks = missing_ranks
