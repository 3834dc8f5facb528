"""Tiny random-weight models built from mlx-lm's own model classes, one per cache type."""

from __future__ import annotations

import importlib

import mlx.core as mx

CONFIGS = {
    # plain attention: KVCache in every layer
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    # sliding window: RotatingKVCache layers beside a global KVCache layer
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=256, sliding_window=32, sliding_window_pattern=3, query_pre_attn_scalar=16,
        rope_theta=10000.0, rope_local_base_freq=10000.0, max_position_embeddings=4096,
    ),
    # hybrid: GatedDeltaNet layers (ArraysCache) between attention layers
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=256,
        num_key_value_heads=2, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=4096, head_dim=16, full_attention_interval=2,
    ),
}


def tiny_model(name: str, seed: int = 0, vocab_size: int | None = None):
    config = dict(CONFIGS[name], **({"vocab_size": vocab_size} if vocab_size else {}))
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model
