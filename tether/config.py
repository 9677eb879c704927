"""Configuration, and the one place where tether reads its environment variables.

Precedence, everywhere: an explicit argument > a ``TETHER_*`` environment variable > the default.
The launcher passes its flags to workers through these variables, so a worker reads them here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether._exceptions import ConfigError

__all__ = ["ENV_VARS", "Config", "load_config"]

logger = logging.getLogger(__name__)

#: Every environment variable tether reads, and the config field it feeds.
ENV_VARS: dict[str, str] = {
    "TETHER_DUMP_DIR": "dump_dir",
    "TETHER_RING_SIZE": "ring_size",
    "TETHER_STACK_DEPTH": "stack_depth",
    "TETHER_JOB_ID": "job_id",
    "TETHER_DUMP_ON_EXIT": "dump_on_exit",
    "TETHER_HANG_TIMEOUT": "hang_timeout",
    "TETHER_ON_HANG": "on_hang",
    "TETHER_DEBUG_HOST": "debug_host",
    "TETHER_DEBUG_PORT": "debug_port",
    "TETHER_EXIT_LINGER": "exit_linger",
}

ON_HANG_ACTIONS = ("dump", "abort")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """How this process records and dumps."""

    dump_dir: Path = Path("tether-dumps")
    """Directory that receives one sub-directory per dump event."""
    ring_size: int = 2000
    """Entries kept per process (all groups together); the oldest are dropped first."""
    stack_depth: int = 16
    """Python frames captured per operation; 0 turns stack capture off."""
    job_id: str = ""
    """Identifies the job in dumps (torchrun's run id when launched by ``tether run``)."""
    dump_on_exit: bool = False
    """Dump when the process exits normally (set by ``tether run --dump-on-exit``)."""
    hang_timeout: float = 300.0
    """Seconds an operation may stay in flight before the rank is declared hung and every rank
    dumps."""
    on_hang: str = "abort"
    """After a hang's dumps: "abort" ends the job with a non-zero exit, "dump" keeps running."""
    debug_host: str = "127.0.0.1"
    """Where each rank's debug server listens; anything but loopback requires the job's token."""
    debug_port: int | None = 0
    """The debug server's port: 0 picks a free one, None turns the server off."""
    exit_linger: float = 0.0
    """Seconds a rank that dies of an uncaught exception waits for a job-wide alarm before
    exiting, so that it still dumps into the event of the crash that killed it (a peer's death
    breaks its collectives within milliseconds, before the launcher has noticed). ``tether run``
    sets 5; 0 exits at once."""

    def __post_init__(self) -> None:
        if not isinstance(self.dump_dir, Path):  # accept a str, as every path argument does
            object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        if not isinstance(self.ring_size, int) or self.ring_size <= 0:
            raise ConfigError(
                f"ring_size must be a positive number of entries, got {self.ring_size!r}; "
                "2000 is a good default (--ring-size / TETHER_RING_SIZE)"
            )
        if not self.hang_timeout > 0:
            raise ConfigError(
                f"hang_timeout must be a positive number of seconds, got {self.hang_timeout!r} "
                "(--hang-timeout / TETHER_HANG_TIMEOUT)"
            )
        if self.on_hang not in ON_HANG_ACTIONS:
            raise ConfigError(
                f"on_hang must be one of {', '.join(ON_HANG_ACTIONS)}, got {self.on_hang!r} "
                "(--on-hang / TETHER_ON_HANG)"
            )
        if self.debug_port is not None and not 0 <= self.debug_port <= 65535:
            raise ConfigError(
                f"debug_port must be 0 (any free port) or a port number, got {self.debug_port!r} "
                "(--debug-port / TETHER_DEBUG_PORT)"
            )
        if not 0 <= self.exit_linger <= 600:
            raise ConfigError(
                f"exit_linger must be between 0 and 600 seconds, got {self.exit_linger!r} "
                "(TETHER_EXIT_LINGER)"
            )
        if not isinstance(self.stack_depth, int) or self.stack_depth < 0:
            raise ConfigError(
                f"stack_depth must be 0 (off) or a positive number of frames, got "
                f"{self.stack_depth!r} (TETHER_STACK_DEPTH)"
            )

    def to_env(self) -> dict[str, str]:
        """The variables that give a worker process this configuration (what the launcher sets)."""
        env = {
            "TETHER_DUMP_DIR": str(self.dump_dir),
            "TETHER_RING_SIZE": str(self.ring_size),
            "TETHER_STACK_DEPTH": str(self.stack_depth),
            "TETHER_DUMP_ON_EXIT": "1" if self.dump_on_exit else "0",
            "TETHER_HANG_TIMEOUT": repr(self.hang_timeout),
            "TETHER_ON_HANG": self.on_hang,
            "TETHER_DEBUG_HOST": self.debug_host,
            "TETHER_DEBUG_PORT": "off" if self.debug_port is None else str(self.debug_port),
            "TETHER_EXIT_LINGER": repr(self.exit_linger),
        }
        if self.job_id:
            env["TETHER_JOB_ID"] = self.job_id
        return env

    def check_dump_dir(self) -> Path:
        """Create the dump directory and prove it is writable, so a bad path fails at start-up
        rather than when a hang needs the dump."""
        path = self.dump_dir.expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"dump directory {path} is not writable ({exc.strerror or exc}); "
                "pass --dump-dir / TETHER_DUMP_DIR pointing at a writable directory"
            ) from exc
        return path


_CASTS: dict[str, Any] = {
    "dump_dir": Path,
    "ring_size": int,
    "stack_depth": int,
    "job_id": str,
    "dump_on_exit": lambda v: v.strip().lower() in {"1", "true", "yes", "on"},
    "hang_timeout": float,
    "on_hang": str,
    "debug_host": str,
    "debug_port": lambda v: None if v.strip().lower() == "off" else int(v),
    "exit_linger": float,
}


def load_config(
    env: Mapping[str, str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Config:
    """Build a :class:`Config` from explicit ``overrides`` (ignored when None), then the
    environment, then ``defaults`` (a caller's own, such as the launcher's), then the field
    defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = dict(defaults or {})
    for var, field in ENV_VARS.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            values[field] = _CASTS[field](raw)
        except ValueError as exc:
            raise ConfigError(f"{var}={raw!r} is not a valid {field}: {exc}") from exc
        logger.debug("config %s=%r from %s", field, values[field], var)
    for field, value in overrides.items():
        if value is not None:
            values[field] = value
    if "job_id" not in values:
        # torchrun sets TORCHELASTIC_RUN_ID; it names the job the same way on every node.
        values["job_id"] = env.get("TORCHELASTIC_RUN_ID", "")
    return Config(**values)
