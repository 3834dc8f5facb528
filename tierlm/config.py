"""Settings, each declared once: command line > environment (TIERLM_*) > settings
file (its global keys, then a [models."NAME"] section for the model served) >
defaults.

Every setting is one field of `Settings` below: its name, type, default and
help. The command line's flags (cli.py), the TIERLM_NAME variables, the keys of
the settings file and what the engine reads all come from that field; the
engine takes a `Settings` itself, resolved for its model (`for_model`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

HOME = Path(os.environ.get("TIERLM_HOME", Path.home() / ".tierlm"))
ENV_PREFIX = "TIERLM_"


def setting(default, help: str, *, per_model: bool = False, check=None):
    """One setting. `per_model`: a [models."NAME"] section of the settings file may
    set it for one model. `check(value)` raises ValueError for a value of the right
    type that still makes no sense (a malformed size, a negative temperature)."""
    return field(default=default, metadata={"help": help, "per_model": per_model, "check": check})


def _at_least(low: float, high: float | None = None):
    def check(value) -> None:
        if value < low or (high is not None and value > high):
            raise ValueError(f"expected {low}..{high}" if high is not None else f"expected at least {low}")

    return check


def _one_of(value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")


def _size_check(value: str) -> None:
    if parse_size(value, total_memory()) <= 0:
        raise ValueError("expected more than 0 bytes")


def _names_check(values: tuple) -> None:
    if not all(v.strip() for v in values):
        raise ValueError("an empty name")


@dataclass
class Settings:
    # ---- the server
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    model: str | None = setting(None, "an mlx-lm model folder, or a name in --model-dir "
                                      "(default: the built-in SmolLM2-135M-Instruct)")
    model_dir: str = setting(str(HOME / "models"), "where models are kept")
    served_model_name: str | None = setting(None, "the model id clients use (default: the folder name)",
                                            per_model=True)
    api_key: tuple[str, ...] = setting((), "keys the /v1 routes require, as 'Authorization: Bearer KEY' or "
                                           "'x-api-key'; each KEY or NAME:KEY (comma-separated on the command "
                                           "line); an API key cannot load, unload or clear the cache",
                                       check=_names_check)
    admin_key: tuple[str, ...] = setting((), "keys for loading and unloading models, clearing the cache, "
                                             "/metrics and /stats (KEY or NAME:KEY); with API keys and none "
                                             "of these, those routes are refused", check=_names_check)
    insecure_no_auth: bool = setting(False, "listen on an address other than loopback without an API key "
                                            "(else the server refuses to start)")
    max_body_bytes: int = setting(32 * 2**20, "largest request body accepted, chunked or not")
    allow_client_chat_template: bool = setting(False, "render a chat_template sent in a request (bounded to "
                                                      "2 s and 16M characters; off: a template is code)")
    sse_keepalive_s: float = setting(5.0, "seconds between SSE keep-alive comments (Anthropic: ping events) "
                                          "while waiting")
    response_store_size: int = setting(256, "answers of the Responses API kept in memory for "
                                            "previous_response_id (0: none)", check=_at_least(0))
    volatile_prompt_blocks: tuple[str, ...] = setting(
        (r"^x-anthropic-billing-header:",),
        "regular expressions for blocks of an agent's system prompt that change on every request without "
        "changing its meaning (a billing header with a hash): they are left out, so the prompt stays cached",
        check=lambda values: [re.compile(v) for v in values])
    log_level: str = setting("info", "debug, info, warning or error")
    log_interval_s: float = setting(5.0, "seconds between the engine's progress lines in the log")
    # ---- the engine
    max_concurrent_requests: int = setting(8, "requests decoded together at most; more wait in a queue",
                                           per_model=True)
    prefill_step_size: int | None = setting(None, "prompt tokens per prefill chunk (default 256 on MLX's "
                                                  "CPU backend, 2048 on a GPU)", per_model=True)
    speculation: str = setting("auto", "draft tokens verified several a step in the batch: prompt-lookup "
                                       "(from the sequence's own prompt and output: copies, edits, quoted "
                                       "context), off, or auto (prompt-lookup where the backend's products "
                                       "are batch-invariant, so greedy answers stay the same: MLX's CPU "
                                       "backend with AVX2 or AVX-512; off elsewhere, and on a GPU, where it does "
                                       "not pay yet)",
                               per_model=True, check=lambda v: _one_of(v, ("auto", "prompt-lookup", "off")))
    draft_model: str | None = setting(None, "a smaller model of the same tokenizer that drafts tokens where "
                                            "a sequence's own context offers none (a model folder, or the "
                                            "name of one in the model folders); setting one turns "
                                            "speculation on with `auto`", per_model=True)
    speculative_tokens: int = setting(7, "draft tokens a sequence verifies a step at most (1-16; a request's "
                                         "speculative_tokens wins, 0 turns it off for that request)",
                                      per_model=True, check=_at_least(1, 16))
    memory_limit: str | None = setting(None, "admit requests only while they fit under this (bytes, 8GB, "
                                             "or 75%; default 90% of what the device allows)", per_model=True)
    decode_burst_ms: float = setting(100.0, "decode time per job handed to the engine's worker with one "
                                            "request (0: one step a job); tokens stream out as they are "
                                            "made all the same (stream_flush_ms)", per_model=True)
    decode_burst_ms_batched: float = setting(20.0, "the same per 8 requests running, with several (up to "
                                                   "the larger of the two)", per_model=True)
    stream_flush_ms: float = setting(2.0, "during a decode burst, new tokens go out to the streams at most "
                                          "this often, per 4 requests running (0: after every step)",
                                     per_model=True, check=_at_least(0))
    stream_interval: int = setting(1, "tokens per streamed chunk", per_model=True)
    warmup: bool | None = setting(None, "while idle after start, run each batch shape once, so that the "
                                        "first requests at a new concurrency do not wait for kernels to "
                                        "compile (default: on a GPU)", per_model=True)
    warmup_wait_s: float | None = setting(None, "at start, seconds the engine may spend warming before it "
                                                "reports ready; the rest warms while idle (default: every "
                                                "shape, up to 120 s, for the model --model names at the "
                                                "server's start; 5 s for a model loaded on request)",
                                          per_model=True, check=_at_least(0))
    kernel_cache_dir: str = setting(str(HOME / "kernels"), "where MLX's CUDA backend keeps the kernels it "
                                                           "compiles, across restarts (MLX's own default "
                                                           "is under /tmp; MLX_PTX_CACHE_DIR wins)")
    cuda_graphs: bool = setting(False, "MLX's CUDA backend replays its work as CUDA graphs; off, it "
                                       "launches each kernel (on an H100 off: a 20k-token hot hit's first "
                                       "token 0.020 s against 0.029, 1.2-1.3x the tokens/s at 8-32 streams, "
                                       "about the same at one; a restart applies it; MLX_USE_CUDA_GRAPHS wins)")
    stall_timeout_s: float = setting(300.0, "a request, or the engine's worker, with no progress this long "
                                            "ends with an error (/health says degraded while the worker "
                                            "is stuck)", per_model=True)
    degrade_after_failures: int = setting(3, "failed engine steps in a row after which /health says "
                                             "degraded, until a step works", per_model=True)
    # ---- many models, one memory budget (the pool)
    extra_model_dirs: tuple[str, ...] = setting((), "more folders to look for models in (comma-separated "
                                                    "on the command line)", check=_names_check)
    hf_cache: bool = setting(True, "also list mlx-lm models in the Hugging Face cache")
    max_model_memory: str | None = setting(None, "weights + KV of all loaded models at most (bytes, 8GB, or "
                                                 "60%; default: memory less max(2GiB, 15%))",
                                           check=_size_check)
    memory_soft_mark: str = setting("85%", "process memory above which new requests wait and idle models "
                                           "are unloaded (bytes, 8GB, or % of memory)", check=_size_check)
    memory_hard_mark: str = setting("95%", "process memory above which the largest model's requests are "
                                           "aborted (bytes, 8GB, or % of memory)", check=_size_check)
    keep_alive: str = setting("5m", "idle time before an unused model is unloaded: seconds, 5m, 1h, -1 "
                                    "(never) or 0 (after each request)", per_model=True,
                              check=lambda v: parse_duration(v))  # parse_duration comes later
    pinned: bool = setting(False, "load the model at start and never unload it", per_model=True)
    aliases: tuple[str, ...] = setting((), "other names, or patterns like 'claude-*haiku*', that mean this "
                                           "model (comma-separated on the command line)", per_model=True,
                                       check=_names_check)
    context_limit: int | None = setting(None, "tokens of context at most, below the model's own",
                                        per_model=True, check=_at_least(1))
    default_temperature: float | None = setting(None, "temperature when a request sends none",
                                                per_model=True, check=_at_least(0))
    default_top_p: float | None = setting(None, "top_p when a request sends none", per_model=True,
                                          check=_at_least(0, 1))
    default_top_k: int | None = setting(None, "top_k when a request sends none (0: off)", per_model=True,
                                        check=_at_least(0))
    default_max_tokens: int | None = setting(None, "max_tokens when a request sends none", per_model=True,
                                             check=_at_least(1))
    default_stop: tuple[str, ...] = setting((), "stop strings when a request sends none, as Ollama's "
                                                "`stop` parameter (a base model's answers end nowhere else)",
                                            per_model=True)
    chat_template_kwargs: Mapping[str, object] | None = setting(None, "chat template variables for every "
                                                                      "request (a table, JSON on the command "
                                                                      "line; a request's own values win)",
                                                                per_model=True)
    # ---- the prefix cache
    tool_format: str = setting("auto", "how the model writes tool calls: auto (its chat template's family, "
                               "else generic), generic, or a family (hermes, llama3_json, mistral, ...)",
                               per_model=True)
    reasoning: str = setting("auto", "the model's thinking markers: auto (from its tokenizer), off, or "
                             "START,END (e.g. '<think>,</think>'): text between them is reasoning_content",
                             per_model=True)
    max_thinking_tokens: int | None = setting(None, "thinking tokens after which the thinking section is "
                                              "closed (a request's max_thinking_tokens wins)", per_model=True)
    parallel_tool_calls: bool = setting(True, "several tool calls in one answer where the request allows "
                                              "them; false: one call an answer whatever the request says "
                                              "(llama.cpp's default; small models repeat a call)", per_model=True)
    prefix_cache: bool = setting(True, "reuse the KV of prompt prefixes seen before", per_model=True)
    cache_block_size: int | None = setting(None, "tokens per prefix-cache block (default 64 on MLX's CPU backend, "
                                                 "256 on a GPU); a hit goes on into a block's first tokens "
                                                 "(part blocks)", per_model=True, check=_at_least(1))
    cache_kv_bits: int = setting(16, "bits a KV value keeps in the cache tiers: 16 (as computed), 8 or 4 "
                                     "(quantized in groups, keys scaled per channel as in the batch: about "
                                     "2x or 3.5x the tokens a GB holds, a hit's KV approximate; models of "
                                     "plain attention layers)",
                                 per_model=True, check=lambda v: _one_of(str(v), ("16", "8", "4")))
    batch_kv_bits: int | None = setting(None, "bits a KV value keeps in the running batch: as computed by "
                                              "default (float32 on MLX's CPU backend, the model's 16 bits on a "
                                              "GPU); 16 (on a CPU float16, as llama.cpp keeps it: half the "
                                              "bytes a decode step reads over a long context and twice the "
                                              "tokens memory and the cache tiers hold, answers approximate), "
                                              "8 or 4 (quantized in groups of 64 along a head's vector, keys "
                                              "scaled per channel from a calibration prompt at load: about 1.9x "
                                              "or 3.5x the tokens of 16-bit KV, answers approximate; on a CPU "
                                              "decode at ~1.0x float32 KV's speed, prompt-lookup drafts included)",
                                        per_model=True, check=lambda v: _one_of(str(v), ("16", "8", "4")))
    hot_cache_size: str = setting("10%", "memory for cached blocks (bytes, 4GB, or 10% of memory)",
                                  per_model=True)
    ssd_cache: bool = setting(True, "keep blocks on disk too, across restarts", per_model=True)
    ssd_cache_dir: str = setting(str(HOME / "cache"), "folder of the SSD tier")
    ssd_cache_size: str = setting("10%", "disk for cached blocks (bytes, 50GB, or 10% of the disk)")
    ssd_preload: bool = setting(True, "after a start, read this model's most recently used blocks back from the SSD "
                                      "tier into memory (up to half the hot tier; for up to 2 s before the model "
                                      "reports ready, the rest while idle)", per_model=True)
    ssd_write_through: bool = setting(False, "write every block to SSD at once instead of when it leaves "
                                             "memory", per_model=True)
    # ---- MLX's CPU backend
    cpu_weights_dtype: str = setting("auto", "weights' dtype on the CPU backend: auto (quantized ones kept "
                                             "quantized where tierlm's float kernels (AVX-512, AVX2) take them, else float32 "
                                             "when it fits, else quantized), quantized, float32, bfloat16, "
                                             "float16, or stored",
                                     per_model=True)
    cpu_kernels: bool = setting(True, "on the CPU backend in float32, tierlm's attention and SwiGLU",
                                per_model=True)
    cpu_amx: bool = setting(True, "on CPUs with AMX, float32 weights multiply as bfloat16 on the tile unit",
                            per_model=True)

    # ---- values resolved for the machine

    def memory_limit_bytes(self) -> int | None:
        return parse_size(self.memory_limit, total_memory()) if self.memory_limit else None

    def hot_cache_bytes(self) -> int:
        return parse_size(self.hot_cache_size, total_memory())

    def max_model_memory_bytes(self) -> int:
        """The pool's budget: what was set, else physical memory less a margin for
        the OS and other programs."""
        total = total_memory()
        if self.max_model_memory:
            return parse_size(self.max_model_memory, total)
        return total - max(2 * 2**30, int(total * 0.15))

    def memory_marks_bytes(self) -> tuple[int, int]:
        """(soft, hard) marks of the process's memory, in bytes."""
        total = total_memory()
        return parse_size(self.memory_soft_mark, total), parse_size(self.memory_hard_mark, total)

    def keep_alive_s(self) -> float | None:
        """Seconds an idle model stays loaded; None: forever."""
        return parse_duration(self.keep_alive)

    def sampling_defaults(self) -> dict:
        """The request fields (temperature, top_p, top_k, max_tokens, stop) this model
        fills in when a request leaves them out."""
        values = {"temperature": self.default_temperature, "top_p": self.default_top_p,
                  "top_k": self.default_top_k, "max_tokens": self.default_max_tokens,
                  "stop": list(self.default_stop) or None}
        return {k: v for k, v in values.items() if v is not None}

    def template_kwargs(self, requested: dict | None = None) -> dict:
        """Chat template variables: this model's, then the request's on top."""
        return {**(self.chat_template_kwargs or {}), **(requested or {})}

    def model_for_alias(self, requested: str, names: list[str]) -> str | None:
        """Which of `names` a client's model id means: a name itself, then an exact
        alias, then the first matching pattern (case-insensitive), models in the
        settings file's order."""
        if requested in names:
            return requested
        ordered = [n for n in self._model_sections if n in names] + \
            [n for n in names if n not in self._model_sections]
        aliases = [(name, alias) for name in ordered for alias in self.for_model(name).aliases]
        exact = next((name for name, alias in aliases if alias == requested and not _is_pattern(alias)), None)
        if exact is not None:
            return exact
        return next((name for name, alias in aliases
                     if _is_pattern(alias) and fnmatch.fnmatchcase(requested.lower(), alias.lower())), None)

    def ssd_tier(self) -> tuple[str | None, int]:
        """(folder, bytes) of the SSD tier; (None, 0) when it is off."""
        if not self.ssd_cache:
            return None, 0
        folder = Path(self.ssd_cache_dir).expanduser()
        return str(folder), parse_size(self.ssd_cache_size, disk_size(folder))

    def for_model(self, name: str) -> Settings:
        """These settings with the settings file's [models."NAME"] section applied,
        under what the environment and the command line set."""
        section = self._model_sections.get(name, {})
        return dataclasses.replace(self, **{k: v for k, v in section.items() if k not in self._overridden})

    # what load_settings read besides the global values: not settings themselves
    _model_sections: ClassVar[dict] = {}  # model name -> its section's values
    _overridden: ClassVar[frozenset] = frozenset()  # set by the environment or the command line


