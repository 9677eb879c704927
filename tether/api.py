"""``tether.init_process_group``: torch's, with recording on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from tether._exceptions import ConfigError
from tether.runtime import install_with

__all__ = ["init_process_group"]


def init_process_group(
    backend: str | None = None,
    *args: Any,
    dump_dir: str | Path | None = None,
    ring_size: int | None = None,
    stack_depth: int | None = None,
    hang_timeout: float | None = None,
    on_hang: str | None = None,
    debug_host: str | None = None,
    debug_port: int | Literal["off"] | None = None,
    **kwargs: Any,
) -> None:
    """Same parameters as :func:`torch.distributed.init_process_group`, plus tether's own
    (keyword-only; each overrides its ``TETHER_*`` environment variable, and None means "not
    given"). ``debug_port="off"`` turns the debug server off, as ``--debug-port off`` does. The
    default group and every group created afterwards are recorded.

    When tether is already installed (``tether run`` installs it from its flags before the
    script starts; so does an earlier :func:`tether.install`), its recorder and watchdog already
    run: a setting given here must agree with the installed one, and any that does not raises
    :class:`~tether.ConfigError` naming it and its ``tether run`` flag or environment variable,
    before the group is created."""
    if backend is not None:
        _check_backend(backend)
    install_with(
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
        ring_size=ring_size,
        stack_depth=stack_depth,
        hang_timeout=hang_timeout,
        on_hang=on_hang,
        debug_host=debug_host,
        debug_port=debug_port,
    )
    dist.init_process_group(backend, *args, **kwargs)


def _check_backend(backend: str) -> None:
    known = set(dist.Backend.backend_list) | {name.lower() for name in dist.Backend._plugins}
    # "cpu:gloo,cuda:nccl" names one backend per device.
    names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"unknown backend {unknown[0]!r}; use one of {sorted(known)} or register a "
            "third-party backend with torch.distributed.Backend.register_backend first"
        )
