"""Writing a model's section of the settings file from the dashboard.

The file is read with tomllib, changed, and written back whole by the small
TOML writer below (its comments and layout are not kept; every value is). The
new text is checked by loading it as the server would before it replaces the
file (atomically), and the SettingsWatcher then applies it as any other edit.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from datetime import date, datetime, time
from pathlib import Path

from tierlm.config import load_settings

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# what the dashboard may set in a [models."NAME"] section
EDITABLE = ("aliases", "keep_alive", "pinned", "default_temperature", "default_top_p", "default_top_k",
            "default_max_tokens")
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def edit_model_section(path: Path, model: str, changes: dict, cli: dict | None = None) -> dict:
    """Set (or, for None, remove) `changes` in [models."MODEL"] of the file at
    `path`; the section as written. ValueError for a key not editable here or a
    value the settings refuse (the file is then left as it was)."""
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise ValueError(f"not a per-model setting the dashboard edits: {', '.join(unknown)}")
    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    models = data.setdefault("models", {})
    if not isinstance(models, dict):
        raise ValueError(f"{path}: [models] is not a table")  # noqa: TRY004 - a bad file, not a bad argument
    section = dict(models.get(model, {}))
    for key, value in changes.items():
        if value is None or value == [] or value == "":
            section.pop(key, None)
        else:
            section[key] = value
    if section:
        models[model] = section
    else:
        models.pop(model, None)
    if not models:
        data.pop("models")
    text = dumps(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_settings(cli, tmp)  # what the server would say of it: ValueError when wrong
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return section


def dumps(data: dict) -> str:
    """TOML for what tomllib read: plain values first, then each table."""
    out: list[str] = []
    _table(out, [], data)
    return "\n".join(out).lstrip("\n") + "\n"


def _table(out: list[str], path: list[str], table: dict) -> None:
    plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
    nested = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (plain or not nested):
        out.append("")
        out.append("[" + ".".join(_key(p) for p in path) + "]")
    for k, v in plain.items():
        out.append(f"{_key(k)} = {_value(v)}")
    for k, v in nested.items():
        _table(out, [*path, k], v)


def _key(key: str) -> str:
    return key if _BARE.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # a JSON string is a TOML basic string, but for DEL, which TOML wants escaped
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise ValueError(f"cannot write {type(v).__name__} to TOML")
