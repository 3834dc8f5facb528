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
without building anything per shape. So does a hit's remainder of up to
`MAX_HIT_QUERIES` queries while its scores stay under `HIT_SCORES`: every
turn of an agent meets a new number of keys, and a new graph cost the turn
60-90 ms on an H100. A decode step's one query counts as such (queries after
cached keys) and runs as products too: at batch 32 on an H100 (random
Llama-3.2-1B shapes) MLX's own vector kernel decoded 2,524 tok/s over 2k-token
contexts and 755 over 8k, the products 5,400-6,100 and ~2,100. A step of up
to 4 sequences stays MLX's: there the vector kernel is the faster (one
sequence's step over 20k tokens 6.0 ms against 14.9). Longer prefill
chunks keep cuDNN, whose graph for a full chunk is built once and whose
kernels those chunks need.
The scores stay in the activations' type (the matmul's output: rounded there
either way); the softmax sums them in float32.

mlx-lm's batch cache hands attention an array mask even where its rows are
not padded (one long prompt, or prompts of one length), and cuDNN given a mask
as an array runs ~6x slower than given "causal": a 20k-token prompt of a 1B
model took 0.97 s of attention and matmuls against 0.17 s, on the H200. Such a
mask goes to cuDNN as "causal" (`_unpadded`).

Longer prefill chunks go to cuDNN with their queries, keys and values padded
by the same count of zeros to a multiple of `QUERY_BUCKET` queries: a graph
built for one prompt length then serves every length of its bucket (and the
warm-up builds each bucket's up to a chunk: engine.warmup). A length new to
the process cost its prefill ~40-110 ms more (an H100, 450 to 1,900 tokens:
105-154 ms, bucketed 26-86 ms), and a chat's prompts are nearly all of new
lengths. Under "causal" (aligned to the last key) the
padded keys come after every real query's last, so only padded queries see
them; an array mask hides them.

A hit's remainder (more queries than a verification feeds) runs where it
would run as products as one kernel instead (backends.cuda_hit_attention,
`HIT_KERNEL`): no scores in memory, one operation a layer, nothing built per
shape. As products (a model it cannot take: float32, heads wider than 128), it
sees its keys and values padded with zeros, hidden by the mask, to a multiple of `KEY_PAD`:
each turn of an agent has a context of a new length, and the products' first
run at a new shape cost more than the copy (docs/prefix-cache.md).

KV kept quantized in the batch (`batch_kv_bits`, engine.quantized_kv) runs
here too, whatever the queries. Up to 32 queries a sequence (a decode step, a
verification) go to one kernel that reads the KV at its bits
(backends.cuda_kv_attention), and a decode step's tokens from the batch
cache's 16-bit tail (`KV_TAIL` steps, quantized together); longer ones run
as the products below, the tail quantized first.
mlx-lm's quantized attention broadcasts each KV head over its query heads and
reads the KV up to the batch's end as a strided view, and MLX's CUDA
quantized products take neither ("no implementation for problem shape").
Here the query heads are folded into rows, and the products (and the
kernel) read the cache's whole buffers with the keys past its end masked (the
buffers grow 256 keys at a time: a new shape per 256 tokens, not per step);
the queries are multiplied by the factors the keys are kept divided by
(engine.key_scaling). The products' scores read the keys dequantized: on an
H100, MLX 0.32.4's quantized product of stacked matrices transposed (the
keys of every sequence and KV head, its Hopper kernel) returned scores off
by ~28 or NaN, and every greedy answer over 8-bit KV was end-of-text tokens;
the values' product (not transposed, another kernel) equals the dequantized
one exactly and stays quantized.

`install(model)` puts the wrapper into the mlx-lm modules `model` is built from,
only where MLX's default device is a CUDA GPU.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx import nn

from mlx_lm.models.cache import BatchKVCache

from tierlm.backends import cuda_hit_attention, cuda_kv_attention, mlx_lm_modules

