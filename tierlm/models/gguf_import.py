"""Turn a GGUF file into an MLX model folder that mlx-lm loads.

Architectures: `llama` (Llama 2/3.x, Mistral, SmolLM: mlx-lm `llama`), `qwen2`
(Qwen2.5, Qwen2.5-Coder), `qwen3`, `phi3` and `gemma3` (-> `gemma3_text`).

Tensors, when no `bits` are asked for (the default): each quantized matrix
becomes MLX affine, group size 32, in the fewest bits that hold its GGUF type,
written from the GGUF blocks themselves (gguf_affine): Q4_0, Q4_1 and Q4_K 4
bits, Q5_0, Q5_1 and Q5_K 5 bits, Q8_0 8 bits, all exact but for the float16
rounding of the K-quants' sub-block scales; Q6_K quantized again to 8 bits from
its exact values; other types (Q2_K, Q3_K, IQ*) dequantized and quantized again
to 4 bits. F32, F16 and BF16 tensors are kept as they are. config.json's
`quantization` names the modules whose bits differ from the most common ones.
With `bits` 4 or 8 every matrix is dequantized with the `gguf` package and
quantized again to that many MLX bits (the widest types to 8); 16 writes
bfloat16 (gguf_dequant).

What llama.cpp's converter changed is undone here: Gemma's RMSNorm weights are
stored with the +1 already added (mlx-lm adds it itself, so it is subtracted);
llama's Q/K rows are permuted for interleaved RoPE, which is mlx-lm's
`rope_traditional`, so they stay as they are (Qwen's, Phi-3's and Gemma's are
not permuted: they keep the half-split RoPE that mlx-lm's models use).

The tokenizer is rebuilt with `tokenizers` from the GGUF vocabulary as
llama.cpp tokenizes it: byte-level BPE for `gpt2` vocabularies, split first by
the pre-tokenizer regex the file names (`tokenizer.ggml.pre`), SentencePiece-
style BPE with byte fallback for `llama` ones; control tokens are special,
user-defined ones (Qwen's `<tool_call>`) are matched whole in any text.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tierlm.models.gguf_affine import FLOAT_TYPES, convertible, to_affine
from tierlm.models.gguf_dequant import GGUFTensor, quantization_config, read_gguf, to_mlx, type_counts
from tierlm.models.model_folder import write_json_atomic

GROUP_SIZE = 32  # MLX affine groups: 32 values, as GGUF's blocks and K-quant sub-blocks
# What config.json's "gguf" entry says the folder was made by. 1 (no entry): every
# tensor re-quantized to 8 bits unless all were Q4_0/Q4_1/Q8_0/F16/F32; 2: each
# quantized tensor in the fewest affine bits that hold its type (gguf_affine)
IMPORT_FORMAT = 2
_NORMAL, _CONTROL_TOKEN, _USER_DEFINED, _BYTE = 1, 3, 4, 6  # llama.cpp token_type values

# (description, done, total): a stage when total is 0, else a step of it
Progress = Callable[[str, int, int], None]

_LLAMA_LAYER_NAMES = {
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
_GEMMA3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN3_LAYER_NAMES = {**_LLAMA_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama.cpp keeps Phi-3's fused projections fused, as mlx-lm's phi3 does
_PHI3_LAYER_NAMES = {**_LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors llama.cpp computes from the config (RoPE factors); the config rebuilds them in mlx-lm
_DERIVED = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _rename(gguf_name: str, layer_names: dict[str, str]) -> str:
    module, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if match:
        layer, part = match.groups()
        return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
    return f"{_TOP_NAMES[module]}.{suffix}"


def mlx_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.scales` -> `model.layers.3.self_attn.q_proj.scales`, in the
    names the importer gives `arch`'s tensors (a key of ARCHITECTURES)."""
    return _rename(gguf_name, ARCHITECTURES[arch].layer_names)


def _bits_of(weights: dict[str, mx.array], module: str) -> int:
    """Packed uint32 columns * 32 / input features = bits per weight."""
    packed = weights[f"{module}.weight"].shape[-1]
    in_features = weights[f"{module}.scales"].shape[-1] * GROUP_SIZE
    return packed * 32 // in_features


