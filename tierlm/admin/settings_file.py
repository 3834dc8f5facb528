"""Writing a model's section of the settings file from the dashboard.

The file is edited with tomlkit, which keeps what the dashboard does not change
as it was written: comments, order, layout. The new text is checked by loading
it as the server would before it replaces the file (atomically), and the
SettingsWatcher then applies it as any other edit.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from tierlm.config import load_settings

# what the dashboard may set in a [models."NAME"] section
EDITABLE = ("aliases", "keep_alive", "pinned", "default_temperature", "default_top_p", "default_top_k",
            "default_max_tokens")


def edit_model_section(path: Path, model: str, changes: dict, cli: dict | None = None) -> dict:
    """Set (or, for None, remove) `changes` in [models."MODEL"] of the file at
    `path`; the section as written. ValueError for a key not editable here or a
    value the settings refuse (the file is then left as it was)."""
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise ValueError(f"not a per-model setting the dashboard edits: {', '.join(unknown)}")
    try:
        doc = tomlkit.parse(path.read_text()) if path.is_file() else tomlkit.document()
    except TOMLKitError as e:
        raise ValueError(f"{path}: {e}") from e
    if "models" not in doc:
        doc["models"] = tomlkit.table(is_super_table=True)  # written as [models."NAME"] alone
    models = doc["models"]
    if not isinstance(models, dict):
        raise ValueError(f"{path}: [models] is not a table")  # noqa: TRY004 - a bad file, not a bad argument
    if model not in models:
        models[model] = tomlkit.table()
    section = models[model]
    if not isinstance(section, dict):
        raise ValueError(f"{path}: [models.{model!r}] is not a table")  # noqa: TRY004 - a bad file
    for key, value in changes.items():
        if value is None or value == [] or value == "":
            section.pop(key, None)
        else:
            section[key] = value
    if not section:
        models.pop(model)
    if not models:
        doc.pop("models")
    text = tomlkit.dumps(doc)
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
    return section.unwrap()

