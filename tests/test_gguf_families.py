"""GGUF files of the llama, qwen2, qwen3 and phi3 families, made here from tiny
random Hugging Face checkpoints the way llama.cpp's converter makes them,
imported, and compared with mlx-lm's own model built from the checkpoint.

The writer below follows llama.cpp's convert_hf_to_gguf.py (conversion/base.py,
llama.py, qwen.py, phi.py), not tierlm: the hyper-parameters each model class
writes, tensor names from gguf-py's TensorNameMap, the Q/K row permutation of
LlamaModel, Phi-3's fused `qkv_proj` / `gate_up_proj` kept fused, Llama 3.1's
`rope_freqs` factors (LlamaModel.generate_extra_tensors), F32 for vectors and
norms and F32 or F16 for the rest, and a byte-level BPE vocabulary (`gpt2`)
with merges, control tokens and one user-defined token, trained here.

What the importer has to get right shows in the logits: mlx-lm's model on the
original weights (after its own `sanitize`) is the reference, the imported
folder loaded by mlx-lm must give the same logits on a fixed token sequence.
The tokenizer is held to llama.cpp's algorithm, written out here (partition at
control / user-defined tokens, the pre-tokenizer regex of llama-vocab.cpp,
merges by rank).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from tierlm.models.gguf_import import import_gguf, llama3_rope_scaling

regex = pytest.importorskip("regex")  # what llama.cpp's \p{L} / \p{N} classes need

# ---- a byte-level BPE vocabulary --------------------------------------------

# llama-vocab.cpp's regexes (LLAMA_VOCAB_PRE_TYPE_LLAMA3 and _QWEN2)
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex, ignore_merges) as llama-vocab.cpp sets them
PRE = {"llama-bpe": (LLAMA3_SPLIT, True), "qwen2": (QWEN2_SPLIT, False)}

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs there and back again.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2024))
She said they'll be there at 10:30, and we've been waiting since 9. It's the best thing there is!
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies spell)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_CHARS = bytes_to_unicode()


def _spell(text: str) -> str:
    return "".join(BYTE_CHARS[b] for b in text.encode("utf-8"))


def train_merges(text: str, n: int) -> list[tuple[str, str]]:
    """Plain BPE training: the most frequent adjacent pair first, ties by the pair itself."""
    words: dict[tuple[str, ...], int] = {}
    for w in regex.findall(QWEN2_SPLIT, text):
        key = tuple(_spell(w))
        words[key] = words.get(key, 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(n):
        pairs: dict[tuple[str, str], int] = {}
        for w, count in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for w, count in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    return merges


MERGES = train_merges(TRAINING_TEXT, 120)


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos: int | None
    eos: int
    add_bos: bool
    extra: dict = field(default_factory=dict)  # more tokenizer.ggml.* ids (padding)

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def make_vocab(pre: str, control: list[str], user_defined: str, bos: str | None, eos: str, add_bos: bool,
               size: int, pad: str | None = None) -> Vocab:
    """Bytes, merged pieces, the added tokens, then `[PADn]` up to `size` (unused
    ids, as the converter fills them in where the checkpoint's vocab_size is larger)."""
    T = gguf.TokenType
    tokens = list(BYTE_CHARS.values()) + [a + b for a, b in MERGES]
    types = [T.NORMAL] * len(tokens)
    tokens += control + [user_defined]
    types += [T.CONTROL] * len(control) + [T.USER_DEFINED]
    while len(tokens) < size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(T.UNUSED)
    assert len(set(tokens)) == len(tokens)
    vocab = Vocab(tokens, [int(t) for t in types], [f"{a} {b}" for a, b in MERGES], pre,
                  tokens.index(bos) if bos else None, tokens.index(eos), add_bos)
    if pad:
        vocab.extra["padding_token_id"] = tokens.index(pad)
    return vocab


def reference_encode(vocab: Vocab, text: str) -> list[int]:
    """llama.cpp's BPE tokenizer (llm_tokenizer_bpe_session::tokenize with
    parse_special): split at control and user-defined tokens, longest first; each
    other piece split by the pre-tokenizer regex; a word the vocabulary holds
    whole is one token where the pre-tokenizer ignores merges, else the merges
    apply lowest rank first."""
    split, ignore_merges = PRE[vocab.pre]
    ids_of = {t: i for i, t in enumerate(vocab.tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(vocab.merges)}
    whole = sorted((t for t, ty in zip(vocab.tokens, vocab.types) if ty in (3, 4)), key=len, reverse=True)
    pieces: list[tuple[str, bool]] = [(text, False)]
    for special in whole:
        out = []
        for piece, done in pieces:
            if done:
                out.append((piece, done))
                continue
            for k, part in enumerate(piece.split(special)):
                if k:
                    out.append((special, True))
                if part:
                    out.append((part, False))
        pieces = out
    ids: list[int] = []
    for piece, is_special in pieces:
        if is_special:
            ids.append(ids_of[piece])
            continue
        for word in regex.findall(split, piece):
            symbols = list(_spell(word))
            if ignore_merges and "".join(symbols) in ids_of:
                ids.append(ids_of["".join(symbols)])
                continue
            while len(symbols) > 1:
                ranks = [rank.get(pair, math.inf) for pair in zip(symbols, symbols[1:])]
                best = ranks.index(min(ranks))  # the lowest rank, leftmost
                if ranks[best] == math.inf:
                    break
                symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
            ids += [ids_of[s] for s in symbols]
    return ids


# ---- the families: Hugging Face config.json and what llama.cpp makes of them --

LLAMA3_CONTROL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PHI_CONTROL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 416  # bytes (256), merged pieces (115: all TRAINING_TEXT gives), added tokens, unused ids


def llama_vocab() -> Vocab:
    return make_vocab("llama-bpe", LLAMA3_CONTROL, "<tool_call>", "<|begin_of_text|>", "<|eot_id|>", True,
                      VOCAB_SIZE)


def qwen_vocab() -> Vocab:
    return make_vocab("qwen2", QWEN_CONTROL, "<tool_call>", "<|endoftext|>", "<|im_end|>", False, VOCAB_SIZE,
                      pad="<|endoftext|>")


def phi_vocab() -> Vocab:
    # Phi-4-mini's vocabulary is GPT-2-style BPE (its own pre-tokenizer, gpt-4o);
    # the qwen2 split stands in for it here
    return make_vocab("qwen2", PHI_CONTROL, "<tool_call>", "<|endoftext|>", "<|end|>", False, VOCAB_SIZE)


BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE, "hidden_act": "silu"}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
         "attention_bias": False, "mlp_bias": False}
