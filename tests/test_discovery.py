"""Discovering models: folders under the model folders, one level of org/name, the Hugging Face cache."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from tierlm.models.default_model import DEFAULT_MODEL_NAME
from tierlm.pool.discovery import ModelEntry, default_hf_cache, discover, folders_signature

REAL = Path(os.environ.get("TIERLM_TEST_MODEL_DIR", Path.home() / ".tierlm" / "models")) / DEFAULT_MODEL_NAME
LOG = "tierlm.pool.discovery"


def make_model(path: Path, weights: bytes = b"w" * 100, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama",
                                                           "max_position_embeddings": 2048}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def lines_about(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and str(path) in r.getMessage()]


@pytest.fixture
def empty_cache(tmp_path) -> Path:
    return tmp_path / "no-hf-cache"


def test_direct_folders_listed_with_size_and_context(tmp_path, empty_cache):
    make_model(tmp_path / "models" / "a", b"x" * 100)
    b = make_model(tmp_path / "models" / "b", b"x" * 10,
                   {"model_type": "gemma3_text", "text_config": {"max_position_embeddings": 32768}})
    (b / "model-2.safetensors").write_bytes(b"y" * 5)
    (b / "tokenizer.json").write_bytes(b"z" * 1000)  # not weights: not counted
    found = discover([tmp_path / "models"], empty_cache)
    assert sorted(found) == ["a", "b"]
    assert found["a"] == ModelEntry("a", tmp_path / "models" / "a", 100, 2048, "llama", None,
                                    int((tmp_path / "models" / "a").stat().st_mtime))
    assert (found["b"].size_bytes, found["b"].context_length, found["b"].model_type) == (15, 32768, "gemma3_text")


def test_org_name_one_level_only(tmp_path, empty_cache, caplog):
    root = tmp_path / "models"
    make_model(root / "mlx-community" / "Qwen3-0.6B-4bit")
    make_model(root / "mlx-community" / "Llama-3.2-1B")
    make_model(root / "deep" / "team" / "too-deep")
    with caplog.at_level(logging.INFO, logger=LOG):
        found = discover([root], empty_cache)
    assert sorted(found) == ["mlx-community/Llama-3.2-1B", "mlx-community/Qwen3-0.6B-4bit"]
    assert found["mlx-community/Llama-3.2-1B"].path == root / "mlx-community" / "Llama-3.2-1B"
    assert len(lines_about(caplog, root / "deep")) == 1


@pytest.mark.parametrize("make, why", [
    (lambda p: (p / "config.json").write_text("{}"), "no *.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"w"), "no config.json"),
    (lambda p: [(p / "config.json").write_text("{not json"), (p / "model.safetensors").write_bytes(b"w")],
     "config.json cannot be read"),
    (lambda p: (p / "model.safetensors").symlink_to(p / "gone"), "no config.json"),
    (lambda p: [(p / "config.json").write_text("{}"), (p / "model.safetensors").symlink_to(p / "gone")],
     "weights cannot be read"),
    (lambda p: (p / "notes.txt").write_text("hi"), "no model folder directly inside"),
])
def test_non_model_folder_skipped_with_one_line(tmp_path, empty_cache, caplog, make, why):
    root = tmp_path / "models"
    make_model(root / "good")
    (root / "broken").mkdir()
    make(root / "broken")
    (root / "README.md").write_text("a file, not a folder: passed over")
    with caplog.at_level(logging.INFO, logger=LOG):
        found = discover([root], empty_cache)
    assert list(found) == ["good"]
    lines = lines_about(caplog, root / "broken")
    assert len(lines) == 1 and why in lines[0], lines
    assert len([r for r in caplog.records if r.name == LOG]) == 1


def test_broken_model_inside_org_folder_logged_once(tmp_path, empty_cache, caplog):
    root = tmp_path / "models"
    make_model(root / "org" / "ok")
    (root / "org" / "half").mkdir()
    (root / "org" / "half" / "config.json").write_text("{}")
    (root / "org" / "not-a-model").mkdir()
    with caplog.at_level(logging.INFO, logger=LOG):
        found = discover([root], empty_cache)
    assert list(found) == ["org/ok"]
    assert [r.getMessage() for r in caplog.records if r.name == LOG] == [
        f"{root / 'org' / 'half'}: skipped, not a model folder: config.json but no *.safetensors weights"]


def test_missing_shard_skipped(tmp_path, empty_cache, caplog):
    m = make_model(tmp_path / "models" / "sharded")
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger=LOG):
        assert discover([tmp_path / "models"], empty_cache) == {}
    assert "model-00002-of-00002.safetensors" in lines_about(caplog, m)[0]


def test_hidden_folders_ignored_silently(tmp_path, empty_cache, caplog):
    root = tmp_path / "models"
    make_model(root / ".pull-abc123" / "gemma-3-270m")
    (root / ".pull-xyz").mkdir()
    (root / ".pull-xyz" / "model.safetensors").write_bytes(b"partial")
    make_model(root / ".hidden-model")
    make_model(root / "org" / ".tmp-half")
    make_model(root / "org" / "real")
    with caplog.at_level(logging.DEBUG, logger=LOG):
        found = discover([root], empty_cache)
    assert list(found) == ["org/real"]
    assert [r for r in caplog.records if r.name == LOG] == []


def test_first_dir_wins_a_clash_logged_once(tmp_path, empty_cache, caplog):
    dirs = [tmp_path / d for d in ("one", "two", "three")]
    for i, d in enumerate(dirs):
        make_model(d / "same", b"w" * (i + 1))
    make_model(dirs[1] / "org" / "x")
    make_model(dirs[2] / "org" / "x")
    with caplog.at_level(logging.INFO, logger=LOG):
        found = discover(dirs + [tmp_path / "missing"], empty_cache)
    assert found["same"].path == dirs[0] / "same" and found["same"].size_bytes == 1
    assert found["org/x"].path == dirs[1] / "org" / "x"
    messages = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert len(messages) == 2
    assert sum("same" in m for m in messages) == 1 and sum("org/x" in m for m in messages) == 1


def test_missing_dirs_are_fine(tmp_path):
    assert discover([tmp_path / "nope"], tmp_path / "nope-either") == {}
    assert discover([], tmp_path / "nope-either") == {}


def test_folders_signature_changes_with_what_discover_would_find(tmp_path, empty_cache):
    models, cache = tmp_path / "models", tmp_path / "hub"
    models.mkdir()
    seen = [folders_signature([models], cache)]

    def changed() -> bool:
        seen.append(folders_signature([models], cache))
        return seen[-1] != seen[-2]

    assert not changed()  # nothing happened: the same
    make_model(models / "a")
    assert changed()  # a model folder added
    (models / "a" / "model-2.safetensors").write_bytes(b"w")
    assert changed()  # a file added in one
    (models / "org").mkdir()
    assert changed()
    make_model(models / "org" / "b")
    assert changed()  # one level down
    (models / "org" / "b" / "model-2.safetensors").write_bytes(b"w")
    assert changed()  # a file added two levels down
    (models / "org" / "b" / "config.json").write_text('{"model_type": "llama"}')
    assert changed()  # a file written again (its size)
    assert not changed()
    repo = hf_repo(cache, "org/c", {"r1": {"config.json": b"{}"}}, "r1")
    assert changed()  # a download into the Hugging Face cache
    (repo / "blobs" / "w").write_bytes(b"w" * 10)
    (repo / "snapshots" / "r1" / "model.safetensors").symlink_to(repo / "blobs" / "w")
    assert changed()  # one more of its files finished
    (cache / "models--org--c" / "snapshots" / "rev2").mkdir()
    assert changed()  # a new revision
    (cache / "models--org--c" / "refs" / "main").write_text("rev2")  # a longer name: seen by its size
    assert changed()
    shutil.rmtree(models / "a")
    assert changed()  # a model folder deleted
    assert not changed()


def hf_repo(cache: Path, repo_id: str, revisions: dict[str, dict[str, bytes]], main: str | None) -> Path:
    """The hub cache's layout: blobs by hash, snapshots/<rev>/ of relative symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for rev, files in revisions.items():
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        for name, data in files.items():
            blob = repo / "blobs" / f"{rev}-{name}"
            blob.write_bytes(data)
            (snap / name).symlink_to(os.path.relpath(blob, snap))
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


