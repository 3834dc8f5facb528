"""tierlm.backends.gpu: attention of a few queries as two products (on a CUDA
GPU in place of cuDNN's per-shape graphs). The arithmetic is checked here, on
the CPU, against MLX's own attention; on a CPU (or Metal) nothing is installed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache

from tierlm.backends import gpu
from tierlm.engine.quantized_kv import QuantizedSlot
from tierlm.models.random_model import tiny_model

ON_CUDA = mx.default_device() != mx.cpu and mx.cuda.is_available()


@pytest.mark.parametrize("pieces", [1, 3], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("mask", ["none", "causal", "boolean", "additive", "one-row"])
def test_attention_products_equal_mlxs_attention(mask, pieces):
    key = mx.random.key(3)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
               for i, shape in enumerate([(2, 8, 5, 64), (2, 2, 40, 64), (2, 2, 40, 64)]))
    masks = {"none": None, "causal": "causal",
             "boolean": mx.random.uniform(shape=(2, 1, 5, 40), key=key) > 0.3,
             "additive": mx.random.normal((2, 1, 5, 40), key=key),
             "one-row": mx.random.normal((2, 1, 1, 40), key=key)}  # the same for every query
    # scores of 2 queries (of 2 batches x 8 heads x 40 keys) a piece: 5 queries in 3 pieces
    scores_bytes = 4 * 2 * 8 * 40 * (5 if pieces == 1 else 2)
    got = gpu.attention_products(q, k, v, 0.125, masks[mask], max_scores_bytes=scores_bytes)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=masks[mask])
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("mask", ["none", "causal", "boolean", "additive"])
def test_a_remainders_keys_are_padded_and_the_padding_hidden(mask, monkeypatch):
    """From PAD_FROM_QUERIES queries (a hit's remainder) the keys are padded to a
    multiple of KEY_PAD with zeros the mask hides: MLX's attention's answer
    still. A verification's queries (up to MAX_DRAFT_TOKENS + 1) are never
    padded: their keys would be copied every step."""
    from tierlm.engine.request import MAX_DRAFT_TOKENS

    assert gpu.PAD_FROM_QUERIES == MAX_DRAFT_TOKENS + 2
    monkeypatch.setattr(gpu, "KEY_PAD", 32)
    key = mx.random.key(4)
    length, span = gpu.PAD_FROM_QUERIES, 50  # padded to 64
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
               for i, shape in enumerate([(2, 8, length, 64), (2, 2, span, 64), (2, 2, span, 64)]))
    masks = {"none": None, "causal": "causal",
             "boolean": mx.random.uniform(shape=(2, 1, length, span), key=key) > 0.3,
             "additive": mx.random.normal((2, 1, length, span), key=key)}
    shapes = []
    products = gpu._products
    monkeypatch.setattr(gpu, "_products", lambda q, k, *rest: shapes.append(k.shape[2]) or products(q, k, *rest))
    got = gpu.attention_products(q, k, v, 0.125, masks[mask])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=masks[mask])
    assert shapes == [64] and mx.allclose(got, want, atol=1e-5).item()
    gpu.attention_products(q[:, :, :MAX_DRAFT_TOKENS + 1], k, v, 0.125, None)
    assert shapes[-1] == span


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask", ["none", "causal", "boolean"])
def test_attention_products_over_quantized_kv_equal_mlx_lms(mask, queries):
    """KV kept at 8 bits in the batch (engine.quantized_kv): the same as mlx-lm's
    quantized attention, which broadcasts KV heads where MLX's CUDA quantized
    products take none (here the query heads are folded into rows); 37 keys, a
    length that leaves CUDA's rows unaligned."""
    key = mx.random.key(5)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
               for i, shape in enumerate([(2, 8, queries, 64), (2, 2, 37, 64), (2, 2, 37, 64)]))
    masks = {"none": None, "causal": "causal", "boolean": mx.random.uniform(shape=(2, 1, queries, 37), key=key) > 0.3}
    qk, qv = (mx.quantize(a, group_size=64, bits=8) for a in (k, v))
    got = gpu.attention_products(q, qk, qv, 0.125, masks[mask], quantized=(64, 8), max_scores_bytes=4 * 2 * 8 * 37 * 2)
    # after: mlx-lm's scales its queries in place
    want = quantized_scaled_dot_product_attention(q, qk, qv, scale=0.125, mask=masks[mask], group_size=64, bits=8)
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("queries, tail", [(1, 0), (3, 0), (1, 4)], ids=["decode", "three-queries", "decode-tail"])
def test_a_quantized_batch_is_read_as_its_whole_buffers_with_the_keys_past_its_end_hidden(queries, tail):
    """CUDA's quantized products take no strided view, so the wrapper reads the
    batch cache's whole buffers (256 keys here, 43 of them written; rows of
    two lengths) and masks the rest: the same as mlx-lm's attention over the
    written keys. A decode step's token held in the cache's 16-bit tail (read
    by the kernel on a CUDA GPU) is quantized first where the kernel does not run."""
    key = mx.random.key(7)
    cache = QuantizedSlot.merge([QuantizedSlot.of(None, 8), QuantizedSlot.of(None, 8)])
    cache.prepare(left_padding=[0, 4])
    cache.update_and_fetch(*(mx.random.normal((2, 2, 40, 64), key=mx.random.split(key, 2)[i]) for i in range(2)))
    cache.tail_capacity = tail
    mask = cache.make_mask(queries)
    q = mx.random.normal((2, 8, queries, 64), key=key)
    keys, values = cache.update_and_fetch(*(mx.random.normal((2, 2, queries, 64), key=mx.random.key(i))
                                            for i in range(2)))
    assert cache.tail_length == (1 if tail else 0)
    got = gpu._wrap(None)(q, keys, values, cache, scale=0.125, mask=mask)
    assert cache.tail_length == 0 or ON_CUDA
    keys, values = cache.keys_and_values()
    assert cache.keys[0].shape[2] == 256 and keys[0].shape[2] == 40 + queries
    # after: mlx-lm's scales its queries in place
    want = quantized_scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask, group_size=64, bits=8)
    assert mx.allclose(got, want, atol=1e-5 if not ON_CUDA else 0.02).item()


