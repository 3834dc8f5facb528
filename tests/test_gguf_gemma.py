"""Gemma 3 270M from its Q4_K_M GGUF (PyPI packages): pulled, imported, served.

The pulled folder is compared with a reference built here independently of the
importer: mlx-lm's gemma3_text model with the hyper-parameters Google publishes
for gemma-3-270m written out below (not read from the GGUF), tensor names
mapped by this file's own table, the float32 values of `gguf.quants.dequantize`
with llama.cpp's +1 taken off the norms. What the importer adds on top (its
config from GGUF metadata, its renaming, the norm shift, the GGUF blocks
written as MLX 4/5/8-bit affine weights, the tokenizer) is what the comparison
checks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import GEMMA_KEY

from tierlm.models.gguf_dequant import GGUFTensor, read_gguf, to_mlx
from tierlm.models.gguf_import import sentencepiece_bpe, build_config
from tierlm.models.loader import read_model_info

pytestmark = pytest.mark.slow  # Gemma 3 270M pulled and loaded three times; test_gguf_families is the fast equivalent

NAME = "gemma-3-270m"

# google/gemma-3-270m's config.json
REFERENCE_ARGS = {
    "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18, "intermediate_size": 2048,
    "num_attention_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 262144, "num_key_value_heads": 1,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "max_position_embeddings": 32768,
}
REFERENCE_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "token_embd": "model.embed_tokens", "output_norm": "model.norm",
}


@pytest.fixture(scope="session")
def gemma_gguf(real_ggufs):
    """The original GGUF (assembled once a session, conftest.real_ggufs): metadata and tensors."""
    return read_gguf(real_ggufs(NAME))


@pytest.fixture(scope="session")
def loaded_gemma(gemma_path):
    from tierlm.models.loader import load_model

    return load_model(gemma_path)


@pytest.fixture(scope="session")
def reference(gemma_gguf):
    from mlx_lm.models import gemma3_text

    _, tensors = gemma_gguf
    model = gemma3_text.Model(gemma3_text.ModelArgs(**REFERENCE_ARGS))
    weights = {}
    for t in tensors:
        parts = t.name.split(".")
        module = f"model.layers.{parts[1]}.{REFERENCE_NAMES[parts[2]]}" if parts[0] == "blk" \
            else REFERENCE_NAMES[parts[0]]
        values = t.to_float32()
        weights[f"{module}.weight"] = mx.array(values - 1.0 if module.endswith("norm") else values)
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    return model


def _greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    ids = mx.array(tokenizer.encode(prompt))
    out = []
    for token, _ in generate_step(ids, model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(token))
    return out


def test_folder_config(gemma_path):
    config = json.loads((gemma_path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["tie_word_embeddings"] is True
    assert {k: config[k] for k in ("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
                                   "head_dim", "rope_local_base_freq", "rope_theta")} == \
        {"sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
         "head_dim": 256, "rope_local_base_freq": 10_000.0, "rope_theta": 1_000_000.0}
    # Q5_0 (most layers) 5 bits, Q4_K 4, Q8_0 (the embedding, attn_v) and Q6_K 8
    quant = config["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {"group_size": 32, "bits": 5, "mode": "affine"}
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert {v["bits"] for v in quant.values() if isinstance(v, dict)} == {4, 8}
    assert 106 in config["eos_token_id"] and 1 in config["eos_token_id"]  # <end_of_turn>, <eos>
    assert read_model_info(gemma_path).context_length == 32768
    assert (gemma_path / "GEMMA_TERMS.html").is_file()


def test_list_command_shows_it(gemma_path):
    result = subprocess.run([sys.executable, "-m", "tierlm.cli", "list", "--model-dir", str(gemma_path.parent)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if NAME in line)
    assert "32768" in row and "5-bit g32 (+4/8-bit layers)" in row and "MiB" in row


def test_config_matches_the_published_one(gemma_gguf):
    meta, _ = gemma_gguf
    config = build_config(meta, {})
    for key, value in REFERENCE_ARGS.items():
        assert config[key] == pytest.approx(value) if isinstance(value, float) else config[key] == value, key


def _reference_greedy(model, tokenizer, prompt: str, continuation: list[int]) -> list[int]:
    """What `model` picks greedily after the prompt and each prefix of `continuation`,
    in one forward pass: equal to `continuation` exactly when `model`'s greedy
    output (`_greedy`) is `continuation` (each pick then sees the same prefix)."""
    ids = tokenizer.encode(prompt)
    logits = model(mx.array([ids + continuation[:-1]]))
    return logits[0, len(ids) - 1 :].argmax(-1).tolist()


def test_greedy_output_equals_the_reference(loaded_gemma, reference):
    model, tokenizer = loaded_gemma
    for prompt in ("Question: What is the capital of France?\nAnswer:", "def fibonacci(n):"):
        ours = _greedy(model, tokenizer, prompt, 24)
        assert len(ours) == 24 and _reference_greedy(reference, tokenizer, prompt, ours) == ours, prompt


def test_next_token_distribution_matches_the_reference(loaded_gemma, reference):
    """Over 300 tokens of prose, the imported weights (the GGUF's values but for
    float16 scales and Q6_K at 8 bits) barely move the distribution."""
    from pathlib import Path

    model, tokenizer = loaded_gemma
    text = (Path(__file__).parent.parent / "README.md").read_text()[:3000]
    ids = mx.array([tokenizer.encode(text)[:300]])

    def log_probs(m):
        logits = m(ids).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    ours, ref = log_probs(model), log_probs(reference)
    kl = (mx.exp(ref) * (ref - ours)).sum(-1).mean().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
    assert kl < 0.02 and agree > 0.9, (kl, agree)


def test_tokenizer_matches_transformers_gguf_reading(gemma_path, gemma_gguf):
    """transformers' own GGUF -> Gemma tokenizer, where this transformers has it."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from tokenizers import Tokenizer

    meta, _ = gemma_gguf
    keys = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: meta[f"tokenizer.{k}"] for k, name in keys.items() if f"tokenizer.{k}" in meta}
    theirs, _ = mapping.convert_gguf_tokenizer("gemma3", tokenizer_dict)
    ours = Tokenizer.from_file(str(gemma_path / "tokenizer.json"))
    for text in ["Hello world,  two  spaces\n\nand <start_of_turn> ünïcødé 🙂 12345", "   leading",
                 "def f(x):\n\treturn x**2  # note\n", "日本語のテキスト", "<b>bold</b> </footer>", "a\u200bb \x01"]:
        assert ours.encode(text, add_special_tokens=False).ids == \
            theirs.encode(text, add_special_tokens=False).ids, text
    assert ours.encode("Hi").ids[0] == 2  # <bos> first
    assert ours.decode(ours.encode(" two  spaces\n").ids, skip_special_tokens=True) == " two  spaces\n"