def test_hf_cache_snapshot_named_by_refs_main(tmp_path):
    cache = tmp_path / "hub"
    config = json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960,
                         "quantization": {"group_size": 64, "bits": 4}}).encode()
    repo = hf_repo(cache, "mlx-community/Qwen3-0.6B-4bit", {
        "aaa": {"config.json": config, "model.safetensors": b"x" * 300},
        "bbb": {"config.json": config, "model.safetensors": b"x" * 7},
    }, main="aaa")
    os.utime(repo / "snapshots" / "aaa", (1, 1))  # older, but the one refs/main names
    found = discover([], cache)
    entry = found["mlx-community/Qwen3-0.6B-4bit"]
    assert entry.path == repo / "snapshots" / "aaa"
    assert (entry.size_bytes, entry.context_length, entry.quantization) == (300, 40960, "4-bit g64")


def test_hf_cache_newest_snapshot_without_refs_and_non_mlx_skipped(tmp_path):
    cache = tmp_path / "hub"
    config = b'{"model_type": "llama", "max_position_embeddings": 4096}'
    repo = hf_repo(cache, "org/model", {
        "old": {"config.json": config, "model.safetensors": b"x" * 2},
        "new": {"config.json": config, "model.safetensors": b"x" * 3},
    }, main=None)
    os.utime(repo / "snapshots" / "old", (1, 1))
    hf_repo(cache, "org/pytorch-only", {"r": {"config.json": config, "pytorch_model.bin": b"x"}}, main="r")
    hf_repo(cache, "gpt2", {"r": {"config.json": config, "model.safetensors": b"x"}}, main="r")
    hf_repo(cache, "org/stale-ref", {"r": {"config.json": config, "model.safetensors": b"x"}}, main="gone")
    (cache / "datasets--org--data" / "snapshots" / "r").mkdir(parents=True)
    (cache / ".locks").mkdir()
    found = discover([], cache)
    assert sorted(found) == ["gpt2", "org/model", "org/stale-ref"]
    assert found["org/model"].path == repo / "snapshots" / "new" and found["org/model"].size_bytes == 3


