"""What differs between the torch releases tether supports (2.13.0 to 2.15), named in one place.

Every "does this torch have X" question is answered here, once, from what the installed torch
holds (a feature probe where one is cheap, its version where the feature cannot be probed), so
that no other module carries an ``if torch_version`` of its own. docs/compat.md lists, per
release, what tether provides, backports and leaves to torch.

This module imports nothing of tether: ``setup.py`` loads it by path to name the native core.
"""

from __future__ import annotations

import importlib.util
import re

import torch

__all__ = [
    "FSDP_BACKPORT_TESTED",
    "PIPELINING_BACKPORT_TESTED",
    "TORCH",
    "TORCH_FR_AUTO_ATTACH",
    "TORCH_FSDP_CONTROLS",
    "TORCH_PIPELINE_CONTROLS",
    "TORCH_RECONFIGURE",
    "TORCH_TRANSPORT",
    "backend_family",
    "native_module",
    "parse_version",
]


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14, 1)``; a pre-release counts as its release."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


TORCH = parse_version(str(torch.__version__))
"""The installed torch's release."""

TORCH_FR_AUTO_ATTACH = "_maybe_attach_flight_recorder"
"""torch 2.15's function in ``distributed_c10d`` that attaches its own flight recorder
(``FlightRecorderHook``) to each new group whose backend does not record itself; absent before
2.15. tether, which records every group, keeps it from recording a group a second time."""

TORCH_RECONFIGURE = hasattr(torch.distributed, "ProcessGroup") and hasattr(
    torch.distributed.ProcessGroup, "reconfigure"
)
"""torch reconfigures a group in place (2.14+: ``init_process_group(enable_reconfigure=True)``,
``_reconfigure``, gloo's ``ProcessGroup.reconfigure``): tether records through it."""

TORCH_TRANSPORT = importlib.util.find_spec("torch.distributed._transport") is not None
"""torch ships ``torch.distributed._transport`` (2.15+): ``tether.transport``'s interface is then
torch's own classes, and tether's backends are torch transports."""


TORCH_FSDP_CONTROLS = TORCH >= (2, 15, 0)
"""torch has 2.15's FSDP2 controls (``MixedPrecisionPolicy(param_dtype_override_fn=)``,
per-parameter ``grad_dtype``, ``finalize_backward``): ``tether.fsdp`` then hands out torch's own
objects. A release, not a probe: the gradient-dtype half changed behaviour under the same names."""

FSDP_BACKPORT_TESTED = ((2, 13), (2, 14))
"""The torch releases whose private FSDP2 classes ``tether.fsdp`` extends, tested on 2.13.0 and
2.14.1 (their FSDP2 sources differ only in spmd_types support). Any other torch before 2.15 is
refused."""

TORCH_PIPELINE_CONTROLS = TORCH >= (2, 15, 0)
"""torch has 2.15's pipeline memory and communication controls (just-in-time receive buffers,
``WAIT_SEND_*``, ``max_outstanding_sends``, ``unshard_lookahead``, ``defer_reduce_grad_wait``):
``tether.pipelining`` then hands out torch's own classes."""

PIPELINING_BACKPORT_TESTED = ((2, 13), (2, 14))
"""The torch releases whose private pipelining internals ``tether.pipelining`` extends (tested on
2.13.0 and 2.14.1); any other torch before 2.15 is refused."""


NCCL_NAMES = frozenset({"nccl", "nccl2", "nccl-legacy", "nccl-lazy"})
"""torch 2.15's names for NCCL: ``nccl`` is the torchcomms-based ``nccl2`` unless
``TORCH_DIST_USE_NCCL2=0`` keeps the legacy ``ProcessGroupNCCL`` (``nccl-legacy`` names it
whatever the variable says), and ``nccl-lazy`` is ``nccl2`` connecting lazily. Before 2.15, only
``nccl``."""


def backend_family(name: str) -> str:
    """One name for the backends that are one library to their users: ``"nccl"`` for every NCCL
    name above (a group made with any of them answers a debug server's ``?backend=nccl``, and
    holds CUDA tensors), the lower-cased name for any other."""
    lowered = str(name).lower()
    return "nccl" if lowered in NCCL_NAMES else lowered


def native_module(version: str = str(torch.__version__)) -> str:
    """The native core's module for a torch release (``tether._native_2_13_0``).

    A torch extension links against one torch's C++ ABI. Naming the core after the torch it was
    built for lets one checkout hold a core per torch (the 2.13 and 2.14 CI legs share a source
    tree), and a venv whose torch changed finds no core rather than loading one that crashes."""
    return "tether._native_{}_{}_{}".format(*parse_version(version))