def test_nothing_is_installed_without_a_cuda_gpu():
    with mx.stream(mx.cpu):
        assert gpu.install(tiny_model("llama")) == []


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_a_batch_prefill_without_left_padding_goes_to_mlx_as_causal(padding):
    """mlx-lm's batch cache masks a prefill with an array even where no row is
    padded, and cuDNN runs an array mask ~6x slower than "causal": the wrapper
    passes "causal" where that says the same (rows padded on the right only
    too: their last queries are thrown away), the array where rows are padded
    on the left. The answer is MLX's over mlx-lm's own mask either way (this
    fails if mlx-lm's mask comes to say more)."""
    key = mx.random.key(11)
    cache = BatchKVCache([0, 3] if padding == "left" else [0, 0])
    cache.update_and_fetch(*(mx.random.normal((2, 2, 20, 64), key=mx.random.split(key, 2)[i]) for i in range(2)))
    if padding == "right":
        cache.prepare(lengths=[5, 3], right_padding=[0, 2])
    mask = cache.make_mask(5)
    q = mx.random.normal((2, 8, 5, 64), key=key)
    keys, values = cache.update_and_fetch(*(mx.random.normal((2, 2, 5, 64), key=mx.random.key(i)) for i in range(2)))
    given = []

    def mlx(queries, keys, values, cache, scale, mask, sinks=None):
        given.append(mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    got = gpu._wrap(mlx, few_queries=False)(q, keys, values, cache, scale=0.125, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    rows = slice(0, 3)  # a right-padded row's padding queries are thrown away
    assert mx.allclose(got[:, :, rows], want[:, :, rows], atol=1e-5).item()
    assert isinstance(given[0], mx.array) if padding == "left" else given[0] == "causal"


@pytest.mark.parametrize("mask", ["causal", "boolean", "additive", "one-row"])
@pytest.mark.parametrize("length, span", [(300, 300), (300, 2348)], ids=["first-chunk", "later-chunk"])
def test_a_long_chunk_is_padded_to_its_bucket_and_gets_mlxs_answer(mask, length, span, monkeypatch):
    """More than MAX_QUERIES queries (cuDNN's, on a GPU) go padded with zeros to
    a multiple of QUERY_BUCKET, keys and values by as many: MLX's attention
    over the real ones still, with "causal" (aligned to the last key) and with
    array masks. (A later chunk's queries this few would run as products:
    test_a_hits_remainder_runs_as_products_while_its_scores_are_few.)"""
    monkeypatch.setattr(gpu, "QUERY_BUCKET", 128)
    monkeypatch.setattr(gpu, "HIT_SCORES", 0)
    key = mx.random.key(13)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
               for i, shape in enumerate([(1, 4, length, 64), (1, 2, span, 64), (1, 2, span, 64)]))
    causal = mx.arange(span)[None] <= mx.arange(span - length, span)[:, None]
    masks = {"causal": "causal",
             "boolean": causal & (mx.random.uniform(shape=(1, 1, length, span), key=key) > 0.3),
             "additive": mx.where(causal, mx.random.normal((1, 1, length, span), key=key), -mx.inf),
             "one-row": mx.random.normal((1, 1, 1, span), key=key)}
    given = []

    def mlx(queries, keys, values, cache, scale, mask, sinks=None):
        given.append(queries.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    got = gpu._wrap(mlx)(q, k, v, None, scale=0.125, mask=masks[mask])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=masks[mask])
    assert given == [384] and got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("batch, length, span, products", [(1, 300, 2348, True), (1, 1100, 3148, False),
                                                           (1, 300, 300, False), (1, 600, 200_000, False),
                                                           (8, 1, 2048, True), (1, 1, 2048, False),
                                                           (4, 1, 2048, False)],
                         ids=["hit", "too-many-queries", "first-chunk", "too-many-scores", "decode-step",
                              "lone-decode-step", "few-decode-step"])
def test_a_hits_remainder_runs_as_products_while_its_scores_are_few(batch, length, span, products):
    """Queries after cached keys (a hit's remainder: a new number of keys every
    turn, so a new cuDNN graph on a GPU) run as products up to MAX_HIT_QUERIES
    and HIT_SCORES, with MLX's answer; a first chunk, and more, stay MLX's. A
    decode step's one query a sequence runs as products too (2.4-4x MLX's
    vector kernel's tok/s at batch 32 on an H100), but a step of up to 4
    sequences stays MLX's (its vector kernel took a lone sequence's step over
    20k tokens in 6.0 ms, the products in 14.9)."""
    key = mx.random.key(17)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
               for i, shape in enumerate([(batch, 4, length, 64), (batch, 2, span, 64), (batch, 2, span, 64)]))
    given = []

    def mlx(queries, keys, values, cache, scale, mask, sinks=None):
        given.append(queries.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    got = gpu._wrap(mlx)(q, k, v, None, scale=0.125, mask="causal")  # lazy: MLX's runs nothing here
    assert (given == []) == products
    if products:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        assert mx.allclose(got, want, atol=1e-5).item()