MAX_QUERIES = 256  # queries a sequence feeds at most for attention to run as products here
SCORES_BYTES = 256 * 2**20  # scores of one piece of the queries at most, counted at 4 bytes (bfloat16 ones take half)
# A hit's remainder (more queries than a verification feeds) sees its keys
# padded to a multiple of this: each agent turn's context is a new length, and
# the products' first run at a new shape costs more than the copy (a 20k-token
# hot hit's engine time 95.5 -> 68.9 ms on an H100, docs/prefix-cache.md).
# A verification (2-17 queries a step) keeps its keys as they are: padding would
# copy them every step.
KEY_PAD = int(os.environ.get("TIERLM_KEY_PAD", "1024"))  # 0: no padding, for comparisons
PAD_FROM_QUERIES = 18  # engine.request.MAX_DRAFT_TOKENS + 2 (a test holds them together)
QUERY_BUCKET = int(os.environ.get("TIERLM_QUERY_BUCKET", "128"))  # 0: no padding, for comparisons
# A hit's remainder of more queries runs as products too while its scores
# (heads x queries x keys, all rows) stay under this: ~2-3 ms a layer on an
# H100, about what a new cuDNN graph costs a whole forward pass.
MAX_HIT_QUERIES = 1024
# A decode step of this many sequences or fewer stays MLX's (its vector kernel):
# the products win from 8 (_hit_remainder's figures).
FEW_DECODE_ROWS = 4
HIT_SCORES = int(os.environ.get("TIERLM_HIT_SCORES", str(384 * 2**20)))  # 0: cuDNN's, for comparisons
# A hit's remainder (from PAD_FROM_QUERIES queries, up to MAX_HIT_QUERIES) runs
# as one kernel on tensor cores (backends.cuda_hit_attention) that builds nothing
# per shape and keeps no scores in memory; "all": every call of few queries that
# would run as products (decode steps of more than FEW_DECODE_ROWS, verifications)
# too; "off": the products, for comparisons.
HIT_KERNEL = os.environ.get("TIERLM_HIT_KERNEL", "remainder")
# A decode step (or a verification) over KV kept quantized runs as one kernel
# that reads the KV at its bits (backends.cuda_kv_attention); off: the products.
KV_KERNEL = os.environ.get("TIERLM_KV_KERNEL") != "off"
# Decode steps a batch keeping KV quantized holds at 16 bits before quantizing
# them together (engine.quantized_kv): the kernel reads them as they are.
KV_TAIL = int(os.environ.get("TIERLM_KV_TAIL", "64"))  # 0: each step's token quantized at once


def kv_tail_tokens() -> int:
    """How many decode steps a batch cache of quantized KV may keep at 16 bits
    (engine.quantized_kv) for a model `install` wrapped: the kernel reads them."""
    return KV_TAIL if KV_KERNEL else 0


def install(model: nn.Module) -> list[str]:
    """Use `attention_products` for few queries, and for KV kept quantized in
    the batch, in `model`'s mlx-lm modules; the names replaced (module.function)."""
    if mx.default_device() == mx.cpu or not mx.cuda.is_available():
        return []  # Metal's attention kernels take few queries without per-shape builds
    few = os.environ.get("TIERLM_FEW_QUERY_ATTENTION") != "off"  # off: MLX's own, for comparisons
    replaced = []
    for module in mlx_lm_modules(model):
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None:
            continue
        if not hasattr(current, "original"):
            module.scaled_dot_product_attention = _wrap(current, few)
        replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.scaled_dot_product_attention")
    return replaced


