"""Configuration, and the one place where tether reads its environment variables.

Precedence, everywhere: an explicit argument (a ``tether run`` flag is one) > a ``TETHER_*``
environment variable > torch's own variable for the same thing (``TORCH_FR_BUFFER_SIZE`` for the
ring, and the others on :class:`Setting.torch_env`), so that a job set up for torch's flight
recorder behaves the same under tether > the default. The launcher passes its flags to workers
through these variables, so a worker reads them here.

Each setting is described once, on its :class:`Config` field (a :class:`Setting` in the field's
metadata): its variable, its ``tether run`` flag, how a string is parsed, what a value must be,
and its help text. :data:`ENV_VARS`, :data:`FLAGS`, :func:`load_config`, :meth:`Config.to_env`,
the checks and ``tether run``'s options are all derived from those descriptions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_args

from tether._exceptions import ConfigError

__all__ = [
    "AGENT_RELAY_ENV",
    "ENV_VARS",
    "FLAGS",
    "Config",
    "Setting",
    "conflicts",
    "fr_dump_file",
    "load_config",
    "pipeline_per_edge_p2p_default",
    "settings",
]

logger = logging.getLogger(__name__)

AGENT_RELAY_ENV = "TETHER_AGENT_RELAY"
"""Where ``tether run`` names its alarm relay to its workers (:attr:`Config.agent_relay`)."""

OnHang = Literal["dump", "abort"]
"""What a rank does after a hang's dumps."""
ON_HANG_ACTIONS: tuple[OnHang, ...] = get_args(OnHang)
RecorderKind = Literal["auto", "native", "python"]
"""Which recorder records: the native core where it loads, or the Python one."""
RECORDER_KINDS: tuple[RecorderKind, ...] = get_args(RecorderKind)
MAX_RING = 1_000_000
"""Entries per rank at most: torch keeps 2000 by default, and a million is ~1 GB of records."""
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
DEBUG_PORT_OFF = "off"
"""How ``--debug-port``, ``TETHER_DEBUG_PORT`` and the API spell "no debug server"."""


def _as_is(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """Everything about one :class:`Config` field that a user sets from outside Python."""

    env: str
    """The environment variable."""
    help: str
    """What it does, in plain text: the field's documentation and its ``--help`` line."""
    parse: Callable[[str], Any] = str
    """A string (variable or flag) to the value; ValueError says what was expected."""
    check: Callable[[Any], Any] = _as_is
    """The value as :class:`Config` holds it; ValueError says what it must be."""
    to_str: Callable[[Any], str] = str
    """The value as its variable spells it: ``parse(to_str(v)) == v``."""
    flag: str | None = None
    """Its ``tether run`` option, if it has one."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    """The only values a string may take, if so few (``--help`` lists them)."""
    also: str = ""
    """Another way it is set, for error messages."""
    torch_env: tuple[str, ...] = ()
    """torch's variables for the same setting, the first set of them read when ``env`` is not
    set (torch 2.15's precedence: ``TORCH_FR_*`` before its ``TORCH_NCCL_*`` alias)."""
    torch_parse: Callable[[str], Any] | None = None
    """How torch spells a value, where it differs from ``parse``."""


_SETTING = "tether.setting"
"""The key of a field's :class:`Setting` in its ``metadata``."""


def parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"one of {', '.join(TRUE_WORDS + FALSE_WORDS)} (any case)")


def parse_debug_port(raw: str | int) -> int | None:
    """A port number, 0 (any free port) or "off" (None: no debug server)."""
    if isinstance(raw, str) and raw.strip().lower() == DEBUG_PORT_OFF:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"a port number, 0 (any free port) or {DEBUG_PORT_OFF!r}") from None


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("a whole number") from None


def _parse_torch_ring(raw: str) -> int:
    return max(0, _parse_int(raw))  # torch: "<= 0 disables" the flight recorder


