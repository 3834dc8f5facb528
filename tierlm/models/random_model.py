"""Random-weight models built from mlx-lm's own model classes, for tests and
benchmarks on machines without real weights. Not used by the server.

- `tiny_model(name)`: a tiny model in memory, one per cache type (`TINY`), with
  mlx-lm's own initialisation under a fixed seed;
- `make_random_model(preset, out, tokenizer_dir)`: a model folder (config.json,
  the tokenizer files of `tokenizer_dir`, random safetensors) that `tierlm serve`
  loads like any other; a preset is a name of `PRESETS` (real shapes, or tiny
  ones) or of `TINY`, or a config dict of one's own.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

TINY = {
    # plain attention: KVCache in every layer
    "llama": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 256,
        "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
    # sliding window: RotatingKVCache layers beside a global KVCache layer
    "gemma3_text": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 256, "sliding_window": 32, "sliding_window_pattern": 3, "query_pre_attn_scalar": 16,
        "rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "max_position_embeddings": 4096,
    },
    # hybrid: GatedDeltaNet layers (ArraysCache) between attention layers
    "qwen3_next": {
        "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [], "moe_intermediate_size": 32, "rms_norm_eps": 1e-6, "vocab_size": 256,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096, "head_dim": 16, "full_attention_interval": 2,
    },
}

LLAMA = {  # what a Llama folder's config.json says beside its shapes
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
LLAMA_3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
PRESETS = {
    # Llama-3.2-1B's shapes; vocab_size is the tokenizer's (SmolLM2's 49152, not 128256)
    "llama-1b": {
        **LLAMA,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA_3_ROPE,
        "tie_word_embeddings": True,
    },
    # Llama-3.1-8B's shapes
    "llama-8b": {
        **LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA_3_ROPE,
        "tie_word_embeddings": False,
    },
    "tiny": {**LLAMA, **TINY["llama"], "head_dim": 16},
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # where transformers 5's save_pretrained keeps the template
    "chat_template.json",
)


def build_model(config: dict):
    """mlx-lm's model class for `config["model_type"]`; its parameters stay lazy
    (shapes only) until evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def tiny_model(name: str, seed: int = 0, vocab_size: int | None = None):
    """A tiny model of architecture `name` (a key of TINY), in memory, weights
    evaluated: mlx-lm's own initialisation after mx.random.seed(seed)."""
    config = dict(TINY[name], **({"vocab_size": vocab_size} if vocab_size else {}))
    mx.random.seed(seed)
    model = build_model(config)
    mx.eval(model.parameters())
    return model


def random_weights(model, dtype: str = "bfloat16") -> dict:
    """A random value for each of `model`'s parameters: normal(0, 0.02), norms
    at one; one fixed key per parameter, so the same shapes give the same weights."""
    dt = getattr(mx, dtype)
    weights = {}
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(p.shape, dtype=dt)
        else:
            weights[name] = (mx.random.normal(p.shape, key=mx.random.key(i)) * 0.02).astype(dt)
    return weights


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Rows the embedding needs for every id the tokenizer (and its config) can give."""
    src = json.loads((tokenizer_dir / "config.json").read_text())
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = max(
        len(tok["model"]["vocab"]), 1 + max((t["id"] for t in tok.get("added_tokens", [])), default=0)
    )
    return max(vocab, src.get("vocab_size", 0))


def model_config(preset: str | dict, tokenizer_dir: Path, dtype: str = "bfloat16") -> dict:
    """The config.json of a random model with `preset`'s shapes and the vocabulary
    and special tokens of the model folder `tokenizer_dir`."""
    base = preset if isinstance(preset, dict) else PRESETS.get(preset) or TINY[preset]
    src = json.loads((tokenizer_dir / "config.json").read_text())
    return {
        **base,
        "vocab_size": tokenizer_vocab_size(tokenizer_dir),
        "torch_dtype": dtype,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
    }


def make_random_model(
    preset: str | dict, out: Path, tokenizer_dir: Path, dtype: str = "bfloat16", write_weights: bool = True
) -> Path:
    """config.json + the tokenizer files of `tokenizer_dir`; with `write_weights`,
    random safetensors too (`random_weights`), generated on the default device."""
    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(preset, tokenizer_dir, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    if not write_weights:
        return out
    weights = random_weights(build_model(config), dtype)
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