def _is_pattern(alias: str) -> bool:
    return any(c in alias for c in "*?[")


def resolve_alias(settings: Settings, requested: str, names: list[str]) -> str | None:
    return settings.model_for_alias(requested, names)


def setting_fields() -> tuple[dataclasses.Field, ...]:
    return fields(Settings)


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def settings_file_path() -> Path:
    return Path(os.environ.get("TIERLM_CONFIG", HOME / "settings.toml"))


def load_settings(cli: dict | None = None, config_file: str | None = None) -> Settings:
    """Merge the layers; `cli` holds only the options given on the command line."""
    path = Path(config_file) if config_file else settings_file_path()
    file_values = read_settings_file(path)
    sections = file_values.pop("models", {})
    env = {f.name: os.environ[env_var(f.name)] for f in setting_fields() if env_var(f.name) in os.environ}
    given = {k: v for k, v in (cli or {}).items() if v is not None}
    values = {**_checked(file_values, str(path)), **_checked(env, "the environment"),
              **_checked(given, "the command line")}
    settings = Settings(**values)
    settings._model_sections = {name: _checked(section, f'{path} [models."{name}"]', per_model=True)
                                for name, section in _sections(sections, path).items()}
    settings._overridden = frozenset(env) | frozenset(given)
    _check_marks(settings)
    return settings