def test_model_dir_wins_over_hf_cache(tmp_path):
    make_model(tmp_path / "models" / "org" / "name", b"w")
    hf_repo(tmp_path / "hub", "org/name", {"r": {"config.json": b"{}", "model.safetensors": b"ww"}}, main="r")
    found = discover([tmp_path / "models"], tmp_path / "hub")
    assert found["org/name"].path == tmp_path / "models" / "org" / "name"


def test_default_hf_cache(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert default_hf_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_hf_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert default_hf_cache() == tmp_path / "hub"


def test_default_hf_cache_used_when_none(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf_repo(tmp_path / "hub", "org/name", {"r": {"config.json": b"{}", "model.safetensors": b"w"}}, main="r")
    assert list(discover([])) == ["org/name"]


@pytest.mark.parametrize("config, text", [
    ({"quantization": {"group_size": 64, "bits": 4}}, "4-bit g64"),
    ({"quantization_config": {"group_size": 32, "bits": 8}}, "8-bit g32"),
    ({"quantization": {"group_size": 64, "bits": 4, "model.embed_tokens": {"group_size": 64, "bits": 8}}},
     "4-bit g64 (+8-bit layers)"),
    ({"torch_dtype": "bfloat16"}, None),
    ({}, None),
])
def test_quantization_text(tmp_path, config, text):
    make_model(tmp_path / "m" / "q", config={"model_type": "llama", **config})
    assert discover([tmp_path / "m"], tmp_path / "no-hub")["q"].quantization == text


@pytest.mark.skipif(not (REAL / "config.json").is_file(), reason="the default model is not on disk")
def test_real_default_model_through_symlinks(tmp_path):
    linked = tmp_path / "models" / "smol"
    linked.mkdir(parents=True)
    for f in REAL.iterdir():
        (linked / f.name).symlink_to(f)
    (tmp_path / "models" / "whole").symlink_to(REAL, target_is_directory=True)
    found = discover([tmp_path / "models", REAL.parent], tmp_path / "no-hub")
    weights = sum(f.stat().st_size for f in REAL.glob("*.safetensors"))
    assert weights > 50_000_000
    for name in ("smol", "whole", DEFAULT_MODEL_NAME):
        entry = found[name]
        assert (entry.size_bytes, entry.context_length, entry.model_type) == (weights, 8192, "llama")
        assert entry.quantization.startswith("4-bit g32")
