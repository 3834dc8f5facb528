"""Settings: command line > environment (TIERLM_*) > settings file > defaults."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

HOME = Path(os.environ.get("TIERLM_HOME", Path.home() / ".tierlm"))


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # an mlx-lm model folder; None = the default model
    model_dir: str = str(HOME / "models")
    served_model_name: str | None = None
    api_key: str | None = None
    max_concurrent_requests: int = 8
    prefill_step_size: int | None = None  # None: 256 on MLX's CPU backend, 2048 on a GPU
    memory_limit: str | None = None  # bytes, "8GB", or "75%" of memory; None = device limit
    cpu_weights_dtype: str = "auto"  # on MLX's CPU backend: auto, float32, bfloat16, float16, stored
    cpu_kernels: bool = True  # on MLX's CPU backend, float32: tierlm's attention and SwiGLU
    cpu_amx: bool = True  # on MLX's CPU backend, CPUs with AMX: float32 weights' matmuls in bfloat16 tiles
    decode_burst_ms: float = 100.0
    decode_burst_ms_batched: float = 20.0
    stream_interval: int = 1
    prefix_cache: bool = True
    cache_block_size: int = 256
    hot_cache_size: str = "10%"  # bytes, "4GB", or a share of memory
    ssd_cache: bool = True
    ssd_cache_dir: str = str(HOME / "cache")
    ssd_cache_size: str = "10%"  # bytes, "50GB", or a share of the disk
    ssd_write_through: bool = False
    sse_keepalive_s: float = 5.0
    max_body_bytes: int = 32 * 2**20
    allow_client_chat_template: bool = False
    stall_timeout_s: float = 300.0
    log_level: str = "info"


def settings_file_path() -> Path:
    return Path(os.environ.get("TIERLM_CONFIG", HOME / "settings.toml"))


def load_settings(cli: dict | None = None, config_file: str | None = None) -> Settings:
    """Merge the layers; `cli` holds only the options given on the command line."""
    values: dict = {}
    path = Path(config_file) if config_file else settings_file_path()
    if path.is_file():
        values.update(tomllib.loads(path.read_text()))
    for f in fields(Settings):
        env = os.environ.get(f"TIERLM_{f.name.upper()}")
        if env is not None:
            values[f.name] = env
    values.update({k: v for k, v in (cli or {}).items() if v is not None})
    unknown = set(values) - {f.name for f in fields(Settings)}
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    return Settings(**{k: _coerce(k, v) for k, v in values.items()})


def _coerce(name: str, value):
    kind = {f.name: f.type for f in fields(Settings)}[name]
    if value is None or not isinstance(value, str):
        return value
    if kind.startswith("bool"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    return value


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


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_size(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).total


def as_dict(settings: Settings) -> dict:
    return dataclasses.asdict(settings)
