"""Every setting, declared once in config.Settings, through all its layers:
defaults < the settings file (its global keys, then the model's section) <
TIERLM_* variables < the command line's flags."""

from __future__ import annotations

import json

import pytest

from tierlm.cli import build_parser, settings_from_args
from tierlm.config import Settings, env_var, load_settings, setting_fields

SETTINGS = [f.name for f in setting_fields()]

# settings whose values are checked beyond their type: three valid ones each
SAMPLES = {
    "keep_alive": ("10m", "1h", "30"),
    "max_model_memory": ("8GB", "50%", "1GiB"),
    "memory_soft_mark": ("80%", "70%", "60%"),
    "memory_hard_mark": ("96%", "97%", "98%"),
    "default_top_p": (0.5, 0.75, 0.25),
    "aliases": (("fast",), ("claude-*haiku*", "quick"), ("gpt-4o",)),
    "extra_model_dirs": (("/models/a",), ("/models/b", "/models/c"), ("/models/d",)),
    "volatile_prompt_blocks": (("^a",), ("^b:", "c$"), ()),
    "default_stop": (("\n\n",), ("<end>", "User:"), ("###",)),
    "chat_template_kwargs": ({"enable_thinking": False}, {"enable_thinking": True, "n": 2}, {"x": "y"}),
    "api_key": (("alice:k1",), ("k2", "bob:k3"), ("k4",)),
    "admin_key": (("ops:a1",), ("a2",), ("ops:a3", "ci:a4")),
    "warmup": (True, False, True),  # default None: on where the device is a GPU
    "speculation": ("off", "prompt-lookup", "auto"),
    "cache_kv_bits": (8, 4, 16),
    "batch_kv_bits": (8, 4, 16),
}


def values_for(f) -> tuple:
    """Three values of the setting's type, each unlike the one before and the first
    unlike the default."""
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    kind = f.type.split("|")[0].strip()
    if kind == "bool":
        return (not f.default, f.default, not f.default)
    if kind in ("int", "float"):
        base = f.default or 0
        return tuple(type(base)(base + k) if kind == "int" else float(base + k / 2) for k in (1, 2, 3))
    return ("from-file", "from-env", "from-cli")


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def text_value(value) -> str:
    """A value as an environment variable or a flag writes it."""
    if isinstance(value, (tuple, dict)):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_args(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, text_value(value)]


def serve_settings(argv: list[str]) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


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

    clean_env.setenv(env_var(name), text_value(in_env))
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

    clean_env.setenv(env_var(name), text_value(env_value))
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
    assert engine.burst_budget_ms(1) == 7 and engine.burst_budget_ms(16) == 6
    assert Settings(hot_cache_size="1GiB").hot_cache_bytes() == 2**30
    assert Settings(ssd_cache=False).ssd_tier() == (None, 0)


def test_the_docs_list_every_setting_as_declared():
    """docs/configuration.md's table is settings_markdown()'s output: regenerate it with
    python -c 'from tierlm.config import settings_markdown; print(settings_markdown())'."""
    from pathlib import Path

    from tierlm.config import settings_markdown

    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert settings_markdown() in page, (
        "docs/configuration.md's settings table differs from the declarations; regenerate it with "
        "python -c 'from tierlm.config import settings_markdown; print(settings_markdown())'")


# ---- many models, one memory budget


def test_durations_sizes_and_marks_resolve_for_the_pool():
    from tierlm.config import parse_duration, total_memory

    assert [parse_duration(t) for t in ("5m", "1h30m", "300", 300, "500ms", "0", "-1", -1, "-5m")] == \
        [300.0, 5400.0, 300.0, 300.0, 0.5, 0.0, None, None, None]
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")
    assert Settings().keep_alive_s() == 300.0 and Settings(keep_alive="-1").keep_alive_s() is None
    total = total_memory()
    assert Settings(max_model_memory="8GB").max_model_memory_bytes() == 8 * 10**9
    assert 0 < Settings().max_model_memory_bytes() < total
    soft, hard = Settings().memory_marks_bytes()
    assert soft == int(total * 0.85) and hard == int(total * 0.95)