FAMILIES = {
    "llama": ("llama", LLAMA, llama_vocab),
    # Llama 3.2-style: tied embeddings, a head_dim of 64 so that three of the 32
    # RoPE frequencies fall between Llama 3.1's two wavelength bounds
    "llama3.1": ("llama", {**LLAMA, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                           "head_dim": 64, "max_position_embeddings": 131072, "rope_scaling": LLAMA31_ROPE,
                           "tie_word_embeddings": True}, llama_vocab),
    "qwen2": ("qwen2", {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                        "tie_word_embeddings": True, "sliding_window": 32768, "use_sliding_window": False},
              qwen_vocab),
    # head_dim (32) is not hidden_size / heads (16), as in every Qwen3
    "qwen3": ("qwen3", {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
                        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                        "tie_word_embeddings": False, "attention_bias": False}, qwen_vocab),
    # Phi-4-mini-style: partial rotary (0.75 of each head), grouped KV heads
    "phi3": ("phi3", {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
                      "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
                      "tie_word_embeddings": False, "sliding_window": None}, phi_vocab),
}


def hf_checkpoint(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under the tensor names of the family's HF checkpoint."""
    rng = np.random.default_rng(seed)
    h, ff, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def matrix(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32),
         "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = matrix(vocab, h, 4.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        # large Q/K so that attention, and with it RoPE, varies with position
        q, k, v = matrix(q_dim, h, 3.0), matrix(kv_dim, h, 3.0), matrix(kv_dim, h)
        gate, up = matrix(ff, h), matrix(ff, h)
        if config["model_type"] == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([gate, up])
        else:
            w.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": gate,
                      p + "mlp.up_proj.weight": up})
        w[p + "self_attn.o_proj.weight"] = matrix(h, q_dim)
        w[p + "mlp.down_proj.weight"] = matrix(h, ff)
        if config["model_type"] == "qwen2":
            for name, n in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                w[f"{p}self_attn.{name}.bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if config["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
    return w


def reference_model(config: dict, weights: dict[str, np.ndarray], f16: bool = False, bits: int | None = None):
    """mlx-lm's model of the family on the HF weights: in float32, or as a file of
    them holds them and the importer is to keep them (F16 matrices with float32
    vectors as they are; everything bfloat16 for bits=16)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    arrays = {k: mx.array(v.astype(np.float16) if f16 and v.ndim == 2 else v) for k, v in weights.items()}
    if bits == 16:
        arrays = {k: v.astype(mx.bfloat16) for k, v in arrays.items()}
    if hasattr(model, "sanitize"):  # phi3 has none
        arrays = model.sanitize(arrays)
    model.load_weights(list(arrays.items()))
    mx.eval(model.parameters())
    return model


# ---- llama.cpp's converter, the parts these families use ---------------------


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """LlamaModel.permute: each head's rows from half-split to interleaved RoPE order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, base: float, dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the `rope_freqs` tensor of a llama3 rope_scaling."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "phi3": gguf.MODEL_ARCH.PHI3}


def write_gguf(path: Path, arch: str, config: dict, weights: dict[str, np.ndarray], vocab: Vocab,
               f16: bool, *, arch_name: str | None = None, encode=None) -> Path:
    """What convert_hf_to_gguf.py writes for `config` and `weights` (--outtype f32 or f16).
    `encode(gguf_name, data)`, where given, may return (block bytes, GGMLQuantizationType)
    to store a tensor quantized (what llama-quantize would have made of it)."""
    ftype = gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        rope_dims = int(config.get("partial_rotary_factor", 1.0) * h) // heads
        w.add_context_length(config["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        w.add_embedding_length(h)
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_block_count(config["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(config["rope_theta"])
        w.add_file_type(ftype)
        w.add_sliding_window(config.get("sliding_window") or 0)
    else:  # TextModel.set_gguf_parameters (Qwen2Model/Qwen3Model add nothing a causal LM uses)
        w.add_block_count(config["num_hidden_layers"])
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(h)
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_rope_freq_base(config["rope_theta"])  # llama3 scaling: a tensor, no keys
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        if "head_dim" in config:
            w.add_key_length(config["head_dim"])
            w.add_value_length(config["head_dim"])
        w.add_file_type(ftype)
        if arch == "llama":  # LlamaModel.set_gguf_parameters
            w.add_vocab_size(config["vocab_size"])
            w.add_rope_dimension_count(config.get("head_dim") or h // heads)
    # _set_vocab_gpt2 and gguf.SpecialVocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if "padding_token_id" in vocab.extra:
        w.add_pad_token_id(vocab.extra["padding_token_id"])
    w.add_add_bos_token(vocab.add_bos)

    tensors: list[tuple[str, np.ndarray]] = []
    rope = config.get("rope_scaling") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":  # generate_extra_tensors comes first
        tensors.append(("rope_freqs.weight", llama3_rope_factors(
            rope, config["rope_theta"], config.get("head_dim") or h // heads)))
    names = gguf.get_tensor_name_map(ARCHS[arch], config["num_hidden_layers"])
    for name, data in weights.items():
        if arch == "llama":  # LlamaModel.modify_tensors (undo_permute)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, heads, heads)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, heads, config["num_key_value_heads"])
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        tensors.append((new_name, data))
    for name, data in tensors:  # ModelBase.prepare_tensors: vectors and norms stay F32
        keep_f32 = data.ndim <= 1 or name.endswith("_norm.weight")
        encoded = encode(name, data) if encode else None
        if encoded is not None:
            w.add_tensor(name, encoded[0], raw_dtype=encoded[1])
            continue
        w.add_tensor(name, data.astype(np.float16 if f16 and not keep_f32 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- imported and reference models -------------------------------------------


@dataclass
class Case:
    family: str
    f16: bool
    bits: int | None
    config: dict
    vocab: Vocab
    reference: object  # float32, on the checkpoint's weights
    stored: object  # on the weights as the file holds them, in the dtype the import should keep
    model: object
    tokenizer: object
    folder: Path
    gguf_names: list[str]


CASES = [("llama", False, None), ("llama", True, 16), ("llama", True, None), ("llama3.1", False, None),
         ("qwen2", False, None), ("qwen2", True, 16), ("qwen3", False, None), ("qwen3", True, 16),
         ("phi3", False, None), ("phi3", True, 16)]
IDS = [f"{fam}-{'f16' if f16 else 'f32'}-{'bf16' if bits == 16 else 'as-is'}" for fam, f16, bits in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tmp_path_factory) -> Case:
    from mlx_lm import load

    family, f16, bits = request.param
    arch, config, make = FAMILIES[family]
    vocab = make()
    weights = hf_checkpoint(config, seed=sorted(FAMILIES).index(family))
    tmp = tmp_path_factory.mktemp(family)
    path = write_gguf(tmp / f"{family}.gguf", arch, config, weights, vocab, f16)
    folder = import_gguf(path, tmp / "imported", bits=bits)
    model, tokenizer = load(str(folder))
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    return Case(family, f16, bits, config, vocab, reference_model(config, weights),
                reference_model(config, weights, f16, bits), model, tokenizer, folder, names)


# fixed, tokenizer-free input: every kind of id (bytes, merged pieces, added tokens)
SEQUENCE = [7, 300, 45, 260, 381, 12, 99, 273, 374, 378, 51, 290, 3, 140, 330, 256, 88, 301, 17, 64, 350, 222,
            5, 310, 271, 33, 120, 360, 2, 341, 297, 180]


def test_tensor_layout_is_llama_cpps(case):
    """The file holds llama.cpp's names: Phi-3's projections fused, Llama 3.1's rope_freqs."""
    names = set(case.gguf_names)
    assert "token_embd.weight" in names and "blk.1.ffn_down.weight" in names
    assert ("output.weight" in names) != case.config["tie_word_embeddings"]
    if case.family == "phi3":
        assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names
        assert "blk.0.attn_q.weight" not in names and "blk.0.ffn_gate.weight" not in names
    if case.family == "qwen2":
        assert "blk.0.attn_q.bias" in names
    if case.family == "qwen3":
        assert "blk.0.attn_q_norm.weight" in names
    assert ("rope_freqs.weight" in names) == (case.family == "llama3.1")


def test_config(case):
    config = json.loads((case.folder / "config.json").read_text())
    hf = case.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == hf[key], key
    assert config["rope_theta"] == pytest.approx(hf["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
    assert config.get("rope_traditional", False) == (case.family.startswith("llama"))
    if "head_dim" in hf:
        assert config.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]) == hf["head_dim"]
    if case.family == "phi3":
        assert config["partial_rotary_factor"] == pytest.approx(0.75)
    if "rope_scaling" in hf:  # Llama 3.1's, read back from rope_freqs
        assert config["rope_scaling"] == pytest.approx(hf["rope_scaling"], rel=1e-3)
    else:
        assert "rope_scaling" not in config
    assert case.vocab.eos in config["eos_token_id"]
    weights = mx.load(str(case.folder / "model.safetensors"))
    dtypes = {v.dtype for v in weights.values()}
    expected = {16: {mx.bfloat16}, None: {mx.float32, mx.float16} if case.f16 else {mx.float32}}[case.bits]
    assert dtypes == expected
    assert "quantization" not in config


def _log_softmax(logits: mx.array) -> np.ndarray:
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_logits_equal_the_reference(case):
    """Against float32 on the checkpoint's weights: what float16 or bfloat16 weights
    (and arithmetic) cost, no more; greedy picks the same tokens almost everywhere."""
    ids = mx.array([SEQUENCE])
    ours, ref = np.array(case.model(ids).astype(mx.float32))[0], np.array(case.reference(ids))[0]
    # (largest error over the largest logit, KL divergence, greedy agreement)
    if case.bits is None and not case.f16:
        bounds = (1e-4, 1e-6, 1.0)  # float32: rounding only
    elif case.bits is None:
        bounds = (2e-2, 1e-3, 0.9)  # float16 matrices
    else:
        bounds = (0.15, 0.02, 0.9)  # bfloat16 weights and arithmetic, 8 significant bits
    assert _relative_error(ours, ref) < bounds[0]
    p_ref, p_ours = _log_softmax(mx.array(ref[None])), _log_softmax(mx.array(ours[None]))
    kl = (np.exp(p_ref) * (p_ref - p_ours)).sum(-1).mean()
    assert kl < bounds[1], kl
    agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= bounds[2], agree


def test_logits_equal_the_reference_in_the_files_dtype(case):
    """Against mlx-lm's model on the weights as the file holds them, in the dtype the
    import is to give them: the same arithmetic, so (all but) the same logits."""
    if not case.f16:
        pytest.skip("float32 files: the float32 reference is this one")
    ids = mx.array([SEQUENCE])
    ours = np.array(case.model(ids).astype(mx.float32))[0]
    ref = np.array(case.stored(ids).astype(mx.float32))[0]
    assert _relative_error(ours, ref) < 1e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_logits_with_a_kv_cache_equal_the_reference(case):
    """Token by token through mlx-lm's cache: RoPE offsets, not only whole-sequence positions."""
    from mlx_lm.models.cache import make_prompt_cache

    if case.bits is not None or case.f16:
        pytest.skip("the float32 files are enough to see the positions")
    cache = make_prompt_cache(case.model)
    steps = [case.model(mx.array([[t]]), cache=cache) for t in SEQUENCE[:12]]
    ours = np.array(mx.concatenate(steps, axis=1))[0]
    ref = np.array(case.reference(mx.array([SEQUENCE[:12]])))[0]
    assert _relative_error(ours, ref) < 1e-4


TEXTS = [
    "Hello world, the quick brown fox!",
    "def add(a, b):\n    return a + b\n\n",
    "In 2024 we've 1234567 dogs; they'll RUN.  Two  spaces\tand a tab",
    "ünïcødé — “quotes” 日本 🙂",
]


def _templated(vocab: Vocab) -> str:
    specials = [t for t, ty in zip(vocab.tokens, vocab.types) if ty == 3]
    return f"{specials[1]}user\nHi there{specials[-1]}\ntext<tool_call>{{\"a\": 1}}</tool_call> <tool_call> x"


def test_tokenizer_is_llama_cpps(case):
    if case.bits == 16 or case.f16 and case.bits is None:
        pytest.skip("one file per family is enough for the vocabulary")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(case.folder / "tokenizer.json"))
    for text in [*TEXTS, _templated(case.vocab)]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == reference_encode(case.vocab, text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # control and user-defined tokens are one id wherever they stand
    user = case.vocab.id("<tool_call>")
    assert tok.encode("a<tool_call>b", add_special_tokens=False).ids.count(user) == 1
    eos = case.vocab.tokens[case.vocab.eos]
    assert tok.encode(f"x{eos}", add_special_tokens=False).ids[-1] == case.vocab.eos


def test_tokenizer_as_mlx_lm_loads_it(case):
    """No BOS where the GGUF says none; the end of a turn stops generation."""
    if case.bits == 16 or case.f16 and case.bits is None:
        pytest.skip("one file per family is enough for the vocabulary")
    ids = case.tokenizer.encode("Hello world")
    if not case.vocab.add_bos:
        assert case.vocab.bos not in ids
    assert case.vocab.eos in case.tokenizer.eos_token_ids
    assert case.tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"


def test_llama3_tokenizer_adds_bos(llama31):
    """llama.cpp prepends BOS where tokenizer.ggml.add_bos_token is true (Llama 3's
    GGUFs; Llama 3's own tokenizer.json does it with a TemplateProcessing)."""
    _, _, tokenizer, vocab = llama31
    ids = tokenizer.encode("Hello world")
    assert ids[0] == vocab.bos and ids[1:] == reference_encode(vocab, "Hello world")


def test_ignore_merges_for_llama_bpe(tmp_path):
    """llama.cpp's llama-bpe pre-tokenizer sets ignore_merges: a word the vocabulary
    holds whole is one token even where no merge makes it (Llama 3's tokenizer.json
    says so too)."""
    from tokenizers import Tokenizer

    arch, config, make = FAMILIES["llama"]
    vocab = make()
    unused = vocab.tokens.index(f"[PAD{len(vocab.tokens) - 1}]")
    vocab.tokens[unused], vocab.types[unused] = _spell(" zebra"), 1  # made by no merge
    path = write_gguf(tmp_path / "m.gguf", arch, config, hf_checkpoint(config, seed=0), vocab, False)
    folder = import_gguf(path, tmp_path / "out")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert reference_encode(vocab, "the zebra")[-1] == unused
    assert tok.encode("the zebra", add_special_tokens=False).ids == reference_encode(vocab, "the zebra")


# ---- Llama 3.1's RoPE scaling from rope_freqs ---------------------------------


@pytest.mark.parametrize("rope,base,head_dim", [
    (LLAMA31_ROPE, 500000.0, 128),  # Llama 3.2 1B/3B
    ({**LLAMA31_ROPE, "factor": 8.0}, 500000.0, 128),  # Llama 3.1 8B/70B/405B
    (LLAMA31_ROPE, 500000.0, 64),
    ({**LLAMA31_ROPE, "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}, 500000.0, 128),
])
def test_llama3_rope_scaling_recovers_the_config(rope, base, head_dim):
    scaling = llama3_rope_scaling(llama3_rope_factors(rope, base, head_dim), base, head_dim)
    assert scaling["rope_type"] == "llama3"
    assert scaling["original_max_position_embeddings"] == 8192
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert scaling[key] == pytest.approx(rope[key], rel=1e-3), key


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    from mlx_lm import load

    arch, config, make = FAMILIES["llama3.1"]
    tmp = tmp_path_factory.mktemp("llama31-rope")
    vocab = make()
    path = write_gguf(tmp / "m.gguf", arch, config, hf_checkpoint(config, seed=1), vocab, False)
    model, tokenizer = load(str(import_gguf(path, tmp / "out")))
    return config, model, tokenizer, vocab


def test_imported_rope_frequencies_equal_mlx_lms(llama31):
    from mlx_lm.models import llama

    config, model, _, _ = llama31
    ours = model.layers[0].self_attn.rope
    theirs = llama.Model(llama.ModelArgs.from_dict(config)).layers[0].self_attn.rope
    assert type(ours).__name__ == type(theirs).__name__ == "Llama3RoPE"
    np.testing.assert_allclose(np.array(ours._freqs), np.array(theirs._freqs), rtol=1e-4)
    assert ours.traditional and not theirs.traditional  # the permuted Q/K rows


# ---- files the importer must refuse, leaving nothing behind -------------------


def _assert_refused(path: Path, out: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        import_gguf(path, out)
    assert not out.exists()
    assert not (out.parent / f".{out.name}.importing").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [path.name]


def _small_gguf(path: Path, vocab: Vocab | None = None, arch_name: str | None = None) -> Path:
    arch, config, make = FAMILIES["llama"]
    weights = hf_checkpoint(config, seed=0)
    return write_gguf(path, arch, config, weights, vocab or make(), False, arch_name=arch_name)


def test_truncated_file_is_refused(tmp_path):
    whole = _small_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "whole.gguf").unlink()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    _assert_refused(tmp_path / "cut.gguf", tmp_path / "out", "cut.gguf is not a readable GGUF")


def test_header_only_file_is_refused(tmp_path):
    """Cut inside the metadata, not only the tensor data."""
    whole = _small_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "whole.gguf").unlink()
    (tmp_path / "cut.gguf").write_bytes(whole[:2000])
    _assert_refused(tmp_path / "cut.gguf", tmp_path / "out", "cut.gguf is not a readable GGUF")


def test_unknown_architecture_is_refused(tmp_path):
    _small_gguf(tmp_path / "m.gguf", arch_name="mamba9")
    _assert_refused(tmp_path / "m.gguf", tmp_path / "out", "architecture 'mamba9' is not supported")


def _short_types(vocab: Vocab) -> None:
    vocab.types = vocab.types[:-3]  # three tokens without a type


def _unknown_merge(vocab: Vocab) -> None:
    vocab.merges = [*vocab.merges, "Ġzebra Ġquagga"]  # of tokens the vocabulary lacks


@pytest.mark.parametrize("breaks", [_short_types, _unknown_merge], ids=["short-token-types", "unknown-merge"])
def test_broken_vocabulary_is_refused(tmp_path, breaks):
    vocab = FAMILIES["llama"][2]()
    breaks(vocab)
    _small_gguf(tmp_path / "m.gguf", vocab)
    _assert_refused(tmp_path / "m.gguf", tmp_path / "out", "(?i)vocabulary")
