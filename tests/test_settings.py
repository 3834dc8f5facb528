"""Every setting, declared once in config.Settings, through all its layers:
defaults < the settings file (its global keys, then the model's section) <
TIERLM_* variables < the command line's flags."""

from __future__ import annotations

import json

import pytest

from tierlm.cli import _settings, build_parser
from tierlm.config import Settings, env_var, load_settings, setting_fields

SETTINGS = [f.name for f in setting_fields()]


def values_for(f) -> tuple:
    """Three values of the setting's type, each unlike the one before and the first
    unlike the default."""
    kind = f.type.split("|")[0].strip()
    if kind == "bool":
        return (not f.default, f.default, not f.default)
    if kind in ("int", "float"):
        base = f.default or 0
        return tuple(type(base)(base + k) if kind == "int" else float(base + k / 2) for k in (1, 2, 3))
    return ("from-file", "from-env", "from-cli")


def toml_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def flag_args(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, str(value)]


def serve_settings(argv: list[str]) -> Settings:
    return _settings(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in SETTINGS:
        monkeypatch.delenv(env_var(name), raising=False)
    monkeypatch.setenv("TIERLM_CONFIG", str(tmp_path / "none.toml"))
    return monkeypatch


@pytest.mark.parametrize("name", SETTINGS)
def test_each_setting_through_every_layer(name, clean_env, tmp_path):
    f = next(f for f in setting_fields() if f.name == name)
    in_file, in_env, on_cli = values_for(f)
    assert f.metadata["help"], "every setting says what it does"
    assert serve_settings([]).__getattribute__(name) == f.default

    settings_file = tmp_path / "settings.toml"
    settings_file.write_text(f"{name} = {toml_value(in_file)}\n")
    clean_env.setenv("TIERLM_CONFIG", str(settings_file))
    assert getattr(serve_settings([]), name) == in_file

    clean_env.setenv(env_var(name), str(in_env).lower() if isinstance(in_env, bool) else str(in_env))
    assert getattr(serve_settings([]), name) == in_env

    assert getattr(serve_settings(flag_args(name, on_cli)), name) == on_cli


@pytest.mark.parametrize("name", [f.name for f in setting_fields() if f.metadata["per_model"]])
def test_a_models_section_sits_between_the_files_globals_and_the_environment(name, clean_env, tmp_path):
    f = next(f for f in setting_fields() if f.name == name)
    global_value, model_value, env_value = values_for(f)
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text(f'{name} = {toml_value(global_value)}\n\n[models."tiny"]\n'
                             f"{name} = {toml_value(model_value)}\n")
    clean_env.setenv("TIERLM_CONFIG", str(settings_file))
    settings = serve_settings([])
    assert getattr(settings, name) == global_value
    assert getattr(settings.for_model("tiny"), name) == model_value
    assert getattr(settings.for_model("another"), name) == global_value

    clean_env.setenv(env_var(name), str(env_value).lower() if isinstance(env_value, bool) else str(env_value))
    assert getattr(serve_settings([]).for_model("tiny"), name) == env_value


def test_what_is_not_a_setting_is_refused_with_where_it_came_from(clean_env, tmp_path):
    settings_file = tmp_path / "settings.toml"
    for text, message in [("no_such_option = 1\n", "unknown setting 'no_such_option'"),
                          ('port = "eighty"\n', "port"),
                          ('[models."tiny"]\nport = 9000\n', "cannot be set per model"),
                          ("models = 3\n", "one table per model")]:
        settings_file.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_settings({}, str(settings_file))
    clean_env.setenv("TIERLM_PREFIX_CACHE", "perhaps")
    with pytest.raises(ValueError, match="TIERLM|environment"):
        load_settings({})


def test_the_engine_reads_the_settings_it_is_given():
    """The engine takes Settings itself: nothing between them to drift."""
    from tierlm.engine.core import EngineCore

    engine = EngineCore("x", lambda: None, Settings(decode_burst_ms=7, decode_burst_ms_batched=3))
    assert engine._burst_budget_ms(1) == 7 and engine._burst_budget_ms(16) == 6
    assert Settings(hot_cache_size="1GiB").hot_cache_bytes() == 2**30
    assert Settings(ssd_cache=False).ssd_tier() == (None, 0)


def test_the_readme_lists_every_setting_as_declared():
    """README.md's table is settings_markdown()'s output: regenerate it with
    python -c 'from tierlm.config import settings_markdown; print(settings_markdown())'."""
    from pathlib import Path

    from tierlm.config import settings_markdown

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert settings_markdown() in readme
