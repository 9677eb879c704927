"""tether's exceptions, the whole tree; a class's standard-library bases are in brackets.

TetherError
├── ConfigError [ValueError]              a setting (flag, variable, config field) to change
├── DumpError [OSError]                   a dump could not be written (none is left half-written)
├── UnsafeDumpError [ValueError]          a file holds more than plain data, or is not a dump
├── GroupFormationError [TimeoutError]    ranks never arrived while a group was being created
├── AnalysisError [ValueError]            a dump event holds nothing that can be analyzed
├── BadAlarmError [ValueError]            a job's alarm key holds something other than an alarm
├── StoreUnreachableError [ConnectionError]  a running job's store does not answer
├── AgentGoneError [ConnectionError]      the node's agent (tether run) closed its relay
├── RankFailedError [RuntimeError]        ranks of an elastic job died; the step is redone
│   └── WorldTooSmallError                    fewer ranks are left than the job's minimum
├── UnsupportedTorchError [RuntimeError]  tether.fsdp's backport meets a torch it was not tested on
├── ClusterUnavailableError [RuntimeError]  simulated nodes cannot be built here (no root, no `ip`)
└── TransportError [RuntimeError]         a one-sided transfer, or setting one up, failed
    ├── TransportTimeoutError [TimeoutError]  a blocking transport call outlived its timeout
    ├── PeerDiedError [ConnectionError]       the peer exited, was killed or closed its side
    ├── RemoteAccessError [PermissionError]   the memory's owner refused the request
    ├── TransferInFlightError                 memory a transfer uses cannot be unregistered
    ├── DescriptorError [ValueError]          a descriptor or endpoint URL is malformed
    └── BackendUnavailableError               a backend is unsupported, not installed or failed
        └── UnknownTransportError [ValueError]    no backend has that name (torch's ValueError)

A wrong argument to a call is a plain ``ValueError`` or ``TypeError``, a transport in the wrong
state a ``TransportError``; ``ConfigError`` names a setting to change.
"""

from __future__ import annotations

__all__ = [
    "AgentGoneError",
    "AnalysisError",
    "BackendUnavailableError",
    "BadAlarmError",
    "ClusterUnavailableError",
    "ConfigError",
    "DescriptorError",
    "DumpError",
    "GroupFormationError",
    "PeerDiedError",
    "RankFailedError",
    "RemoteAccessError",
    "StoreUnreachableError",
    "TetherError",
    "TransferInFlightError",
    "TransportError",
    "TransportTimeoutError",
    "UnknownTransportError",
    "UnsafeDumpError",
    "UnsupportedTorchError",
    "WorldTooSmallError",
]


class TetherError(Exception):
    """Base class of every error tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A setting is invalid: a flag, an environment variable or a config field (the message
    names it). Not for a wrong argument to a call, which is a ValueError or TypeError."""


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


class ClusterUnavailableError(TetherError, RuntimeError):
    """Simulated nodes (:mod:`tether.testing.nodes`) cannot be built here: no root, no ``ip``,
    or the kernel refuses network namespaces (the message says which)."""


class AnalysisError(TetherError, ValueError):
    """A dump event cannot be analyzed: no usable dump in it (the message names the files)."""


class BadAlarmError(TetherError, ValueError):
    """An alarm key holds something other than an alarm (a foreign or corrupted value)."""


class StoreUnreachableError(TetherError, ConnectionError):
    """The job's store did not answer: the job has ended, or this host cannot reach it."""


class AgentGoneError(TetherError, ConnectionError):
    """The node's agent (``tether run``'s launcher) closed its relay (the job's alarms, an
    elastic worker's beats and decisions): it has ended."""


class RankFailedError(TetherError, RuntimeError):
    """Ranks of an elastic job (``tether run --elastic``) died or stopped: the collectives that
    involved them were abandoned. The survivors regroup and redo the step."""

    def __init__(self, message: str, *, dead_ranks: list[int], epoch: int) -> None:
        super().__init__(message)
        self.dead_ranks = dead_ranks
        """The stable (launch-time) global ranks declared dead."""
        self.epoch = epoch
        """The membership decision that declared them dead."""


class WorldTooSmallError(RankFailedError):
    """An elastic job has fewer ranks left than ``--min-world-size``: it stops."""


class UnsupportedTorchError(TetherError, RuntimeError):
    """tether.fsdp backports torch 2.15's FSDP2 controls by extending torch's private FSDP2
    classes, which change between releases: on a torch it was not tested with it refuses to run
    rather than compute something wrong."""


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
    """A transport backend is unsupported on this machine, its package is missing, or it failed
    to load or to be created (torch 2.15 raises ``RuntimeError`` for each)."""


class UnknownTransportError(BackendUnavailableError, ValueError):
    """No transport backend is registered under that name (torch 2.15: a ``ValueError``)."""
