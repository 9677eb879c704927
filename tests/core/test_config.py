from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tether import Config, ConfigError, load_config
from tether.config import ENV_VARS


def test_defaults() -> None:
    config = load_config({})
    assert config.ring_size == 2000
    assert config.dump_dir == Path("tether-dumps")
    assert config.stack_depth > 0 and config.dump_on_exit is False


def test_environment_then_argument_precedence() -> None:
    env = {"TETHER_RING_SIZE": "64", "TETHER_DUMP_DIR": "/tmp/x", "TETHER_DUMP_ON_EXIT": "1"}
    from_env = load_config(env)
    assert (from_env.ring_size, from_env.dump_dir, from_env.dump_on_exit) == (
        64,
        Path("/tmp/x"),
        True,
    )
    explicit = load_config(env, ring_size=8, dump_dir=None)
    assert explicit.ring_size == 8, "an explicit argument wins over the environment"
    assert explicit.dump_dir == Path("/tmp/x"), "None means: not given"


def test_job_id_falls_back_to_torchrun_run_id() -> None:
    assert load_config({"TORCHELASTIC_RUN_ID": "abc"}).job_id == "abc"
    assert load_config({"TORCHELASTIC_RUN_ID": "abc", "TETHER_JOB_ID": "j"}).job_id == "j"


def test_to_env_round_trips() -> None:
    config = Config(dump_dir=Path("/d"), ring_size=7, stack_depth=3, job_id="j", dump_on_exit=True)
    env = config.to_env()
    assert set(env) <= set(ENV_VARS)
    assert load_config(env) == config


@pytest.mark.parametrize("size", [-1, -5, 1_000_001])
def test_ring_size_must_be_in_range(size: int) -> None:
    with pytest.raises(ConfigError, match=r"ring_size must be a number of entries in \[0, "):
        Config(ring_size=size)


@pytest.mark.parametrize(
    ("env", "ring_size"),
    [
        ({"TORCH_FR_BUFFER_SIZE": "64"}, 64),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "32"}, 32),
        # torch 2.15's precedence: the TORCH_FR_ name before its NCCL alias
        ({"TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_BUFFER_SIZE": "32"}, 64),
        ({"TORCH_FR_BUFFER_SIZE": "0"}, 0),  # torch: <= 0 turns the recorder off
        ({"TORCH_FR_BUFFER_SIZE": "-3"}, 0),
        ({"TORCH_FR_BUFFER_SIZE": "", "TORCH_NCCL_TRACE_BUFFER_SIZE": "16"}, 16),
        ({}, 2000),  # torch's default too
    ],
)
def test_torch_ring_variables_mean_what_they_mean_to_torch(
    env: dict[str, str], ring_size: int
) -> None:
    assert load_config(env).ring_size == ring_size


def test_torch_dump_variables() -> None:
    config = load_config(
        {
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/fr_",
            "TORCH_INCLUDE_STACK_TRACE": "0",
            "TORCH_INCLUDE_ONLY_ACTIVE": "1",
            "TORCH_FR_DUMP_ON_TIMEOUT": "false",
        }
    )
    assert config.fr_dump_prefix == "/tmp/fr_"
    assert (config.fr_include_stacks, config.fr_only_active, config.dump_on_hang) == (
        False,
        True,
        False,
    )
    assert load_config({}).fr_dump_prefix == ""
    assert (load_config({}).fr_include_stacks, load_config({}).dump_on_hang) == (True, True)
    prefix = {"TORCH_FR_DUMP_TEMP_FILE": "/a/", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/b/"}
    assert load_config(prefix).fr_dump_prefix == "/a/"


def test_tether_variables_win_over_torch_ones_with_one_line_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="tether.config"):
        config = load_config({"TETHER_RING_SIZE": "100", "TORCH_FR_BUFFER_SIZE": "5"})
    assert config.ring_size == 100
    said = [r.getMessage() for r in caplog.records]
    assert said == ["TETHER_RING_SIZE=100 wins over torch's TORCH_FR_BUFFER_SIZE=5"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="tether.config"):  # the same value: nothing to say
        assert load_config({"TETHER_RING_SIZE": "5", "TORCH_FR_BUFFER_SIZE": "5"}).ring_size == 5
    assert caplog.records == []
    assert load_config({"TORCH_FR_BUFFER_SIZE": "5"}, ring_size=7).ring_size == 7


def test_a_bad_torch_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="TORCH_FR_BUFFER_SIZE='many' is not a valid ring_size"):
        load_config({"TORCH_FR_BUFFER_SIZE": "many"})
    with pytest.raises(ConfigError, match=r"TETHER_RING_SIZE, or torch's TORCH_FR_BUFFER_SIZE"):
        load_config({"TORCH_FR_BUFFER_SIZE": "5000000"})


def test_torch_dump_file_defaults_to_torchs_place(tmp_path: Path) -> None:
    from tether.config import fr_dump_file

    home = {"HOME": "/home/u"}
    assert fr_dump_file(load_config({}), 3, home) == Path(
        "/home/u/.cache/torch/comm_lib_trace_rank_3"
    )
    xdg = {**home, "XDG_CACHE_HOME": str(tmp_path)}
    assert fr_dump_file(load_config({}), 0, xdg) == tmp_path / "torch/comm_lib_trace_rank_0"
    given = load_config({"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/trace_"})
    assert fr_dump_file(given, 5, home) == tmp_path / "trace_5"