def _wrap(original, few_queries: bool = True):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(mask, str) and mask != "causal" or sinks is not None:
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if hasattr(cache, "bits"):  # mlx-lm's own broadcasts KV heads, which CUDA's quantized products refuse
            return _over_quantized_kv(queries, cache, scale, mask)
        if few_queries and (1 < queries.shape[2] <= MAX_QUERIES or _hit_remainder(queries, keys)):
            if _hit_kernel(queries, keys, mask):
                if _causal_from_padding(cache, mask):
                    return cuda_hit_attention.attention(queries, keys, values, scale, "causal", cache.left_padding)
                return cuda_hit_attention.attention(queries, keys, values, scale, mask)
            return attention_products(queries, keys, values, scale, mask)
        if queries.shape[2] > 1 and _unpadded(cache, mask):
            mask = "causal"
        if queries.shape[2] > MAX_QUERIES and QUERY_BUCKET and queries.shape[2] % QUERY_BUCKET \
                and (isinstance(mask, mx.array) or mask == "causal"):
            return _bucketed(original, queries, keys, values, cache, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.original = original
    return scaled_dot_product_attention


def _over_quantized_kv(queries, cache, scale: float, mask) -> mx.array:
    """Attention over a cache whose KV is kept at 8 or 4 bits (engine.quantized_kv):
    the kernel for a few queries, reading the cache's 16-bit tail too and
    multiplying the keys by the factors they are kept divided by; otherwise
    the products over the whole buffers (the tail quantized first)."""
    key_scales = getattr(cache, "key_scales", None)  # keys kept divided by them (engine.key_scaling)
    length = queries.shape[2]
    if KV_KERNEL and cuda_kv_attention.usable(queries, cache.keys, cache.bits, cache.group_size, mask):
        tail = cache.unquantized_tail() if hasattr(cache, "unquantized_tail") else None
        return cuda_kv_attention.attention(queries, cache.keys, cache.values, scale, _mask_array(cache, mask, length),
                                           cache.bits, tail=tail,
                                           factors=None if key_scales is None else key_scales.factors)
    if hasattr(cache, "flush"):
        cache.flush()
    if key_scales is not None:
        queries = key_scales.queries(queries)
    keys, values, mask = _whole_buffers(cache, mask, length)
    return attention_products(queries, keys, values, scale, mask, quantized=(cache.group_size, cache.bits))


def _end(cache) -> int:
    """Where the cache's KV ends: a batch's end, or one sequence's length."""
    return getattr(cache, "_idx", getattr(cache, "offset", None))


def _mask_array(cache, mask, length: int) -> mx.array:
    """`mask` as booleans (B or 1, 1, L or 1, end) for the kernel: mlx-lm's batch
    mask already is (made once a step, shared by every layer); None or
    "causal" (one sequence) becomes one."""
    if isinstance(mask, mx.array):
        return mask if mask.ndim == 4 else mask.reshape(1, 1, *mask.shape[-2:])
    end = _end(cache)
    if mask is None:
        return mx.ones((1, 1, 1, end), dtype=mx.bool_)
    return causal_mask(length, end, end)[None, None]


def causal_mask(length: int, end: int, span: int) -> mx.array:
    """(length, span) booleans: query i, at position end - length + i, sees the
    keys up to itself ("causal" as mlx-lm means it, over `span` keys)."""
    return mx.arange(span)[None] <= mx.arange(end - length, end)[:, None]


def _hit_remainder(queries, keys) -> bool:
    """Queries after a cached prefix, few enough for the products to cost less
    than the cuDNN graph their shape would need: a hit's remainder meets a new
    number of keys every turn, and each graph took 60-90 ms to build. A
    decode step's one query a sequence too, where the batch has more than
    FEW_DECODE_ROWS: the products beat MLX's vector kernel at 8 sequences and
    more (an H100, random Llama-3.2-1B shapes, ms a step over 2k / 20k tokens:
    5.6 / 22.0 against 6.2 / 26.5 at 8, 9.3 / 42.7 against 12.7 / 90.3 at 32),
    and lose below (4.3 / 14.9 against 3.4 / 6.0 alone, 4.6 / 15.2 against
    4.4 / 9.2 at 2, 4.9 / 17.3 against 4.6 / 14.7 at 4: the last prompt token
    of a lone hot hit, and every step of a few long conversations)."""
    batch, heads, length, _ = queries.shape
    span = keys.shape[2]
    if length == 1 and batch <= FEW_DECODE_ROWS:
        return False
    return span > length and length <= MAX_HIT_QUERIES and batch * heads * length * span <= HIT_SCORES


def _hit_kernel(queries, keys, mask) -> bool:
    """Whether a call the products would take goes to backends.cuda_hit_attention
    instead (HIT_KERNEL): it took 0.42-0.76 ms a layer where the products took
    0.48-1.9 (40 to 256 queries over 20k keys, an H100, each evaluated alone),
    and builds nothing per shape where the products' matmuls took 5-13 ms the
    first time at one."""
    length = queries.shape[2]
    if HIT_KERNEL == "off" or keys.shape[2] <= length or HIT_KERNEL != "all" and length < PAD_FROM_QUERIES:
        return False
    return cuda_hit_attention.usable(queries, keys, mask)


def _bucketed(original, queries, keys, values, cache, scale: float, mask):
    """`original` attention with `extra` zero queries, keys and values after the
    real ones, making the queries a multiple of QUERY_BUCKET; the real queries'
    answer. "causal" hides the padded keys from every real query (query i sees
    the keys up to S - L + i, both S and L grown by `extra`); an array mask is
    grown to hide them, and to show the padded queries the padded keys alone."""
    length = queries.shape[2]
    extra = -length % QUERY_BUCKET
    queries, keys, values = (_zeros_after(a, extra) for a in (queries, keys, values))
    if isinstance(mask, mx.array):
        mask = _grown(mask, extra)
    return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=None)[:, :, :length]


