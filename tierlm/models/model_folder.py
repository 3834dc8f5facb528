"""Small helpers for model folders on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary name, then rename: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False))
    os.replace(tmp, path)


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