def test_malformed_environment_value_is_named() -> None:
    with pytest.raises(ConfigError, match="TETHER_RING_SIZE='lots'"):
        load_config({"TETHER_RING_SIZE": "lots"})


def test_unwritable_dump_dir_is_caught_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"not writable.*--dump-dir"):
        Config(dump_dir=blocker / "dumps").check_dump_dir()


def test_public_names_are_complete_and_sorted() -> None:
    import tether

    public = {n for n in dir(tether) if not n.startswith("_") and n not in {"api", "config"}}
    public -= {"recorder", "launcher", "cli", "demo", "server", "watchdog"}
    assert tether.__all__ == sorted(tether.__all__)
    assert public <= set(tether.__all__)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("TETHER_HANG_TIMEOUT", "inf"),
        ("TETHER_HANG_TIMEOUT", "nan"),
        ("TETHER_HANG_TIMEOUT", "0"),
        ("TETHER_HANG_TIMEOUT", "-3"),
        ("TETHER_EXIT_LINGER", "inf"),
        ("TETHER_EXIT_LINGER", "nan"),
        ("TETHER_EXIT_LINGER", "-1"),
    ],
)
def test_durations_must_be_finite_and_in_range(var: str, raw: str) -> None:
    # inf switched hang detection off and made /health fail: JSON cannot carry it.
    with pytest.raises(ConfigError, match=var):
        load_config({var: raw})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        *[("1", True), ("TRUE", True), (" yes ", True), ("On", True)],
        *[("0", False), ("false", False), ("No", False), ("OFF", False)],
    ],
)
def test_boolean_spellings(raw: str, expected: bool) -> None:
    assert load_config({"TETHER_DUMP_ON_EXIT": raw}).dump_on_exit is expected


@pytest.mark.parametrize("raw", ["ture", "2", "enabled"])
def test_unknown_boolean_spelling_is_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"TETHER_DUMP_ON_EXIT=.*1, true, yes, on, 0, false"):
        load_config({"TETHER_DUMP_ON_EXIT": raw})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dump_dir", ""),  # Path("") is the working directory
        ("ring_size", True),
        ("ring_size", "8"),
        ("ring_size", 10**9),
        ("stack_depth", -1),
        ("stack_depth", 100_000),
        ("job_id", "../elsewhere"),
        ("job_id", "a/b"),
        ("dump_on_exit", "yes"),
        ("hang_timeout", float("inf")),
        ("hang_timeout", float("nan")),
        ("hang_timeout", True),
        ("hang_timeout", "5"),
        ("on_hang", "kill"),
        ("debug_host", ""),
        ("debug_port", True),
        ("debug_port", "off"),  # the config's own spelling of off is None
        ("debug_port", 70000),
        ("exit_linger", float("nan")),
        ("exit_linger", 601),
    ],
)
def test_nonsense_is_refused_and_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field} must be .*\(.*TETHER_"):
        Config(**{field: value})  # type: ignore[arg-type]


def test_durations_are_floats() -> None:
    config = Config(hang_timeout=5, exit_linger=0)
    assert (config.hang_timeout, config.exit_linger) == (5.0, 0.0)
    assert type(config.hang_timeout) is float and type(config.exit_linger) is float


@pytest.mark.parametrize("raw", ["off", "OFF", " Off "])
def test_debug_port_off(raw: str) -> None:
    assert load_config({"TETHER_DEBUG_PORT": raw}).debug_port is None
    assert load_config({"TETHER_DEBUG_PORT": "8080"}, debug_port=raw).debug_port is None


def test_debug_port_malformed_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"TETHER_DEBUG_PORT='of'.*0 \(any free port\) or 'off'"):
        load_config({"TETHER_DEBUG_PORT": "of"})
    with pytest.raises(ConfigError, match=r"debug_port='of'.*or 'off'"):
        load_config({}, debug_port="of")


def test_to_env_round_trips_off_and_durations() -> None:
    config = Config(debug_port=None, hang_timeout=2.5, exit_linger=5.0, on_hang="dump")
    assert load_config(config.to_env()) == config


def test_conflicts_name_what_differs_and_where_it_is_set(tmp_path: Path, monkeypatch: Any) -> None:
    from tether.config import conflicts

    installed = Config(dump_dir=tmp_path / "d", hang_timeout=60.0)
    monkeypatch.chdir(tmp_path)
    assert conflicts(installed, {"dump_dir": Path("d"), "hang_timeout": 60.0}) == []
    found = conflicts(installed, {"dump_dir": Path("e"), "debug_port": None, "ring_size": 2000})
    assert found == [
        f"dump_dir {tmp_path / 'e'} (installed: {tmp_path / 'd'}; --dump-dir / TETHER_DUMP_DIR)",
        "debug_port off (installed: 0; --debug-port / TETHER_DEBUG_PORT)",
    ]


def test_attempt_is_torchruns_restart_count() -> None:
    assert load_config({}).attempt == 0
    assert load_config({"TORCHELASTIC_RESTART_COUNT": "3"}).attempt == 3
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        load_config({"TORCHELASTIC_RESTART_COUNT": "x"})