def _zeros_after(a: mx.array, extra: int) -> mx.array:
    """`a` with `extra` zero positions after its last (axis 2)."""
    return mx.concatenate([a, mx.zeros((*a.shape[:2], extra, *a.shape[3:]), a.dtype)], axis=2)


def _grown(mask: mx.array, extra: int) -> mx.array:
    """An attention mask (boolean, or added to the scores) for `extra` more
    queries and keys: the real queries see no new key, the new queries only
    the new keys (a mask of one row, for every query, stays one)."""
    hidden, shown = (False, True) if mask.dtype == mx.bool_ else (-mx.inf, 0.0)
    *lead, rows, cols = mask.shape
    mask = mx.concatenate([mask, mx.full((*lead, rows, extra), hidden, mask.dtype)], axis=-1)
    if rows == 1:
        return mask
    new_rows = mx.concatenate([mx.full((*lead, extra, cols), hidden, mask.dtype),
                               mx.full((*lead, extra, extra), shown, mask.dtype)], axis=-1)
    return mx.concatenate([mask, new_rows], axis=-2)


def _unpadded(cache, mask) -> bool:
    """`mask` says no more than "causal": it is mlx-lm's own batch cache's (not
    a subclass's: those keep rows of their own ends) and no row is padded on
    the left, so every row's keys run from 0 to the batch's end. (Its mask
    leaves a right-padded row's last queries unmasked, as "causal" does: they
    are thrown away.) The padding is read back, a few bytes a layer a chunk."""
    return _causal_from_padding(cache, mask) and not any(cache.left_padding.tolist())


def _causal_from_padding(cache, mask) -> bool:
    """`mask` is mlx-lm's own batch cache's (not a subclass's: those keep rows
    of their own ends): "causal" from each row's left padding, which the hit
    kernel computes instead of reading the mask a key at a time."""
    return isinstance(mask, mx.array) and type(cache) is BatchKVCache


def _whole_buffers(cache, mask, length: int):
    """A quantized KV cache's whole buffers, and the mask that hides the
    keys past its end: MLX's CUDA quantized products take no strided view (the
    batch's KV up to its end is one), and its buffers grow 256 keys at a time,
    so the products see a new shape every 256 tokens, not every step."""
    end = _end(cache)
    span = cache.keys[0].shape[2]
    if span == end:
        return cache.keys, cache.values, mask
    if mask is None or isinstance(mask, str):
        causal = mask is not None
        mask = mx.arange(span)[None] < end
        if causal:
            mask = mask & causal_mask(length, end, span)
    else:
        hidden = mx.zeros((*mask.shape[:-1], span - end), dtype=mask.dtype) if mask.dtype == mx.bool_ \
            else mx.full((*mask.shape[:-1], span - end), -mx.inf, dtype=mask.dtype)
        mask = mx.concatenate([mask, hidden], axis=-1)
    return cache.keys, cache.values, mask


