"""Which models a server can serve: the mlx-lm folders in the model folders and the Hugging Face cache.

`discover(model_dirs, hf_cache)` lists every model folder directly in each of
`model_dirs`, and one level down (`org/name`), and every mlx-lm-loadable
snapshot in the Hugging Face hub cache (named by its repo id). Nothing is
loaded: sizes come from file stats, the rest from config.json. A folder that
looks like it was meant to be a model but is not one is skipped with one log
line saying why; hidden folders (`.pull-*` temporary folders) are passed over.

`folders_signature` says, from stats alone, whether any of that may have changed
since (a model pulled, copied in or deleted while the server runs): the pool
asks it on every listing and scans again only when it differs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tierlm.models.loader import read_model_info
from tierlm.models.model_folder import CHAT, model_kind, quantization_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEntry:
    name: str  # the id clients use: "folder", "org/folder", or the HF repo id "org/name"
    path: Path
    size_bytes: int  # the *.safetensors files, symlinks followed
    context_length: int
    model_type: str
    quantization: str | None  # "4-bit g64", "8-bit g32 (+4-bit layers)"; None for float weights
    created: int = 0  # the folder's modification time when found (OpenAI's `created`)
    kind: str = CHAT  # what it serves: chat, embedding or rerank (models.model_folder.model_kind)


class NotAModel(Exception):
    """Why a folder that looks like a model cannot be listed."""


def default_hf_cache() -> Path:
    """Where huggingface_hub keeps its downloads: $HF_HUB_CACHE, else $HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache / "huggingface" / "hub"


def discover(model_dirs: list[Path], hf_cache: Path | None | bool = None) -> dict[str, ModelEntry]:
    """Every model the server can serve, by name; the first of `model_dirs` wins a
    clash, and any of them wins over the Hugging Face cache (`default_hf_cache()`
    when None). A folder that does not exist holds nothing."""
    found: dict[str, ModelEntry] = {}
    clashes: set[str] = set()
    candidates = [c for d in model_dirs for c in _in_model_dir(Path(d).expanduser())]
    if hf_cache is not False:  # False: the Hugging Face cache is not looked in
        candidates += _in_hf_cache(hf_cache if hf_cache is not None else default_hf_cache())
    for entry in candidates:
        if entry.name not in found:
            found[entry.name] = entry
        elif entry.name not in clashes:
            clashes.add(entry.name)
            log.info("model %s: %s is used, %s (and any later one) is not",
                     entry.name, found[entry.name].path, entry.path)
    return found


def read_entry(path: Path, name: str) -> ModelEntry:
    """The entry for model folder `path`; NotAModel says why it is not one."""
    config_path = path / "config.json"
    weights = sorted(path.glob("*.safetensors"))
    if not config_path.is_file():
        raise NotAModel("*.safetensors but no config.json" if weights else "no config.json or *.safetensors")
    if not weights:
        raise NotAModel("config.json but no *.safetensors weights")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotAModel(f"config.json cannot be read ({e})") from e
    if not isinstance(config, dict):
        raise NotAModel("config.json is not a JSON object")
    missing = _missing_shards(path)
    if missing:
        raise NotAModel(f"weights missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    try:
        size = sum(w.stat().st_size for w in weights)
    except OSError as e:
        raise NotAModel(f"weights cannot be read ({e})") from e
    info = read_model_info(path, name)
    return ModelEntry(name, path, size, info.context_length, info.model_type, quantization_text(config),
                      int(path.stat().st_mtime), model_kind(config))


def folders_signature(model_dirs: list[Path], hf_cache: Path | None | bool = None) -> tuple:
    """What discovery would see, from stats alone: every folder it looks through
    (the model folders, two levels of folders in them, the Hugging Face cache,
    each cached repo, its snapshots and refs) with the name, inode, size and
    modification time of each thing in it (links followed: a snapshot's files
    are links to blobs). A model added, removed or replaced, a file of one
    written or a download finished changes it; no file is read, so it is cheap
    enough to ask on every listing."""
    folders = []
    for model_dir in model_dirs:
        model_dir = Path(model_dir).expanduser()
        folders.append(model_dir)
        for child in _subfolders(model_dir, True) if model_dir.is_dir() else []:
            folders += [child, *_subfolders(child, True)]
    if hf_cache is not False:
        cache = hf_cache if hf_cache is not None else default_hf_cache()
        folders.append(cache)
        for repo in _subfolders(cache, True) if cache.is_dir() else []:
            if repo.name.startswith("models--"):
                snapshots = repo / "snapshots"
                revisions = _subfolders(snapshots, True) if snapshots.is_dir() else []
                folders += [repo, repo / "refs", snapshots, *revisions]
    return tuple((str(f), _stat_key(f), _contents(f)) for f in folders)


def _stat_key(path: Path | os.DirEntry) -> tuple | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _contents(folder: Path) -> tuple:
    try:
        with os.scandir(folder) as entries:
            return tuple(sorted((e.name, _stat_key(e)) for e in entries))
    except OSError:
        return ()


def _missing_shards(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return ["model.safetensors.index.json unreadable"]
    return sorted(s for s in shards if not (path / s).is_file())


def _looks_like_model(path: Path) -> bool:
    return (path / "config.json").exists() or any(path.glob("*.safetensors"))


def _subfolders(path: Path, quiet: bool = False) -> list[Path]:
    """The folders in `path`, hidden ones left out; a folder that cannot be listed
    holds none (said once per scan, not on every signature)."""
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as e:
        if not quiet:
            log.warning("%s: cannot be listed (%s)", path, e)
        return []


def _entry_or_log(path: Path, name: str) -> ModelEntry | None:
    try:
        return read_entry(path, name)
    except NotAModel as why:
        log.info("%s: skipped, not a model folder: %s", path, why)
    except OSError as e:  # removed or moved while it was read
        log.info("%s: skipped, it cannot be read: %s", path, e)
    return None


def _in_model_dir(model_dir: Path) -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    for child in _subfolders(model_dir) if model_dir.is_dir() else []:
        if _looks_like_model(child):
            entries += filter(None, [_entry_or_log(child, child.name)])
            continue
        inner = _subfolders(child)
        nested = [_entry_or_log(g, f"{child.name}/{g.name}") for g in inner if _looks_like_model(g)]
        entries += filter(None, nested)
        if not nested:
            log.info("%s: skipped, not a model folder: no config.json or *.safetensors, "
                     "and no model folder directly inside", child)
    return entries


def _in_hf_cache(cache: Path) -> list[ModelEntry]:
    entries = []
    for repo in _subfolders(cache) if cache.is_dir() else []:
        if not repo.name.startswith("models--"):
            continue
        name = repo.name.removeprefix("models--").replace("--", "/", 1)
        snapshot = _snapshot(repo)
        if snapshot is None:
            log.debug("%s: no snapshot", repo)
            continue
        try:
            entries.append(read_entry(snapshot, name))
        except (NotAModel, OSError) as why:  # the cache holds much that is not for mlx-lm: not worth a line at info
            log.debug("%s: not listed: %s", snapshot, why)
    return entries


def _snapshot(repo: Path) -> Path | None:
    """The snapshot that refs/main names, else the newest one."""
    snapshots = repo / "snapshots"
    try:
        named = snapshots / (repo / "refs" / "main").read_text().strip()
        if named.is_dir():
            return named
    except OSError:
        pass
    revisions = _subfolders(snapshots) if snapshots.is_dir() else []
    return max(revisions, key=lambda p: p.stat().st_mtime, default=None)
