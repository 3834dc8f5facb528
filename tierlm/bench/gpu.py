"""For machines without real weights: random-weight model folders with the real
shapes of known models, and the decode roofline (weight bytes read per decode
step over the measured device copy bandwidth)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

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
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def model_config(preset: str, tokenizer_dir: Path, dtype: str = "bfloat16") -> dict:
    src = json.loads((tokenizer_dir / "config.json").read_text())
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = max(
        len(tok["model"]["vocab"]), 1 + max((t["id"] for t in tok.get("added_tokens", [])), default=0)
    )
    vocab = max(vocab, src.get("vocab_size", 0))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        **PRESETS[preset],
    }


def make_random_model(
    preset: str, out: Path, tokenizer_dir: Path, dtype: str = "bfloat16", write_weights: bool = True
) -> Path:
    """config.json + the tokenizer files; with `write_weights`, random safetensors
    too (normal(0, 0.02), norms at one), generated on the default device."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    config = model_config(preset, tokenizer_dir, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    if not write_weights:
        return out
    model = llama.Model(llama.ModelArgs.from_dict(config))  # parameters stay lazy: shapes only
    dt = getattr(mx, dtype)
    weights = {}
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(p.shape, dtype=dt)
        else:
            weights[name] = (mx.random.normal(p.shape, key=mx.random.key(i)) * 0.02).astype(dt)
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def copy_bandwidth(gib: float = 2.0, iters: int = 10) -> float:
    """Bytes read + written per second by an elementwise copy of `gib` GiB."""
    import mlx.core as mx

    n = int(gib * 2**30) // 2
    x = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(x)
    for _ in range(3):
        mx.eval(x + 1)
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(iters):
        y = x + 1
        mx.eval(y)
    mx.synchronize()
    elapsed = time.perf_counter() - tic
    return 2 * x.nbytes * iters / elapsed


def roofline(model_path: str, batches: list[int], context: int) -> dict:
    """The decode step reads every weight once, plus each sequence's KV; at the
    copy bandwidth that bounds the step time and so the tokens/s of a batch."""
    import mlx.core as mx

    from tierlm.engine.memory_guard import profile_model
    from tierlm.models.loader import load_model

    model, _ = load_model(model_path)
    profile = profile_model(model)
    bw = copy_bandwidth()
    rows = []
    for b in batches:
        step_bytes = profile.weight_bytes + b * context * profile.kv_bytes_per_token
        step_s = step_bytes / bw
        rows.append(
            {
                "batch": b,
                "step_bytes": step_bytes,
                "min_step_s": step_s,
                "max_tok_s": b / step_s,
                "max_tok_s_weights_only": b * bw / profile.weight_bytes,
            }
        )
    return {
        "model": str(model_path),
        "device": str(mx.default_device()),
        "copy_bytes_s": bw,
        "weight_bytes": profile.weight_bytes,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "context": context,
        "rows": rows,
    }