def attention_products(queries, keys, values, scale: float, mask, max_scores_bytes: int = SCORES_BYTES,
                       quantized: tuple[int, int] | None = None) -> mx.array:
    """softmax(q kᵀ · scale + mask) v for (B, heads, L, D) queries and
    (B, kv_heads, S, D) keys and values, the softmax in float32. `mask`: None,
    "causal" (query i at position S - L + i), or a boolean or additive array.
    The queries go in pieces whose scores take `max_scores_bytes` at most (a
    long context's: 256 queries over 60k keys would hold 2 GB of them).
    `quantized`: (group size, bits) of keys and values given as MLX's
    (values, scales, biases) triples (engine.quantized_kv)."""
    batch, heads, length, _ = queries.shape
    span = (keys[0] if quantized else keys).shape[2]
    if isinstance(mask, str):
        mask = causal_mask(length, span, span)
    if not quantized and length >= PAD_FROM_QUERIES and KEY_PAD and span % KEY_PAD:
        keys, values, mask = _padded(keys, values, mask, KEY_PAD - span % KEY_PAD)
        span = keys.shape[2]
    rows = max(1, max_scores_bytes // (4 * batch * heads * span))
    if length <= rows:
        return _products(queries, keys, values, scale, mask, quantized)
    pieces = []
    for start in range(0, length, rows):
        piece = slice(start, min(length, start + rows))
        rows_mask = mask if mask is None or mask.shape[-2] == 1 else mask[..., piece, :]
        pieces.append(_products(queries[:, :, piece], keys, values, scale, rows_mask, quantized))
    return mx.concatenate(pieces, axis=2)


def _padded(keys, values, mask, extra: int):
    """Keys and values with `extra` zero positions after their last, and the
    mask that hides them (None: every real key visible)."""
    keys, values = _zeros_after(keys, extra), _zeros_after(values, extra)
    if mask is None:
        return keys, values, mx.arange(keys.shape[2]) < keys.shape[2] - extra
    hidden = mx.zeros((*mask.shape[:-1], extra), mx.bool_) if mask.dtype == mx.bool_ \
        else mx.full((*mask.shape[:-1], extra), -mx.inf, mask.dtype)
    return keys, values, mx.concatenate([mask, hidden], axis=-1)


def _products(queries, keys, values, scale: float, mask, quantized: tuple[int, int] | None = None) -> mx.array:
    batch, heads, length, _ = queries.shape
    kv_heads, span = (keys[0] if quantized else keys).shape[1:3]
    group = heads // kv_heads  # query heads h*group .. h*group+group-1 read KV head h
    grouped = (queries * scale).reshape(batch, kv_heads, group * length, -1)
    scores = _matmul(grouped, keys, quantized, transpose=True).reshape(batch, heads, length, span)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask.astype(scores.dtype)
    # the softmax sums in float32 (precise) but reads and writes the scores' own
    # type: a long context's scores are most of the bytes these products move
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = _matmul(weights.reshape(batch, kv_heads, group * length, span), values, quantized, transpose=False)
    return out.reshape(batch, heads, length, -1)


def _matmul(a: mx.array, b, quantized: tuple[int, int] | None, transpose: bool) -> mx.array:
    """a @ b (bᵀ where `transpose`), b a quantized triple where `quantized`."""
    if quantized is None:
        return a @ (b.swapaxes(-1, -2) if transpose else b)
    group_size, bits = quantized
    if transpose:  # MLX 0.32's CUDA product of stacked quantized matrices, transposed, is wrong (see the docstring)
        return a @ mx.dequantize(*b, group_size=group_size, bits=bits).swapaxes(-1, -2)
    return mx.quantized_matmul(a, *b, transpose=False, group_size=group_size, bits=bits)
