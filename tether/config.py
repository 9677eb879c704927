"""Configuration, and the one place where tether reads its environment variables.

Precedence, everywhere: an explicit argument > a ``TETHER_*`` environment variable > the default.
The launcher passes its flags to workers through these variables, so a worker reads them here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from tether._exceptions import ConfigError

__all__ = ["ENV_VARS", "FLAGS", "Config", "conflicts", "load_config"]

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

#: The ``tether run`` flag of each config field that has one.
FLAGS: dict[str, str] = {
    "dump_dir": "--dump-dir",
    "ring_size": "--ring-size",
    "dump_on_exit": "--dump-on-exit",
    "hang_timeout": "--hang-timeout",
    "on_hang": "--on-hang",
    "debug_host": "--debug-host",
    "debug_port": "--debug-port",
}

ON_HANG_ACTIONS = ("dump", "abort")
MAX_RING = 1_000_000
"""Entries per rank at most: torch keeps 2000 by default, and a million is ~1 GB of records."""
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
DEBUG_PORT_OFF = "off"
"""How ``--debug-port``, ``TETHER_DEBUG_PORT`` and the API spell "no debug server"."""


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
    attempt: int = 0
    """torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``): what an earlier attempt of the
    job left in the store (its processes' ids) is not this one's."""
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
    """The debug server's port: 0 picks a free one, None turns the server off (spelled "off" by
    ``--debug-port``, ``TETHER_DEBUG_PORT`` and :func:`tether.init_process_group`)."""
    exit_linger: float = 0.0
    """Seconds a rank that dies of an uncaught exception waits for a job-wide alarm before
    exiting, so that it still dumps into the event of the crash that killed it (a peer's death
    breaks its collectives within milliseconds, before the launcher has noticed). ``tether run``
    sets 5; 0 exits at once."""

    def __post_init__(self) -> None:
        _check_dump_dir(self)
        # The ring holds a slot per entry from the start: a typo of a few zeros must not take
        # the rank's memory.
        _check_int(
            "ring_size",
            self.ring_size,
            minimum=1,
            maximum=MAX_RING,
            what="a positive number of entries",
        )
        _check_int(
            "stack_depth", self.stack_depth, minimum=0, maximum=256, what="a number of frames"
        )
        _check_job_id(self.job_id)
        if not isinstance(self.dump_on_exit, bool):
            raise ConfigError(
                f"dump_on_exit must be True or False, got {self.dump_on_exit!r} "
                f"({_where('dump_on_exit')})"
            )
        _check_seconds(self, "hang_timeout", allow_zero=False, maximum=math.inf)
        if self.on_hang not in ON_HANG_ACTIONS:
            raise ConfigError(
                f"on_hang must be one of {', '.join(ON_HANG_ACTIONS)}, got {self.on_hang!r} "
                f"({_where('on_hang')})"
            )
        if not isinstance(self.debug_host, str) or not self.debug_host.strip():
            # An empty bind address would listen on every interface: make that a visible choice.
            raise ConfigError(
                f"debug_host must be a host name or address, got {self.debug_host!r}; "
                f"0.0.0.0 listens on every interface ({_where('debug_host')})"
            )
        if self.debug_port is not None and (
            not _is_int(self.debug_port) or not 0 <= self.debug_port <= 65535
        ):
            raise ConfigError(
                f"debug_port must be 0 (any free port), a port number or None (off), got "
                f"{self.debug_port!r} ({_where('debug_port')})"
            )
        _check_seconds(self, "exit_linger", allow_zero=True, maximum=600.0)

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
            "TETHER_DEBUG_PORT": DEBUG_PORT_OFF
            if self.debug_port is None
            else str(self.debug_port),
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


def _where(field: str) -> str:
    """Where a user sets ``field``: its flag of ``tether run``, if any, and its variable."""
    var = next(v for v, f in ENV_VARS.items() if f == field)
    return f"{FLAGS[field]} / {var}" if field in FLAGS else var


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python


def _check_int(field: str, value: object, *, minimum: int, maximum: int, what: str) -> None:
    if not (_is_int(value) and minimum <= value <= maximum):
        raise ConfigError(
            f"{field} must be {what} in [{minimum}, {maximum}], got {value!r} ({_where(field)})"
        )


def _check_seconds(config: Config, field: str, *, allow_zero: bool, maximum: float) -> None:
    """A duration: a real, finite number of seconds (inf or NaN would switch the timer off
    without a word, and JSON cannot carry either)."""
    value = getattr(config, field)
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if ok and (value > 0 or (allow_zero and value == 0)) and value <= maximum:
        object.__setattr__(config, field, float(value))
        return
    bounds = (
        "a finite, positive number of seconds"
        if maximum == math.inf
        else f"between 0 and {maximum:g} seconds"
    )
    raise ConfigError(f"{field} must be {bounds}, got {value!r} ({_where(field)})")


def _check_dump_dir(config: Config) -> None:
    value: object = config.dump_dir
    if value == "" or not isinstance(value, (str, os.PathLike)):  # Path("") is the cwd
        raise ConfigError(
            f"dump_dir must be a directory path, got {value!r} ({_where('dump_dir')})"
        )
    if not isinstance(value, Path):  # accept a str, as every path argument does
        object.__setattr__(config, "dump_dir", Path(value))


def _check_job_id(job_id: object) -> None:
    # The job id names a file under DUMP_DIR/.jobs: it must not be able to leave that directory.
    if not isinstance(job_id, str) or job_id in {".", ".."} or any(c in job_id for c in "/\\\0"):
        raise ConfigError(
            f"job_id must be a name without path separators, got {job_id!r} "
            "(TETHER_JOB_ID, or torchrun's --rdzv-id)"
        )


def parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)} (any case)")


def parse_debug_port(raw: str | int) -> int | None:
    """A port number, 0 (any free port) or "off" (None: no debug server)."""
    if isinstance(raw, str) and raw.strip().lower() == DEBUG_PORT_OFF:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"expected a port number, 0 (any free port) or {DEBUG_PORT_OFF!r}"
        ) from None


_CASTS: dict[str, Any] = {
    "dump_dir": Path,
    "ring_size": int,
    "stack_depth": int,
    "job_id": str,
    "dump_on_exit": parse_bool,
    "hang_timeout": float,
    "on_hang": str,
    "debug_host": str,
    "debug_port": parse_debug_port,
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
    defaults. An override ``debug_port="off"`` turns the debug server off (None cannot: it means
    "not given")."""
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
        if field == "debug_port" and isinstance(value, str):
            try:
                value = parse_debug_port(value)
            except ValueError as exc:
                raise ConfigError(f"debug_port={value!r} is not valid: {exc}") from exc
            values[field] = value
        elif value is not None:
            values[field] = value
    if "job_id" not in values:
        # torchrun sets TORCHELASTIC_RUN_ID; it names the job the same way on every node.
        values["job_id"] = env.get("TORCHELASTIC_RUN_ID", "")
    raw = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        values["attempt"] = int(raw)
    except ValueError as exc:
        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={raw!r} is not a number") from exc
    return Config(**values)


def conflicts(installed: Config, wanted: Mapping[str, Any]) -> list[str]:
    """The settings in ``wanted`` (field: value, as a :class:`Config` holds it) that differ from
    ``installed``, each described with where it is set."""
    out = []
    for field, value in wanted.items():
        have = getattr(installed, field)
        if field == "dump_dir":  # the same directory, however spelled
            have, value = have.expanduser().resolve(), Path(value).expanduser().resolve()
        if have != value:
            out.append(f"{field} {_show(value)} (installed: {_show(have)}; {_where(field)})")
    return out


def _show(value: object) -> str:
    if value is None:  # only debug_port may be None
        return DEBUG_PORT_OFF
    return str(value) if isinstance(value, Path) else repr(value)