def test_lists_and_tables_from_every_layer(clean_env, tmp_path):
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text('keep_alive = 60\n[models."qwen"]\naliases = ["gpt-4o", "claude-*"]\n'
                             'pinned = true\ncontext_limit = 8192\ndefault_temperature = 0.7\n'
                             "chat_template_kwargs = {enable_thinking = false}\n")
    clean_env.setenv("TIERLM_CONFIG", str(settings_file))
    clean_env.setenv("TIERLM_EXTRA_MODEL_DIRS", "/a, /b")
    settings = serve_settings(["--no-hf-cache"])
    qwen = settings.for_model("qwen")
    assert settings.keep_alive == "60" and settings.extra_model_dirs == ("/a", "/b") and not settings.hf_cache
    assert qwen.aliases == ("gpt-4o", "claude-*") and qwen.pinned and qwen.context_limit == 8192
    assert qwen.sampling_defaults() == {"temperature": 0.7}
    assert qwen.template_kwargs({"enable_thinking": True, "x": 1}) == {"enable_thinking": True, "x": 1}
    assert qwen.template_kwargs() == {"enable_thinking": False}
    assert settings.for_model("other").aliases == () and settings.for_model("other").template_kwargs() == {}


@pytest.mark.parametrize("text, message", [
    ('keep_alive = "soon"\n', "keep_alive = 'soon': not a duration"),
    ('memory_soft_mark = "lots"\n', "memory_soft_mark"),
    ('memory_soft_mark = "96%"\nmemory_hard_mark = "90%"\n', "memory_soft_mark .* above memory_hard_mark"),
    ('max_model_memory = "0"\n', "max_model_memory"),
    ('[models."m"]\ndefault_top_p = 1.5\n', r'\[models."m"\]: default_top_p = 1.5'),
    ('[models."m"]\ndefault_temperature = -1\n', "default_temperature"),
    ('[models."m"]\ncontext_limit = 0\n', "context_limit"),
    ('[models."m"]\ncache_block_size = 0\n', "cache_block_size = 0: expected at least 1"),
    ('cache_block_size = -64\n', "cache_block_size = -64"),
    ('[models."m"]\naliases = "a, b"\npinned = "perhaps"\n', "pinned = 'perhaps'"),
    ('[models."m"]\naliases = [1, 2]\n', "aliases .* list of strings"),
    ('[models."m"]\nchat_template_kwargs = "x"\n', "chat_template_kwargs"),
    ('[models."m"]\nhf_cache = false\n', "'hf_cache' cannot be set per model"),
    ("keep_alive = \n", r"line 1"),
])
def test_bad_pool_values_name_the_key_and_where(text, message, clean_env, tmp_path):
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        load_settings({}, str(settings_file))
    assert str(settings_file) in str(caught.value) or "memory_hard_mark" in str(caught.value)


def test_a_requested_name_resolves_to_a_model(clean_env, tmp_path):
    from tierlm.config import resolve_alias

    settings_file = tmp_path / "settings.toml"
    settings_file.write_text('[models."big"]\naliases = ["gpt-4o", "claude-*opus*", "claude-*"]\n\n'
                             '[models."small"]\naliases = ["claude-*HAIKU*", "fast", "big-alias"]\n\n'
                             '[models."absent"]\naliases = ["ghost"]\n')
    settings = load_settings({}, str(settings_file))
    names = ["small", "big", "third"]
    assert settings.model_for_alias("third", names) == "third"  # a name first
    assert settings.model_for_alias("fast", names) == "small"  # then an exact alias
    assert settings.model_for_alias("claude-3-5-haiku-latest", names) == "big"  # first pattern in file order
    assert settings.model_for_alias("CLAUDE-OPUS-4", names) == "big"  # patterns ignore case
    assert settings.model_for_alias("Fast", names) is None  # an exact alias does not
    assert settings.model_for_alias("ghost", names) is None  # a model that is not there
    assert settings.model_for_alias("gpt-4", names) is None
    assert resolve_alias(settings, "gpt-4o", names) == "big"
    assert Settings().model_for_alias("x", []) is None


def test_a_models_default_stop_strings_fill_a_request_that_sends_none():
    from tierlm.api.fields import SamplingFields
    from tierlm.serving.served_model import ServedModel

    model = ServedModel.__new__(ServedModel)  # the sampling defaults alone: no engine needed
    model.settings = Settings(default_stop=("\n\n", "User:"))
    assert model.sampling_params(SamplingFields(), 8).stop == ["\n\n", "User:"]
    assert model.sampling_params(SamplingFields(stop="END"), 8).stop == ["END"]
