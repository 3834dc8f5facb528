"""Per-channel key scales for KV kept at 8 or 4 bits (SmoothAttention).

A few channels of a model's keys are many times larger than the rest (Qwen2's
key projection has a bias that puts some at 10-50x the median channel). MLX's
quantization gives a group of 64 channels one step, sized by its largest, so
the small channels, most of q·k, keep a few levels of it: at 8 bits Qwen2.5-
Coder-0.5B kept 5 of 16 greedy answers. Each key channel is divided by a
factor before it is quantized, and the queries' same channel is multiplied by
it in attention, which leaves q·k as it was (QServe's SmoothAttention). The
cache tiers' quantized blocks divide and multiply back by the same factors
(cache/kv_quant.py).

The factors, per layer and KV head: each channel's largest |k| over a
calibration prompt (source code), over the head's median channel's, at least
1; the two channels RoPE rotates together (i and i + D/2) share the larger, as
a position moves magnitude between them. Measured on Qwen2.5-Coder-0.5B at 8
bits (bench_lab.kv_quality, 16 prompts): 14 of 16 greedy answers kept (bfloat16
KV keeps 14), against 5 unscaled; factors rounded to powers of two kept 12,
factors from random tokens 10.

Attention reaches them in one of two places: mlx-lm's quantized attention
(MLX's CPU and Metal backends), which `install` wraps once, keyed on the keys
a scaled cache hands it (`ScaledKeys`); and tierlm's CUDA attention
(backends.gpu), which reads the cache's `key_scales`.
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from tierlm.cache.codecs import plain_kv

CALIBRATION_TOKENS = 1024


class KeyScales:
    """One layer's factors: keys are kept divided by them, queries multiplied."""

    def __init__(self, factors: mx.array):
        install()  # mlx-lm's quantized attention must multiply the queries
        self.factors = factors  # (1, kv_heads, 1, head_dim), float32, >= 1
        self.inverse = 1.0 / factors
        # Computed now: a lazy array is tied to the stream of the thread that
        # made it, and the factors outlive that engine (`calibrate` keeps them
        # for the next engine on the model, which runs on another worker).
        mx.eval(self.factors, self.inverse)
        self._by_heads: dict[int, mx.array] = {}  # the factors repeated over each KV head's query heads

    def divide(self, keys: mx.array) -> mx.array:
        return keys * self.inverse.astype(keys.dtype)

    def multiply(self, keys: mx.array) -> mx.array:
        return keys * self.factors.astype(keys.dtype)

    def queries(self, queries: mx.array) -> mx.array:
        """`queries` (batch, heads, length, head_dim) with each KV head's factors
        on the query heads it serves."""
        return queries * self._for_heads(queries.shape[1]).astype(queries.dtype)

    def _for_heads(self, heads: int) -> mx.array:
        if heads not in self._by_heads:
            repeated = mx.repeat(self.factors, heads // self.factors.shape[1], axis=1)
            mx.eval(repeated)  # as in __init__: another engine's thread may read it
            self._by_heads[heads] = repeated
        return self._by_heads[heads]


class ScaledKeys(tuple):
    """A quantized (values, scales, biases) triple of keys kept divided by
    `key_scales`: what a scaled batch cache hands attention."""

    key_scales: KeyScales


def scaled_keys(triple, key_scales: KeyScales | None):
    if key_scales is None:
        return triple
    keys = ScaledKeys(triple)
    keys.key_scales = key_scales
    return keys


def calibrate(model, tokens: list[int]) -> list[KeyScales | None]:
    """Each layer's factors from `tokens` run through `model` (None for a layer
    whose cache is not plain attention KV); kept while the model lives, so an
    engine started again on a loaded model does not run the prompt again."""
    key = (id(model), hash(tuple(tokens)))
    if key not in _calibrated:
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        _calibrated[key] = [factors_of(c.keys[..., : c.offset, :]) if plain_kv(c) and c.keys is not None
                            else None for c in cache]
        weakref.finalize(model, _calibrated.pop, key, None)
    return _calibrated[key]


_calibrated: dict[tuple[int, int], list] = {}  # (id(model), hash of the tokens) -> its factors


def factors_of(keys: mx.array) -> KeyScales:
    """The factors for keys like `keys` (batch, kv_heads, tokens, head_dim)."""
    peak = mx.abs(keys.astype(mx.float32)).max(axis=2, keepdims=True)  # (1, kv_heads, 1, head_dim)
    half = peak.shape[-1] // 2
    pair = mx.maximum(peak[..., :half], peak[..., half:])  # RoPE's pairs (i, i + D/2)
    peak = mx.concatenate([pair, pair], axis=-1)
    median = mx.sort(peak, axis=-1)[..., peak.shape[-1] // 2 :][..., :1]
    return KeyScales(mx.maximum(peak / mx.maximum(median, 1e-6), 1.0))


def calibration_tokens(tokenizer, context: int | None = None) -> list[int]:
    """CALIBRATION_TOKENS tokens of Python source (what agents send most), or
    the model's `context` where shorter."""
    ids = tokenizer.encode(_calibration_text())
    while len(ids) < CALIBRATION_TOKENS:
        ids = ids + ids
    return ids[: min(CALIBRATION_TOKENS, context or CALIBRATION_TOKENS)]


@lru_cache(maxsize=1)
def _calibration_text() -> str:
    import inspect
    import json.decoder
    import textwrap

    return inspect.getsource(textwrap) + inspect.getsource(json.decoder)


def install() -> None:
    """mlx-lm's quantized attention multiplies the queries by the factors of
    keys that carry them (once per process; other keys pass as they were)."""
    if getattr(base.quantized_scaled_dot_product_attention, "scales_queries", False):
        return
    original = base.quantized_scaled_dot_product_attention

    def quantized_scaled_dot_product_attention(queries, q_keys, q_values, *args, **kwargs):
        if isinstance(q_keys, ScaledKeys):
            queries = q_keys.key_scales.queries(queries)
        return original(queries, q_keys, q_values, *args, **kwargs)

    quantized_scaled_dot_product_attention.scales_queries = True
    base.quantized_scaled_dot_product_attention = quantized_scaled_dot_product_attention
