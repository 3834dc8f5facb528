"""What tierlm adds to a model on a CUDA GPU: attention of a few queries as two products.

MLX's CUDA backend hands attention with more than one query to cuDNN, whose
graphs are built once per shape (of the queries, the keys and the mask) and then
kept in a small cache. Decoding feeds one query a sequence and never gets
there; verifying drafts (speculative decoding) feeds each sequence 2 to 17
against keys one step longer than the step before: a shape cuDNN has not seen,
every step, so every step waited for a graph to be built. So did the prefill
of what a prefix-cache hit left (the last part block and the new message: a
few hundred queries over a long context, a new shape every turn): a 20k-token
hot hit's prefill took 143 ms through cuDNN, 90 ms here, on the H200.
Attention for up to `MAX_QUERIES` queries runs here instead as
softmax(q kᵀ · scale + mask) v, two matmuls around a softmax, which MLX runs
without building anything per shape. Longer prefill chunks keep cuDNN, whose
graph for a full chunk is built once and whose kernels those chunks need.

`install(model)` puts the wrapper into the mlx-lm modules `model` is built from,
only where MLX's default device is a CUDA GPU.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx import nn

from tierlm.backends import mlx_lm_modules

MAX_QUERIES = 256  # queries a sequence feeds at most for attention to run as products here
SCORES_BYTES = 256 * 2**20  # float32 scores of one piece of the queries at most


def install(model: nn.Module) -> list[str]:
    """Use `attention_products` for few queries in `model`'s mlx-lm modules;
    the names replaced (module.function)."""
    if mx.default_device() == mx.cpu or not mx.cuda.is_available():
        return []  # Metal's attention kernels take few queries without per-shape builds
    if os.environ.get("TIERLM_FEW_QUERY_ATTENTION") == "off":  # MLX's own, for comparisons
        return []
    replaced = []
    for module in mlx_lm_modules(model):
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None:
            continue
        if not hasattr(current, "original"):
            module.scaled_dot_product_attention = _wrap(current)
        replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.scaled_dot_product_attention")
    return replaced


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        few = 1 < queries.shape[2] <= MAX_QUERIES
        if not few or sinks is not None or hasattr(cache, "bits") or (isinstance(mask, str) and mask != "causal"):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return attention_products(queries, keys, values, scale, mask)

    scaled_dot_product_attention.original = original
    return scaled_dot_product_attention


def attention_products(queries, keys, values, scale: float, mask, max_scores_bytes: int = SCORES_BYTES) -> mx.array:
    """softmax(q kᵀ · scale + mask) v for (B, heads, L, D) queries and
    (B, kv_heads, S, D) keys and values, the softmax in float32. `mask`: None,
    "causal" (query i at position S - L + i), or a boolean or additive array.
    The queries go in pieces whose scores take `max_scores_bytes` at most (a
    long context's: 256 queries over 60k keys would hold 2 GB of them)."""
    batch, heads, length, _ = queries.shape
    span = keys.shape[2]
    if isinstance(mask, str):
        mask = mx.arange(span)[None] <= mx.arange(span - length, span)[:, None]
    rows = max(1, max_scores_bytes // (4 * batch * heads * span))
    if length <= rows:
        return _products(queries, keys, values, scale, mask)
    pieces = []
    for start in range(0, length, rows):
        piece = slice(start, min(length, start + rows))
        rows_mask = mask if mask is None or mask.shape[-2] == 1 else mask[..., piece, :]
        pieces.append(_products(queries[:, :, piece], keys, values, scale, rows_mask))
    return mx.concatenate(pieces, axis=2)


def _products(queries, keys, values, scale: float, mask) -> mx.array:
    batch, heads, length, _ = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads  # query heads h*group .. h*group+group-1 read KV head h
    grouped = (queries * scale).reshape(batch, kv_heads, group * length, -1)
    scores = (grouped @ keys.swapaxes(-1, -2)).reshape(batch, heads, length, span).astype(mx.float32)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)
    out = weights.reshape(batch, kv_heads, group * length, span) @ values
    return out.reshape(batch, heads, length, -1)