def _parse_seconds(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("a number of seconds") from None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python


def _int_in(minimum: int, maximum: int, what: str) -> Callable[[object], int]:
    def check(value: object) -> int:
        if _is_int(value) and minimum <= value <= maximum:
            return value
        raise ValueError(f"{what} in [{minimum}, {maximum}], got {value!r}")

    return check


def _seconds(*, allow_zero: bool, maximum: float) -> Callable[[object], float]:
    """A duration: a real, finite number of seconds (inf or NaN would switch the timer off
    without a word, and JSON cannot carry either)."""

    def check(value: object) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            in_range = value > 0 or (allow_zero and value == 0)
            if math.isfinite(value) and in_range and value <= maximum:
                return float(value)
        bounds = (
            "a finite, positive number of seconds"
            if maximum == math.inf
            else f"between 0 and {maximum:g} seconds"
        )
        raise ValueError(f"{bounds}, got {value!r}")

    return check


def _dir_path(value: object) -> Path:
    if value == "" or not isinstance(value, (str, os.PathLike)):  # Path("") is the cwd
        raise ValueError(f"a directory path, got {value!r}")
    return value if isinstance(value, Path) else Path(value)  # a str, as every path argument


def _job_name(value: object) -> str:
    # The job id names a file under DUMP_DIR/.jobs: it must not be able to leave that directory.
    if not isinstance(value, str) or value in {".", ".."} or any(c in value for c in "/\\\0"):
        raise ValueError(f"a name without path separators, got {value!r}")
    return value


def _store_url(value: object) -> str:
    # The endpoints themselves are parsed where the store is reached (tether.job.etcd).
    if value == "" or (isinstance(value, str) and value.startswith("etcd://") and value[7:]):
        return str(value)
    raise ValueError(f"etcd://host:port[,host:port...], got {value!r}")


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"True or False, got {value!r}")
    return value


def _recorder_kind(value: object) -> RecorderKind:
    if isinstance(value, str) and value in RECORDER_KINDS:
        return value
    raise ValueError(f"one of {', '.join(RECORDER_KINDS)}, got {value!r}")


def _on_hang(value: object) -> OnHang:
    if isinstance(value, str) and value in ON_HANG_ACTIONS:
        return value
    raise ValueError(f"one of {', '.join(ON_HANG_ACTIONS)}, got {value!r}")


