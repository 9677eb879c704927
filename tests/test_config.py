from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("size", [0, -5])
def test_ring_size_must_be_positive(size: int) -> None:
    with pytest.raises(ConfigError, match="ring_size must be a positive"):
        Config(ring_size=size)


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