def affine_quantization(weights: dict[str, mx.array]) -> dict | None:
    """mlx-lm's `quantization` for group-size-32 affine weights: the bits most
    modules have, and an entry of its own for each module with other bits."""
    quantized = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if not quantized:
        return None
    bits = {m: _bits_of(weights, m) for m in quantized}
    common = max(sorted(set(bits.values())), key=list(bits.values()).count)
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    # mlx-lm reads per-module overrides from the same dict
    quant.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in bits.items() if b != common})
    return quant


def _common_config(meta: dict, arch: str, model_type: str) -> dict:
    """The hyper-parameters every decoder GGUF states, under its architecture's prefix."""
    p = f"{arch}."
    heads = _scalar(meta, p + "attention.head_count")
    return {
        "model_type": model_type,
        "hidden_size": _scalar(meta, p + "embedding_length"),
        "intermediate_size": _scalar(meta, p + "feed_forward_length"),
        "num_hidden_layers": _scalar(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, p + "attention.head_count_kv", heads),
        "rms_norm_eps": _scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(meta, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _scalar(meta, p + "context_length", 4096),
        "vocab_size": _scalar(meta, p + "vocab_size", len(meta["tokenizer.ggml.tokens"])),
    }


def _llama_config(meta: dict) -> dict:
    config = _common_config(meta, "llama", "llama")
    head_dim = _scalar(meta, "llama.attention.key_length")
    if head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"]:
        config["head_dim"] = head_dim  # Mistral Nemo and the like
    # llama.cpp permutes Q/K rows for its interleaved RoPE; mlx-lm's
    # traditional RoPE is the same layout, so no un-permuting is needed.
    config["rope_traditional"] = True
    scaling = _rope_scaling(meta, "llama")
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    """Linear and YaRN scaling as the GGUF states them; Llama 3.1's is a tensor
    of factors (rope_freqs) that llama3_rope_scaling reads back."""
    kind = _scalar(meta, f"{arch}.rope.scaling.type")
    factor = _scalar(meta, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor:
        original = _scalar(meta, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    return None


def _qwen_config(meta: dict, arch: str) -> dict:
    """Qwen2 and Qwen3: Qwen3 adds Q/K norms and a head size of its own."""
    config = _common_config(meta, arch, arch)
    config["rms_norm_eps"] = _scalar(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch == "qwen3":
        config["head_dim"] = _scalar(meta, "qwen3.attention.key_length",
                                     config["hidden_size"] // config["num_attention_heads"])
    scaling = _rope_scaling(meta, arch)
    if scaling:
        config["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}
    return config


def _phi3_config(meta: dict) -> dict:
    config = _common_config(meta, "phi3", "phi3")
    heads = config["num_attention_heads"]
    rotary = _scalar(meta, "phi3.rope.dimension_count", config["hidden_size"] // heads)
    config["partial_rotary_factor"] = rotary / (config["hidden_size"] // heads)
    original = _scalar(meta, "phi3.rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = original
    return config


def _gemma3_config(meta: dict) -> dict:
    """llama.cpp's converter writes only part of Gemma 3's hyper-parameters; the
    rest (local RoPE base, sliding window pattern, attention scale) is fixed in
    llama.cpp's model code for the architecture, and so taken from there."""
    p = "gemma3."
    heads = _scalar(meta, p + "attention.head_count")
    hidden = _scalar(meta, p + "embedding_length")
    head_dim = _scalar(meta, p + "attention.key_length", 256)
    layers = _scalar(meta, p + "block_count")
    pattern = meta.get(p + "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True where sliding; mlx-lm wants the period
        pattern = next((i + 1 for i, sliding in enumerate(pattern) if not sliding), len(pattern))
    config = {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, p + "feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _scalar(meta, p + "rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": _scalar(meta, p + "rope.freq_base_swa", 10_000.0),
        # llama.cpp: 1/sqrt(hidden/heads) for the 27B model (62 layers), 1/sqrt(head_dim) otherwise
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "sliding_window": _scalar(meta, p + "attention.sliding_window", 512),
        "sliding_window_pattern": int(pattern),
        "max_position_embeddings": _scalar(meta, p + "context_length", 32768),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "final_logit_softcapping": _scalar(meta, p + "final_logit_softcapping"),
        "attn_logit_softcapping": _scalar(meta, p + "attn_logit_softcapping"),
    }
    if _scalar(meta, p + "rope.scaling.type") == "linear":  # global layers only (4B and up)
        config["rope_scaling"] = {"rope_type": "linear", "factor": _scalar(meta, p + "rope.scaling.factor")}
    return config


@dataclass(frozen=True)
class _Arch:
    layer_names: dict[str, str]
    config: Callable[[dict], dict]
    norm_shift: float = 0.0  # what llama.cpp added to every `*norm.weight`
    # control tokens that end a turn besides the GGUF's eos token
    end_of_turn: tuple[str, ...] = field(default_factory=tuple)
    chat_template: str | None = None  # when the GGUF carries none


# Gemma 3's own template (as in its tokenizer_config.json): system text goes in
# front of the first user turn; the assistant's role is `model`.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)

ARCHITECTURES = {
    "llama": _Arch(_LLAMA_LAYER_NAMES, _llama_config, end_of_turn=("<|eot_id|>", "<|eom_id|>")),
    "qwen2": _Arch(_LLAMA_LAYER_NAMES, lambda meta: _qwen_config(meta, "qwen2"), end_of_turn=("<|im_end|>",)),
    "qwen3": _Arch(_QWEN3_LAYER_NAMES, lambda meta: _qwen_config(meta, "qwen3"), end_of_turn=("<|im_end|>",)),
    "phi3": _Arch(_PHI3_LAYER_NAMES, _phi3_config, end_of_turn=("<|end|>",)),
    "gemma3": _Arch(_GEMMA3_LAYER_NAMES, _gemma3_config, norm_shift=1.0,
                    end_of_turn=("<end_of_turn>",), chat_template=GEMMA3_CHAT_TEMPLATE),
}


def _architecture(meta: dict) -> _Arch:
    arch = _scalar(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    return ARCHITECTURES[arch]


def build_config(meta: dict, weights: dict[str, mx.array], quantization: dict | None = None,
                 derived: dict[str, np.ndarray] | None = None) -> dict:
    """config.json for mlx-lm; `derived` holds the RoPE factor tensors llama.cpp
    computed from the original config, read back into it here."""
    spec = _architecture(meta)
    config = spec.config(meta)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if quantization:
        config["quantization"] = quantization
    config.update(_rope_from_tensors(config, derived or {}))
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = _scalar(meta, "tokenizer.ggml.bos_token_id"), _scalar(meta, "tokenizer.ggml.eos_token_id")
    turn_ends = [tokens.index(t) for t in spec.end_of_turn if t in tokens]
    if turn_ends:
        # mlx-lm stops on every id in config.json's eos_token_id
        config["eos_token_id"] = list(dict.fromkeys(([eos] if eos is not None else []) + turn_ends))
        if bos is not None:
            config["bos_token_id"] = bos
    return config


def _rope_from_tensors(config: dict, derived: dict[str, np.ndarray]) -> dict:
    if "rope_factors_long" in derived:  # Phi-3's LongRoPE (128k models)
        return {"rope_scaling": {"type": "longrope", "long_factor": derived["rope_factors_long"].tolist(),
                                 "short_factor": derived["rope_factors_short"].tolist()}}
    if "rope_freqs" in derived and config["model_type"] == "llama":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return {"rope_scaling": llama3_rope_scaling(derived["rope_freqs"], config["rope_theta"], head_dim)}
    return {}


def llama3_rope_scaling(factors: np.ndarray, base: float, head_dim: int,
                        original_context: int = 8192) -> dict:
    """Llama 3.1's rope_scaling from the factor per frequency that llama.cpp's
    converter stored: 1 for short wavelengths, `factor` for long ones, and
    between them 1 / ((1 - s) / factor + s) with s linear in 1 / wavelength.
    Only the two wavelengths where s is 0 and 1 matter, so the original context
    is taken as Meta's 8192 and the two frequency factors follow from it."""
    factors = np.asarray(factors, np.float64)
    factor = float(factors.max())
    wavelengths = 2 * np.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    between = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    low, high = 1.0, 4.0
    if factor > 1 and between.sum() >= 2:
        s = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[between], s, 1)  # s = slope / w + intercept
        span = original_context / slope  # high - low
        low = -intercept * span
        high = low + span
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
            "high_freq_factor": float(high), "original_max_position_embeddings": original_context}


# ---- tokenizer ----------------------------------------------------------


def _token_types(meta: dict) -> list[int]:
    types = meta["tokenizer.ggml.token_type"]
    return types.tolist() if isinstance(types, mx.array) else list(types)


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by the name the GGUF gives
# in `tokenizer.ggml.pre`; the contractions are its case-insensitive spelling.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # one digit a piece
_LLAMA3_FAMILY = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}
_SPLITS = {**dict.fromkeys(_LLAMA3_FAMILY, _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT)}


def _byte_level_pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in ("smollm", "starcoder", "refact"):  # digits split one by one, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt-2", "gpt2"):
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                     f"{', '.join(sorted({*_SPLITS, 'smollm', 'starcoder', 'refact', 'gpt-2', 'default'}))})")


def _byte_level_bpe(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp takes a piece that is a token whole before merging (Llama 3's own tokenizer does too)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     ignore_merges=pre in _LLAMA3_FAMILY))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    tokenizer.post_processor = byte_level
    bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
    if bos_id is not None and _adds_bos(meta):  # Llama 3: <|begin_of_text|> first
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.Sequence([byte_level, processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])])
    _add_whole_tokens(tokenizer, tokens, types)
    return tokenizer


def _adds_bos(meta: dict) -> bool:
    """As llama.cpp: the file says, else byte-level vocabularies of the Llama 3 family add BOS."""
    return bool(_scalar(meta, "tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.pre") in _LLAMA3_FAMILY))


def _add_whole_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int],
                      user_defined: Callable[[int], bool] = lambda i: True) -> None:
    """Control tokens as special ones; user-defined ones (Qwen's `<tool_call>`,
    those `user_defined(i)` keeps) matched whole wherever they stand in a text,
    as llama.cpp matches both."""
    tokenizer.add_special_tokens([
        AddedToken(tok, special=True, normalized=False) for tok, t in zip(tokens, types) if t == _CONTROL_TOKEN
    ])
    tokenizer.add_tokens([
        AddedToken(tok, special=False, normalized=False)
        for i, (tok, t) in enumerate(zip(tokens, types)) if t == _USER_DEFINED and user_defined(i)
    ])


def sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become `▁`, pieces merge
    best-first, bytes not in the vocabulary fall back to `<0xNN>` tokens.
    The GGUF holds no merges, so they are rebuilt from the vocabulary: every
    split of a piece into two known pieces, the piece's rank deciding. Gemma's
    rank is its position in the vocabulary (its scores do not follow the merge
    order); for others, the score."""
    arch = _scalar(meta, "general.architecture", "")
    gemma = str(arch).startswith("gemma")
    # Gemma files spell the tokens made of spaces with real spaces; the
    # normalizer turns spaces into `▁`, so they are looked up that way
    spelled = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(spelled):
        vocab.setdefault(tok, i)
    mergeable = {i for i, t in enumerate(types) if t == _NORMAL or spelled[i] != tokens[i]}
    if gemma:
        order = sorted(mergeable)
    else:
        scores = list(meta["tokenizer.ggml.scores"])
        order = sorted(mergeable, key=lambda i: (-scores[i], i))
    parts_ok = {tok for tok, i in vocab.items() if types[i] not in (_CONTROL_TOKEN, _BYTE)}
    merges: list[tuple[str, str]] = []
    for i in order:
        piece = spelled[i]
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in parts_ok and piece[k:] in parts_ok]
        merges += sorted(local, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    unk_id = _scalar(meta, "tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True, byte_fallback=True,
    ))
    add_prefix = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", not gemma))
    replace = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if add_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_prefix else steps)
    # user-defined pieces (newline runs, HTML tags, ...) are matched whole, but
    # not those spelled with spaces: the normalizer has made those `▁`
    _add_whole_tokens(tokenizer, tokens, types, user_defined=lambda i: tokens[i] == spelled[i])
    bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
    if bos_id is not None and _scalar(meta, "tokenizer.ggml.add_bos_token", True):
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """A `tokenizers` Tokenizer for the GGUF vocabulary, and its tokenizer_config."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = _token_types(meta)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF vocabulary is broken: {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, types)
        adds_bos = _adds_bos(meta)
    elif kind == "llama":
        tokenizer = sentencepiece_bpe(meta, tokens, types)
        adds_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (supported: gpt2, llama)")
    specials = [tok for tok, t in zip(tokens, types) if t == _CONTROL_TOKEN]

    def token_at(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    arch = _scalar(meta, "general.architecture")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": _scalar(meta, f"{arch}.context_length", 4096),
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": adds_bos,
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": specials,
    }
    template = meta.get("tokenizer.chat_template") or ARCHITECTURES.get(arch, ARCHITECTURES["llama"]).chat_template
    if template:
        tokenizer_config["chat_template"] = template
    return tokenizer, tokenizer_config


# ---- weights ------------------------------------------------------------


def _is_derived(gguf_name: str) -> bool:
    return gguf_name.split(".")[0] in _DERIVED


def _kept(t: GGUFTensor) -> mx.array:
    """A float tensor in the file's own dtype (bfloat16 for BF16, float32 for F64)."""
    if t.type_name == "F16":
        return mx.array(np.asarray(t.raw).reshape(t.shape))
    array = mx.array(t.to_float32())
    return array.astype(mx.bfloat16) if t.type_name == "BF16" else array


def _converted_one_by_one(tensors: list[GGUFTensor], spec: _Arch, progress: Progress, stage: str, convert):
    """Each stored (not derived) tensor under its MLX name through
    `convert(tensor, name)`, evaluated as it comes (one tensor's floats in memory
    at a time), with progress by values converted; the MLX weights."""
    weights: dict[str, mx.array] = {}
    total = sum(int(np.prod(t.shape)) for t in tensors)
    done = 0
    for t in tensors:
        if _is_derived(t.name):
            continue
        converted = convert(t, _rename(t.name, spec.layer_names))
        mx.eval(list(converted.values()))
        weights.update(converted)
        done += int(np.prod(t.shape))
        progress(stage, done, total)
    return weights


def affine_weights(tensors: list[GGUFTensor], spec: _Arch,
                   progress: Progress) -> tuple[dict[str, mx.array], dict | None]:
    """Each quantized matrix as MLX affine, group size 32, in the fewest bits that
    hold its GGUF type (gguf_affine); float tensors as the file has them; a
    quantized tensor of another shape dequantized as `bits=8` would (bfloat16)."""
    def convert(t: GGUFTensor, name: str) -> dict[str, mx.array]:
        if spec.norm_shift and name.endswith("norm.weight"):  # float32 once the shift is off
            shifted = t.to_float32() - np.float32(spec.norm_shift)
            return {name: mx.array(shifted)} if t.type_name in FLOAT_TYPES else to_mlx(name, shifted, 8)
        if t.type_name in FLOAT_TYPES:
            return {name: _kept(t)}
        if convertible(t):
            affine = to_affine(t)
            module = name.removesuffix(".weight")
            return {f"{module}.weight": affine.weight, f"{module}.scales": affine.scales,
                    f"{module}.biases": affine.biases}
        return to_mlx(name, t.to_float32(), 8)  # not a matrix of whole groups: what bits=8 makes of it

    weights = _converted_one_by_one(tensors, spec, progress, "converting to MLX affine (group size 32)", convert)
    return weights, affine_quantization(weights)


def dequantized_weights(tensors: list[GGUFTensor], spec: _Arch, bits: int,
                        progress: Progress) -> tuple[dict[str, mx.array], dict | None]:
    overrides: dict[str, int] = {}

    def convert(t: GGUFTensor, name: str) -> dict[str, mx.array]:
        values = t.to_float32()
        if spec.norm_shift and name.endswith("norm.weight"):
            values = values - np.float32(spec.norm_shift)
        converted = to_mlx(name, values, t.bits_for(bits))
        if name.removesuffix(".weight") + ".scales" in converted:
            overrides[name.removesuffix(".weight")] = t.bits_for(bits)
        return converted

    stage = f"converting to {'bfloat16' if bits == 16 else f'{bits}-bit'}"
    return _converted_one_by_one(tensors, spec, progress, stage, convert), quantization_config(bits, overrides)


def logging_progress(logger: logging.Logger) -> Progress:
    """Progress as log lines: one per stage, and one per quarter of a long step."""
    state: dict[str, Any] = {"stage": None, "quarter": -1}

    def report(stage: str, done: int, total: int) -> None:
        quarter = 4 * done // total if total else -1
        if stage != state["stage"] or (quarter != state["quarter"] and quarter in (1, 2, 3)):
            logger.info("%s%s", stage, f": {25 * quarter}%" if total else "")
        state.update(stage=stage, quarter=quarter)

    return report


def import_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None,
                bits: int | None = None) -> Path:
    """Write an mlx-lm model folder for `gguf_path` into `out_dir` (created).

    `bits` None writes each quantized matrix in the fewest MLX affine bits that
    hold its GGUF type (see the module's doc); 4 or 8 re-quantize every matrix;
    16 writes bfloat16. config.json's "gguf" entry records IMPORT_FORMAT.
    The folder is written under a temporary name and renamed when complete: a
    file that fails (truncated, an unknown architecture, a broken vocabulary)
    raises ValueError and leaves nothing behind."""
    report: Progress = progress or (lambda *_: None)
    report(f"reading {gguf_path.name}", 0, 0)
    try:
        meta, tensors = read_gguf(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # gguf's reader on a short or damaged file
        raise ValueError(f"{gguf_path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    spec = _architecture(meta)
    report("building the tokenizer", 0, 0)  # first: a broken vocabulary fails before the long part
    try:
        tokenizer, tokenizer_config = build_tokenizer(meta)
    except ValueError:
        raise
    except Exception as e:  # tokenizers' own (a merge of an unknown token), a short or missing list
        raise ValueError(f"{gguf_path.name} has a broken vocabulary ({type(e).__name__}: {e})") from e
    derived = {t.name.split(".")[0]: t.to_float32() for t in tensors if _is_derived(t.name)}
    if bits is None:
        weights, quantization = affine_weights(tensors, spec, report)
    else:
        weights, quantization = dequantized_weights(tensors, spec, bits, report)
    config = build_config(meta, weights, quantization, derived)
    config["gguf"] = {"file": gguf_path.name, "tensor_types": type_counts(tensors),
                      "file_type": _scalar(meta, "general.file_type"), "import_format": IMPORT_FORMAT}
    staging = out_dir.with_name(f".{out_dir.name}.importing")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        report(f"writing {len(weights)} tensors", 0, 0)
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(staging / "tokenizer.json"))
        write_json_atomic(staging / "tokenizer_config.json", tokenizer_config)
        special_map = {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        write_json_atomic(staging / "special_tokens_map.json", special_map)
        write_json_atomic(staging / "config.json", config)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def import_format(folder: Path) -> int | None:
    """The IMPORT_FORMAT `folder` was imported with (1 for folders older than the
    number); None when it is not an imported GGUF or has no readable config."""
    try:
        entry = json.loads((folder / "config.json").read_text()).get("gguf")
    except (OSError, ValueError):
        return None
    return int(entry.get("import_format", 1)) if isinstance(entry, dict) else None


def describe(config: dict) -> str:
    return json.dumps({k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers")})
