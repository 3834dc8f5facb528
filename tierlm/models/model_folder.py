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


CHAT, EMBEDDING, RERANK = "chat", "embedding", "rerank"
_CROSS_ENCODERS = ("BertForSequenceClassification",)


def model_kind(config: dict) -> str:
    """What a model folder's config.json serves: "chat" (a generative model),
    "embedding" (a BERT encoder, tierlm.models.encoder) or "rerank" (a BERT
    cross-encoder)."""
    if config.get("model_type") != "bert":
        return CHAT
    return RERANK if any(a in _CROSS_ENCODERS for a in config.get("architectures") or ()) else EMBEDDING


def max_seq_length(path: Path) -> int | None:
    """An encoder folder's max_seq_length (sentence_bert_config.json): the tokens
    it was trained on and sentence-transformers truncates to, below its
    position embeddings. None where the folder says nothing."""
    config = path / "sentence_bert_config.json"
    try:
        limit = json.loads(config.read_text()).get("max_seq_length") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return limit if isinstance(limit, int) and limit > 0 else None


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def quantization_text(config: dict) -> str | None:
    """How a model's config.json says its weights are quantized ("4-bit g64",
    "8-bit g32 (+4-bit layers)"); None for float weights."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    if quant.get("bits") is None:  # a Hugging Face method of its own (fp8, bitsandbytes, ...)
        return str(quant.get("quant_method") or "quantized")
    text = f"{quant.get('bits')}-bit g{quant.get('group_size')}"
    mixed = sorted({v["bits"] for v in quant.values() if isinstance(v, dict) and "bits" in v} - {quant.get("bits")})
    return text + (f" (+{'/'.join(map(str, mixed))}-bit layers)" if mixed else "")