def test_server_answers_sensibly(gemma_server):
    """On the server test_agents uses too: greedy by default, and each answer ends
    with its first line (its settings); the requests ask for greedy anyway."""
    client = gemma_server.client(api_key=GEMMA_KEY)
    card = client.models.list().data[0]
    assert card.id == NAME and card.model_extra["max_model_len"] == 32768
    # a base (pre-trained) model: it answers in the shape of its prompt
    answer = client.completions.create(model=card.id, prompt="Question: What is the capital of France?\nAnswer:",
                                       max_tokens=8, temperature=0)
    assert "Paris" in answer.choices[0].text
    chat = client.chat.completions.create(model=card.id, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.content is not None


# ---- the dequantize / re-quantize path, on synthetic tensors ----------------


def _random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K blocks of random bytes, with sane fp16 super-block scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = np.stack([rng.uniform(0.001, 0.01, raw.shape[:2]), rng.uniform(0.001, 0.01, raw.shape[:2])], -1)
    raw[..., :4] = scales.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 4)  # d, dmin
    return raw.reshape(rows, -1)


def _tensor(raw: np.ndarray, type_name: str, shape) -> GGUFTensor:
    return GGUFTensor("blk.0.ffn_up.weight", type_name, tuple(shape), raw)


def test_q4_k_dequantizes_and_requantizes_to_8_bits():
    values = _tensor(_random_q4_k(64, 512), "Q4_K", (64, 512)).to_float32()
    assert values.shape == (64, 512) and np.isfinite(values).all() and values.std() > 0
    out = to_mlx("model.layers.0.mlp.up_proj.weight", values, 8)
    assert out["model.layers.0.mlp.up_proj.scales"].shape == (64, 512 // 32)
    back = np.array(mx.dequantize(*out.values(), group_size=32, bits=8).astype(mx.float32))
    _assert_within_a_step(back, values, 32, 255)


def _assert_within_a_step(back: np.ndarray, values: np.ndarray, group_size: int, levels: int) -> None:
    """Per group: within two quantization steps (half a step of rounding; MLX keeps
    0 exact, which can shift the grid by up to a step), plus what bfloat16 scales
    and biases round off."""
    groups = values.reshape(values.shape[0], -1, group_size)
    err = np.abs(back.reshape(groups.shape) - groups).max(-1)
    bound = 2 * np.ptp(groups, axis=-1) / levels + np.abs(groups).max(-1) * 2**-7 + 1e-7
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("bits", [4, 16])
def test_q4_k_to_4_bits_and_bfloat16(bits):
    values = _tensor(_random_q4_k(32, 256, seed=1), "Q4_K", (32, 256)).to_float32()
    out = to_mlx("model.embed_tokens.weight", values, bits)
    if bits == 16:
        assert list(out) == ["model.embed_tokens.weight"] and out["model.embed_tokens.weight"].dtype == mx.bfloat16
        back = np.array(out["model.embed_tokens.weight"].astype(mx.float32))
        assert np.allclose(back, values, rtol=2**-8, atol=1e-6)
    else:
        back = np.array(mx.dequantize(*out.values(), group_size=64, bits=4).astype(mx.float32))
        _assert_within_a_step(back, values, 64, 15)


def test_q8_0_from_ggufs_own_quantizer_round_trips():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    original = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    values = _tensor(quantize(original, GGMLQuantizationType.Q8_0), "Q8_0", (16, 128)).to_float32()
    assert np.abs(values - original).max() < 0.05
    back = np.array(mx.dequantize(*to_mlx("x.weight", values, 8).values(), group_size=32, bits=8).astype(mx.float32))
    assert np.abs(back - original).max() < 0.05


def test_norms_and_vectors_stay_float():
    out = to_mlx("model.norm.weight", np.linspace(-1, 1, 640, dtype=np.float32), 8)
    assert list(out) == ["model.norm.weight"] and out["model.norm.weight"].dtype == mx.bfloat16


def test_gemma_tokenizer_from_a_tiny_vocabulary():
    """The SentencePiece builder on a hand-made vocabulary: merges by position,
    byte fallback, spaces as ▁, control tokens whole."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>", "\n",
              *[f"<0x{b:02X}>" for b in range(256)], "▁", "a", "b", "ab", "▁ab", "  "]
    types = [3, 3, 3, 3, 3, 4, *[6] * 256, 1, 1, 1, 1, 1, 4]
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": [0.0] * len(tokens),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.add_space_prefix": False}
    tok = sentencepiece_bpe(meta, tokens, types)
    ids = tok.encode("ab ab<end_of_turn>\nc").ids
    c = tokens.index("<0x63>")
    assert ids == [2, tokens.index("ab"), tokens.index("▁ab"), 4, 5, c]
    assert tok.encode("a  b").ids[1:] == [tokens.index("a"), tokens.index("  "), tokens.index("b")]
    assert tok.decode(ids, skip_special_tokens=True) == "ab ab\nc"
