"""Turn a llama-architecture GGUF file into an MLX model folder that mlx-lm loads.

`mx.load` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantized triples (weight / scales / biases, group size 32), everything else as
plain arrays. We rename the tensors to mlx-lm's llama names, keep them quantized,
and rebuild the tokenizer from the GGUF vocabulary with the `tokenizers` library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tierlm.models.model_folder import write_json_atomic

GROUP_SIZE = 32  # every GGUF block format mx.load reads uses 32-value groups
_CONTROL_TOKEN = 3  # llama.cpp token_type for special / control tokens

# GGUF tensor name -> mlx-lm llama module path
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def mlx_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`."""
    module, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if match:
        layer, part = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[module]}.{suffix}"


def _bits_of(weights: dict[str, mx.array], module: str) -> int:
    """Packed uint32 columns * 32 / input features = bits per weight."""
    packed = weights[f"{module}.weight"].shape[-1]
    in_features = weights[f"{module}.scales"].shape[-1] * GROUP_SIZE
    return packed * 32 // in_features


def build_config(meta: dict, weights: dict[str, mx.array]) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    p = "llama."
    heads = _scalar(meta, p + "attention.head_count")
    hidden = _scalar(meta, p + "embedding_length")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, p + "feed_forward_length"),
        "num_hidden_layers": _scalar(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, p + "attention.head_count_kv", heads),
        "rms_norm_eps": _scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(meta, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _scalar(meta, p + "context_length", 4096),
        "vocab_size": _scalar(meta, p + "vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        # llama.cpp permutes Q/K rows for its interleaved RoPE; mlx-lm's
        # traditional RoPE is the same layout, so no un-permuting is needed.
        "rope_traditional": True,
    }
    quantized = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if quantized:
        bits = {m: _bits_of(weights, m) for m in quantized}
        common = max(set(bits.values()), key=list(bits.values()).count)
        quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
        # mlx-lm reads per-module overrides from the same dict
        quant.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in bits.items() if b != common})
        config["quantization"] = quant
    return config


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """A byte-level BPE tokenizer (gpt2-style GGUF vocab) and its tokenizer_config."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    types = types.tolist() if isinstance(types, mx.array) else list(types)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # SmolLM / StarCoder style: digits split one by one, then GPT-2 byte level
    split_digits = meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tok for tok, t in zip(tokens, types) if t == _CONTROL_TOKEN]
    tokenizer.add_special_tokens(specials)

    def token_at(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": _scalar(meta, "llama.context_length", 4096),
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": specials,
    }
    if template := meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = template
    return tokenizer, tokenizer_config


def import_gguf(
    gguf_path: Path, out_dir: Path, progress: Callable[[str], None] = lambda _: None
) -> Path:
    """Write an mlx-lm model folder for `gguf_path` into `out_dir` (created)."""
    progress(f"reading {gguf_path.name}")
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    weights = {mlx_tensor_name(k): v for k, v in raw.items()}
    config = build_config(meta, weights)
    tokenizer, tokenizer_config = build_tokenizer(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress(f"writing {len(weights)} tensors")
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json_atomic(out_dir / "tokenizer_config.json", tokenizer_config)
    special_map = {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    write_json_atomic(out_dir / "special_tokens_map.json", special_map)
    write_json_atomic(out_dir / "config.json", config)  # last: marks the folder complete
    return out_dir


def describe(config: dict) -> str:
    return json.dumps({k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers")})
