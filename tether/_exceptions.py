"""tether's exceptions.

TetherError
├── ConfigError          a flag, argument or environment variable is wrong; says what to change
├── DumpError            a dump could not be written (nothing half-written is left behind)
├── UnsafeDumpError      a dump file holds something other than plain data, or is not a dump
├── GroupFormationError  some ranks never arrived while a process group was being created
└── AnalysisError        a dump event holds nothing that can be analyzed
"""

from __future__ import annotations

__all__ = [
    "AnalysisError",
    "ConfigError",
    "DumpError",
    "GroupFormationError",
    "TetherError",
    "UnsafeDumpError",
]


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


class AnalysisError(TetherError, ValueError):
    """A dump event cannot be analyzed: no usable dump in it (the message names the files)."""


class TransportError(TetherError, RuntimeError):
    """A one-sided transfer, or setting one up, failed. A failed transfer leaves the destination
    range in an unknown state: treat those bytes as corrupt."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A blocking transport call outlived its timeout. A transfer is never cancelled by this: it
    may still complete later, and its memory stays registered until it does."""


class PeerDiedError(TransportError, ConnectionError):
    """The peer process exited, was killed, or closed its side."""


class RemoteAccessError(TransportError, PermissionError):
    """The memory's owner refused the request: wrong key, out of range, or not registered."""


class TransferInFlightError(TransportError):
    """Memory cannot be unregistered while a transfer that uses it is in flight."""


class DescriptorError(TransportError, ValueError):
    """A descriptor or endpoint URL is malformed, truncated, foreign or of another version."""


class BackendUnavailableError(TransportError):
    """A transport backend is unknown, unsupported on this machine, or its package is missing."""