def _host(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        # An empty bind address would listen on every interface: make that a visible choice.
        raise ValueError(
            f"a host name or address, got {value!r}; 0.0.0.0 listens on every interface"
        )
    return value


def _port(value: object) -> int | None:
    if value is None or (_is_int(value) and 0 <= value <= 65535):
        return value
    raise ValueError(f"0 (any free port), a port number or None (off), got {value!r}")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """How this process records and dumps. Each field's documentation is its setting's
    ``help``; ``settings()[name]`` holds the rest of its description."""

    dump_dir: Path = dataclasses.field(
        default=Path("tether-dumps"),
        metadata={
            _SETTING: Setting(
                env="TETHER_DUMP_DIR",
                flag="--dump-dir",
                parse=Path,
                check=_dir_path,
                help="directory that receives one sub-directory per dump event; checked writable "
                "at start",
            )
        },
    )
    # The ring holds a slot per entry from the start: a typo of a few zeros must not take the
    # rank's memory.
    ring_size: int = dataclasses.field(
        default=2000,
        metadata={
            _SETTING: Setting(
                env="TETHER_RING_SIZE",
                flag="--ring-size",
                parse=_parse_int,
                check=_int_in(0, MAX_RING, "a number of entries"),
                torch_env=("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                torch_parse=_parse_torch_ring,
                help="operations kept per process (all groups together), oldest dropped first; 0 "
                "turns recording off (no group is recorded, no hang detected)",
            )
        },
    )
    fr_dump_prefix: str = dataclasses.field(
        default="",
        metadata={
            _SETTING: Setting(
                env="TETHER_FR_DUMP_PREFIX",
                torch_env=("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
                help="each dump of a rank also goes, as torch's single-rank dump, to this prefix "
                "followed by the global rank (where torch's own recorder writes it); empty: "
                "only the dump directory",
            )
        },
    )
    fr_include_stacks: bool = dataclasses.field(
        default=True,
        metadata={
            _SETTING: Setting(
                env="TETHER_FR_INCLUDE_STACKS",
                parse=parse_bool,
                check=_flag,
                to_str=lambda on: "1" if on else "0",
                torch_env=("TORCH_INCLUDE_STACK_TRACE",),
                help="torch-shaped single-rank dumps (the prefix file, the debug server's "
                "fr_trace) carry each operation's stack",
            )
        },
    )
    fr_only_active: bool = dataclasses.field(
        default=False,
        metadata={
            _SETTING: Setting(
                env="TETHER_FR_ONLY_ACTIVE",
                parse=parse_bool,
                check=_flag,
                to_str=lambda on: "1" if on else "0",
                torch_env=("TORCH_INCLUDE_ONLY_ACTIVE",),
                help="torch-shaped single-rank dumps leave out completed operations",
            )
        },
    )
    stack_depth: int = dataclasses.field(
        default=16,
        metadata={
            _SETTING: Setting(
                env="TETHER_STACK_DEPTH",
                parse=_parse_int,
                check=_int_in(0, 256, "a number of frames"),
                help="Python frames captured per operation; 0 turns stack capture off",
            )
        },
    )
    recorder: RecorderKind = dataclasses.field(
        default="auto",
        metadata={
            _SETTING: Setting(
                env="TETHER_RECORDER",
                flag="--recorder",
                choices=RECORDER_KINDS,
                check=_recorder_kind,
                help="'native': the C++ core records (an error where it cannot load), 'python': "
                "the Python recorder, 'auto': the native core where it loads",
            )
        },
    )
    job_id: str = dataclasses.field(
        default="",
        metadata={
            _SETTING: Setting(
                env="TETHER_JOB_ID",
                check=_job_name,
                also="or torchrun's --rdzv-id",
                help="names the job in dumps (torchrun's run id when launched by tether run); no "
                "path separators",
            )
        },
    )
    attempt: int = 0
    """torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``): what an earlier attempt of the
    job left in the store (its processes' ids) is not this one's. Not a setting: torchrun's."""
    replacement: int = 0
    """Which replacement of its rank this worker is in an elastic job (0: launched with the job;
    ``TETHER_ELASTIC_REPLACEMENT``, set by ``tether run --elastic``): it joins a running job."""
    agent_relay: str = ""
    """Where ``tether run``'s agent on this node relays the job's alarms
    (:data:`AGENT_RELAY_ENV`, set by ``tether run``; empty: the rank looks for them in the job's
    store itself). Not a setting: the launcher's."""
    local_world_size: int = 0
    """How many workers its launcher runs on this node (torchrun's ``LOCAL_WORLD_SIZE``; 0:
    not launched by torchrun). An elastic job's HSDP mesh shards within a node. Not a setting:
    torchrun's."""
    dump_on_exit: bool = dataclasses.field(
        default=False,
        metadata={
            _SETTING: Setting(
                env="TETHER_DUMP_ON_EXIT",
                flag="--dump-on-exit",
                parse=parse_bool,
                check=_flag,
                to_str=lambda on: "1" if on else "0",
                help="every worker dumps when it exits normally (event reason 'exit')",
            )
        },
    )
    hang_timeout: float = dataclasses.field(
        default=300.0,
        metadata={
            _SETTING: Setting(
                env="TETHER_HANG_TIMEOUT",
                flag="--hang-timeout",
                metavar="SECONDS",
                parse=_parse_seconds,
                check=_seconds(allow_zero=False, maximum=math.inf),
                to_str=repr,
                help="seconds an operation may stay in flight before its rank is declared hung and "
                "every rank dumps",
            )
        },
    )
    dump_on_hang: bool = dataclasses.field(
        default=True,
        metadata={
            _SETTING: Setting(
                env="TETHER_DUMP_ON_HANG",
                parse=parse_bool,
                check=_flag,
                to_str=lambda on: "1" if on else "0",
                torch_env=("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"),
                help="a hang makes every rank dump; off, the rank reports itself unhealthy (the "
                "debug server's c10d_health_check) and dumps only when asked",
            )
        },
    )
    on_hang: OnHang = dataclasses.field(
        default="abort",
        metadata={
            _SETTING: Setting(
                env="TETHER_ON_HANG",
                flag="--on-hang",
                choices=ON_HANG_ACTIONS,
                check=_on_hang,
                help="after a hang's dumps, 'abort' ends the job with a non-zero exit, 'dump' "
                "keeps running",
            )
        },
    )
    debug_host: str = dataclasses.field(
        default="127.0.0.1",
        metadata={
            _SETTING: Setting(
                env="TETHER_DEBUG_HOST",
                flag="--debug-host",
                check=_host,
                help="where each rank's debug server listens; anything but loopback requires the "
                "job's token",
            )
        },
    )
    debug_port: int | None = dataclasses.field(
        default=0,
        metadata={
            _SETTING: Setting(
                env="TETHER_DEBUG_PORT",
                flag="--debug-port",
                metavar="PORT|off",
                parse=parse_debug_port,
                check=_port,
                to_str=lambda port: DEBUG_PORT_OFF if port is None else str(port),
                help="the debug server's port: 0 picks a free one, 'off' (None in Python) turns "
                "the server off",
            )
        },
    )
    exit_linger: float = dataclasses.field(
        default=0.0,
        metadata={
            _SETTING: Setting(
                env="TETHER_EXIT_LINGER",
                parse=_parse_seconds,
                check=_seconds(allow_zero=True, maximum=600.0),
                to_str=repr,
                help="seconds a rank that dies of an uncaught exception may take to dump into the "
                "crash's event before exiting: its own exception raises the job's crash alarm "
                "and waits for its dump (milliseconds); an error out of torch.distributed (a "
                "peer's death breaks its collectives before the launcher has noticed) waits "
                "for the alarm of whoever saw the death; tether run sets 5, 0 exits at once",
            )
        },
    )

    store: str = dataclasses.field(
        default="",
        metadata={
            _SETTING: Setting(
                env="TETHER_STORE",
                flag="--store",
                metavar="etcd://HOST:PORT,...",
                check=_store_url,
                help="keeps what tether puts in the job's store (alarms, heartbeats, membership "
                "decisions, regroups) in this etcd cluster, which outlives any node; default: "
                "torchrun's store, on node 0",
            )
        },
    )
    elastic: bool = dataclasses.field(
        default=False,
        metadata={
            _SETTING: Setting(
                env="TETHER_ELASTIC",
                flag="--elastic",
                parse=parse_bool,
                check=_flag,
                to_str=lambda on: "1" if on else "0",
                help="the job goes on when a rank dies: the survivors regroup and redo the step, "
                "and the launcher starts a replacement for the dead worker alone (README, "
                "'Elastic')",
            )
        },
    )
    heartbeat_timeout: float = dataclasses.field(
        default=2.0,
        metadata={
            _SETTING: Setting(
                env="TETHER_HEARTBEAT_TIMEOUT",
                flag="--heartbeat-timeout",
                metavar="SECONDS",
                parse=_parse_seconds,
                check=_seconds(allow_zero=False, maximum=600.0),
                to_str=repr,
                help="with --elastic, seconds without a heartbeat after which a rank that is "
                "still a process (stopped, or stuck holding the GIL) is declared dead; a rank "
                "whose process ends is declared dead at once",
            )
        },
    )
    min_world_size: int = dataclasses.field(
        default=1,
        metadata={
            _SETTING: Setting(
                env="TETHER_MIN_WORLD_SIZE",
                flag="--min-world-size",
                metavar="N",
                parse=_parse_int,
                check=_int_in(1, 1 << 20, "a rank count"),
                help="with --elastic, the job stops (every rank raises WorldTooSmallError) when "
                "fewer ranks than this are left",
            )
        },
    )
    max_replacements: int = dataclasses.field(
        default=3,
        metadata={
            _SETTING: Setting(
                env="TETHER_MAX_REPLACEMENTS",
                flag="--max-replacements",
                metavar="N",
                parse=_parse_int,
                check=_int_in(0, 1 << 20, "a count"),
                help="with --elastic, how many replacement workers each launcher starts in all "
                "(0: the job goes on with the survivors alone)",
            )
        },
    )

    def __post_init__(self) -> None:
        for name, described in settings(type(self)).items():
            value = getattr(self, name)
            try:
                checked = described.check(value)
            except ValueError as exc:
                raise ConfigError(f"{name} must be {exc} ({_where(described)})") from None
            if checked is not value:  # frozen: the one way to normalize (a str path, an int)
                object.__setattr__(self, name, checked)

    def to_env(self) -> dict[str, str]:
        """The variables that give a worker process this configuration (what the launcher sets);
        an empty one (no job id) is left out, as an empty variable means "not set"."""
        env = {s.env: s.to_str(getattr(self, name)) for name, s in settings(type(self)).items()}
        return {var: raw for var, raw in env.items() if raw}

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


def settings(cls: type[Config] = Config) -> dict[str, Setting]:
    """Each field of ``cls`` that a user sets, and its description, in field order."""
    return {f.name: f.metadata[_SETTING] for f in dataclasses.fields(cls) if _SETTING in f.metadata}


def _tables(cls: type[Config]) -> tuple[dict[str, str], dict[str, str]]:
    described = settings(cls)
    env_vars = {s.env: name for name, s in described.items()}
    flags = {name: s.flag for name, s in described.items() if s.flag is not None}
    return env_vars, flags


ENV_VARS: dict[str, str]
"""Every environment variable tether reads, and the config field it feeds."""
FLAGS: dict[str, str]
"""The ``tether run`` flag of each config field that has one."""
ENV_VARS, FLAGS = _tables(Config)
_SETTINGS = settings()


def _where(described: Setting | None) -> str:
    """Where a user sets a field: its flag of ``tether run``, if any, and its variable."""
    if described is None:  # attempt: torchrun counts its restarts
        return "set by torchrun"
    where = f"{described.flag} / {described.env}" if described.flag else described.env
    if described.torch_env:
        where = f"{where}, or torch's {' / '.join(described.torch_env)}"
    return f"{where}, {described.also}" if described.also else where


def load_config(
    env: Mapping[str, str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    flags: Mapping[str, str | bool | None] | None = None,
    **overrides: Any,
) -> Config:
    """Build a :class:`Config` from explicit ``overrides`` (ignored when None), then ``flags``,
    then the environment, then ``defaults`` (a caller's own, such as the launcher's), then the
    field defaults. An override ``debug_port="off"`` turns the debug server off (None cannot: it
    means "not given").

    ``flags`` is ``tether run``'s command line as argparse left it, by field: the string given
    to a flag, True for a switch given, None for a flag not given."""
    env = os.environ if env is None else env
    values: dict[str, Any] = dict(defaults or {})
    for name, described in _SETTINGS.items():
        found = _from_env(env, name, described)
        if found is not _UNSET:
            values[name] = found
    for name, given in (flags or {}).items():
        if given is None:
            continue
        described = _SETTINGS[name]
        if isinstance(given, bool):  # a switch
            values[name] = given
            continue
        try:
            values[name] = described.parse(given)
        except ValueError as exc:
            raise ConfigError(f"{described.flag} must be {exc}, got {given!r}") from exc
    for name, value in overrides.items():
        if name == "debug_port" and isinstance(value, str):
            try:
                value = parse_debug_port(value)
            except ValueError as exc:
                raise ConfigError(f"debug_port={value!r} is not valid: expected {exc}") from exc
            values[name] = value
        elif value is not None:
            values[name] = value
    if "job_id" not in values:
        # torchrun sets TORCHELASTIC_RUN_ID; it names the job the same way on every node.
        values["job_id"] = env.get("TORCHELASTIC_RUN_ID", "")
    values["agent_relay"] = env.get(AGENT_RELAY_ENV, "")
    for field, var in (
        ("attempt", "TORCHELASTIC_RESTART_COUNT"),
        ("replacement", "TETHER_ELASTIC_REPLACEMENT"),
        ("local_world_size", "LOCAL_WORLD_SIZE"),
    ):
        raw = env.get(var, "0")
        try:
            values[field] = int(raw)
        except ValueError as exc:
            raise ConfigError(f"{var}={raw!r} is not a number") from exc
    return Config(**values)


_UNSET: Any = object()
"""Not set by the environment (None is a value: ``debug_port`` off)."""


def _from_env(env: Mapping[str, str], name: str, described: Setting) -> Any:
    """The value ``env`` gives a setting (:data:`_UNSET`: none), from its ``TETHER_*``
    variable, else from the first of torch's variables that is set; where both are set and
    disagree, one line says which wins."""
    raw = env.get(described.env) or None
    torch_var = next((var for var in described.torch_env if env.get(var)), None)
    value = _UNSET if raw is None else _parse(described.env, raw, name, described.parse)
    if torch_var is not None:
        parse = described.torch_parse or described.parse
        torch_value = _parse(torch_var, env[torch_var], name, parse)
        if value is _UNSET:
            value = torch_value
        elif torch_value != value:
            logger.warning(
                "%s=%s wins over torch's %s=%s", described.env, raw, torch_var, env[torch_var]
            )
    return value


def _parse(var: str, raw: str, name: str, parse: Callable[[str], Any]) -> Any:
    try:
        value = parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r} is not a valid {name}: expected {exc}") from exc
    logger.debug("config %s=%r from %s", name, value, var)
    return value


PIPELINE_PER_EDGE_P2P_VAR = "TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P"
"""torch 2.15's variable for ``pipeline_per_edge_p2p`` (not a job setting: tether.pipelining's)."""


def pipeline_per_edge_p2p_default(env: Mapping[str, str] | None = None) -> bool:
    """Whether pipeline schedules use one P2P group per directed edge, as torch 2.15's
    ``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P`` says (default off)."""
    env = os.environ if env is None else env
    raw = env.get(PIPELINE_PER_EDGE_P2P_VAR) or None
    if raw is None:
        return False
    parsed: bool = _parse(PIPELINE_PER_EDGE_P2P_VAR, raw, "pipeline_per_edge_p2p", parse_bool)
    return parsed


def fr_dump_file(config: Config, rank: int, env: Mapping[str, str] | None = None) -> Path:
    """Where a torch-shaped single-rank dump of ``rank`` goes when torch's debug frontend asks
    for one: ``fr_dump_prefix`` followed by the rank, else where torch 2.15 writes it,
    ``${XDG_CACHE_HOME:-$HOME/.cache}/torch/comm_lib_trace_rank_<rank>``."""
    if config.fr_dump_prefix:
        return Path(f"{config.fr_dump_prefix}{rank}")
    env = os.environ if env is None else env
    home = env.get("HOME")
    cache = env.get("XDG_CACHE_HOME") or (f"{home}/.cache" if home else tempfile.gettempdir())
    return Path(cache) / "torch" / f"comm_lib_trace_rank_{rank}"


def conflicts(installed: Config, wanted: Mapping[str, Any]) -> list[str]:
    """The settings in ``wanted`` (field: value, as a :class:`Config` holds it) that differ from
    ``installed``, each described with where it is set."""
    out = []
    for field, value in wanted.items():
        have = getattr(installed, field)
        if field == "dump_dir":  # the same directory, however spelled
            have, value = have.expanduser().resolve(), Path(value).expanduser().resolve()
        if have != value:
            where = _where(_SETTINGS.get(field))
            out.append(f"{field} {_show(value)} (installed: {_show(have)}; {where})")
    return out


def _show(value: object) -> str:
    if value is None:  # only debug_port may be None
        return DEBUG_PORT_OFF
    return str(value) if isinstance(value, Path) else repr(value)
