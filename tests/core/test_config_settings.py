"""Each setting is described once, on its Config field; everything else is derived from that."""

from __future__ import annotations

import dataclasses
import re
from typing import get_args, get_type_hints

import pytest

from tests._jobs import REPO
from tether import Config, ConfigError, load_config
from tether.config import _SETTING, ENV_VARS, FLAGS, OnHang, Setting, _tables, settings

INTERNAL = {"attempt", "replacement", "agent_relay", "local_world_size"}  # torchrun, tether run
SETTINGS_PAGE = REPO / "docs" / "running.md"  # where the settings are documented


def _squeezed(text: str) -> str:
    return "".join(text.split())  # argparse wraps help, at spaces and after hyphens


def test_every_field_but_the_internal_ones_has_one_description() -> None:
    fields = {f.name: f for f in dataclasses.fields(Config)}
    described = settings()
    assert set(described) == set(fields) - INTERNAL
    for name, setting in described.items():
        assert isinstance(setting, Setting)
        assert fields[name].metadata[_SETTING] is setting
        assert setting.env.startswith("TETHER_") and setting.help.strip(), name
        assert setting.flag is None or setting.flag.startswith("--"), name
        assert not re.search(r"``|:[a-z]+:`", setting.help), f"{name}: help is plain text"
    envs = [s.env for s in described.values()]
    flags = [s.flag for s in described.values() if s.flag]
    assert len(envs) == len(set(envs)) and len(flags) == len(set(flags))


def test_env_vars_and_flags_are_derived_from_the_fields() -> None:
    assert {s.env: name for name, s in settings().items()} == ENV_VARS
    assert {name: s.flag for name, s in settings().items() if s.flag} == FLAGS
    assert _tables(Config) == (ENV_VARS, FLAGS)

    @dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
    class Extended(Config):
        extra: int = dataclasses.field(
            default=1,
            metadata={
                _SETTING: Setting(
                    env="TETHER_EXTRA", flag="--extra", check=int, help="a new setting"
                )
            },
        )

    env_vars, flags = _tables(Extended)
    assert env_vars == {**ENV_VARS, "TETHER_EXTRA": "extra"}
    assert flags == {**FLAGS, "extra": "--extra"}
    assert Extended().to_env()["TETHER_EXTRA"] == "1"
    with pytest.raises(ConfigError, match=r"^extra must be .*\(--extra / TETHER_EXTRA\)"):
        Extended(extra="x")  # type: ignore[arg-type]


def test_on_hang_is_a_literal_and_its_choices_come_from_it() -> None:
    assert settings()["on_hang"].choices == get_args(OnHang) == ("dump", "abort")
    assert get_type_hints(Config)["on_hang"] == OnHang


def test_run_help_lists_each_flag_with_its_help_from_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tether.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out.split("\ntether:", 1)[1]
    for name, flag in FLAGS.items():
        setting = settings()[name]
        assert re.search(rf"^  {re.escape(flag)}\b", text, re.M), flag
        assert _squeezed(setting.help) in _squeezed(text), flag
        assert f"${setting.env}" in text, flag
    assert set(re.findall(r"^  (--[a-z-]+)", text, re.M)) == {*FLAGS.values(), "--no-tether"}


def test_run_options_are_parsed_like_their_variables() -> None:
    from tether.launcher.run import build_parser

    args = build_parser().parse_args(
        ["--ring-size=64", "--debug-port=off", "--dump-on-exit", "--on-hang=dump", "x.py"]
    )
    flags = {name: getattr(args, name) for name in FLAGS}
    config = load_config({"TETHER_RING_SIZE": "8", "TETHER_HANG_TIMEOUT": "9"}, flags=flags)
    assert (config.ring_size, config.debug_port, config.dump_on_exit) == (64, None, True)
    assert (config.on_hang, config.hang_timeout) == ("dump", 9.0), "a flag not given: the env"
    assert load_config({}, flags=flags, ring_size=4).ring_size == 4, "an argument wins"
    with pytest.raises(ConfigError, match=r"^--ring-size must be a whole number, got 'lots'$"):
        load_config({}, flags={"ring_size": "lots"})


def test_settings_page_table_names_each_flag_with_its_variable() -> None:
    rows = [
        line
        for line in SETTINGS_PAGE.read_text().splitlines()
        if line.startswith("| ") and "`TETHER_" in line
    ]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    table = {m.group(1): option for option, env, *_ in cells if (m := re.match(r"`(\w+)", env))}
    for setting in settings().values():
        assert setting.env in table, f"docs/running.md's settings table lacks {setting.env}"
        option = table[setting.env]
        if setting.flag is None:
            assert option == "", setting.env
        else:
            assert option.startswith(f"`{setting.flag}"), setting.env