def read_settings_file(path: Path) -> dict:
    """The file's TOML ({} when there is none); a syntax error names the file, line
    and column."""
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from e


def _check_marks(settings: Settings) -> None:
    soft, hard = settings.memory_marks_bytes()
    if soft > hard:
        raise ValueError(f"memory_soft_mark ({settings.memory_soft_mark}) is above memory_hard_mark "
                         f"({settings.memory_hard_mark})")


def _sections(sections, path: Path) -> dict:
    if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
        raise ValueError(f'{path}: [models] holds one table per model, as [models."NAME"]')
    return sections


def _checked(values: dict, where: str, per_model: bool = False) -> dict:
    """`values` by setting name, each coerced to its setting's type, or ValueError
    naming the setting and where it came from."""
    known = {f.name: f for f in setting_fields()}
    out = {}
    for name, value in values.items():
        f = known.get(name)
        if f is None:
            raise ValueError(f"{where}: unknown setting {name!r}")
        if per_model and not f.metadata["per_model"]:
            raise ValueError(f"{where}: {name!r} cannot be set per model")
        try:
            out[name] = _coerce(f.type, value, numbers_as_text=f.metadata["check"] is not None)
            if out[name] is not None and f.metadata["check"]:
                f.metadata["check"](out[name])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {name} = {value!r}: {e}") from e
    return out


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(kind: str, value, numbers_as_text: bool = False):
    """A value from any layer as the setting's type: strings (environment, CLI) are
    parsed; TOML's own types must already match. `numbers_as_text`: a text setting
    that is a size or a duration takes a TOML number too (keep_alive = 300)."""
    base = kind.split("|")[0].strip()
    if value is None:
        return None
    if base.startswith(("tuple", "Mapping")):
        return _coerce_list(value) if base.startswith("tuple") else _coerce_table(value)
    if numbers_as_text and base == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and base != "str":
        text = value.strip().lower()
        if base == "bool":
            if text not in _TRUE + _FALSE:
                raise ValueError("expected true or false")
            return text in _TRUE
        return int(text) if base == "int" else float(text)
    expected = {"bool": bool, "int": int, "float": (int, float), "str": str}[base]
    if not isinstance(value, expected) or (base in ("int", "float") and isinstance(value, bool)):
        raise TypeError(f"expected {base}")
    return float(value) if base == "float" else value


def _coerce_list(value) -> tuple[str, ...]:
    """A TOML array of strings; from the environment or the command line, a JSON
    array or comma-separated text."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError("expected a list of strings")
    return tuple(value)


def _coerce_table(value) -> dict:
    """A TOML table; from the environment or the command line, a JSON object."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError("expected a table (a JSON object on the command line)")
    return dict(value)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int, total: int | None = None) -> int:
    """'8GB', '512MiB', '1234' -> bytes; '75%' -> that share of `total`."""
    if isinstance(text, int):
        return text
    text = text.strip().lower()
    if text.endswith("%"):
        if total is None:
            raise ValueError(f"a percentage ({text}) needs a total to take it from")
        return int(total * float(text[:-1]) / 100)
    match = re.fullmatch(r"([\d.]+)\s*([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 8GB, 512MiB or 75%)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float) -> float | None:
    """Seconds from 300, '300', '5m', '1h30m', '500ms'; None (forever) for any
    negative value, as Ollama's keep_alive: '-1'."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return None if text < 0 else float(text)
    text = str(text).strip().lower()
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text)
    if re.fullmatch(r"[\d.]+", body):
        seconds = float(body)
    else:
        parts = re.findall(r"([\d.]+)\s*(ms|s|m|h|d)", body)
        if not parts or re.sub(r"[\d.]+\s*(ms|s|m|h|d)", "", body).strip():
            raise ValueError(f"not a duration: {text!r} (try 300, 5m, 1h or -1)")
        seconds = sum(float(n) * _SECONDS[unit] for n, unit in parts)
    return None if sign < 0 and seconds > 0 else seconds


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_size(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).total


def settings_markdown() -> str:
    """The table of every setting in docs/configuration.md, from their declarations
    (a test keeps the page's copy equal to this)."""
    rows = ["| flag | environment | default | per model | what it does |", "|---|---|---|---|---|"]
    for f in setting_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.type.startswith("bool"):
            flag = f"{flag} / --no-{flag[2:]}"
        default = _default_cell(f.default)
        rows.append(f"| `{flag}` | `{env_var(f.name)}` | {default} | {'yes' if f.metadata['per_model'] else ''} "
                    f"| {f.metadata['help']} |")
    return "\n".join(rows)



def _default_cell(default) -> str:
    if isinstance(default, bool) or default is None or default == ():
        return {True: "on", False: "off"}.get(default, "—")
    if isinstance(default, tuple):
        return ", ".join(f"`{v}`" for v in default)
    return str(default).replace(str(Path.home()), "~")
