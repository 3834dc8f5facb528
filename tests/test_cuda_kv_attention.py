"""tierlm.backends.cuda_kv_attention: attention of a few queries over KV kept
at 8 or 4 bits, one CUDA kernel. The kernel runs only on a CUDA GPU (its test
is skipped elsewhere, saying so); what surrounds it (the mask it reads, how
the keys are split, how the splits' partial sums are joined) is checked here
on any device."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from tierlm.backends import cuda_kv_attention as kernel
from tierlm.backends import gpu

ON_CUDA = mx.default_device() != mx.cpu and mx.cuda.is_available()


def _partials(scores: mx.array, values: mx.array, bounds: list[tuple[int, int]]):
    """What the kernel writes per split: each span's highest score, its sum of
    exp(score - highest) and its weighted values (a span of no key: -inf, 0, 0)."""
    tops, totals, accs = [], [], []
    for a, b in bounds:
        if a == b:
            tops.append(mx.full(scores.shape[:-1], -mx.inf))
            totals.append(mx.zeros(scores.shape[:-1]))
            accs.append(mx.zeros((*scores.shape[:-1], values.shape[-1])))
            continue
        top = scores[..., a:b].max(axis=-1)
        weights = mx.exp(scores[..., a:b] - top[..., None])
        tops.append(top)
        totals.append(weights.sum(axis=-1))
        accs.append(weights @ values[..., a:b, :])
    return mx.stack(tops, axis=-1), mx.stack(totals, axis=-1), mx.stack(accs, axis=-2)


@pytest.mark.parametrize("bounds", [[(0, 12)], [(0, 4), (4, 8), (8, 12)], [(0, 5), (5, 12), (12, 12)]],
                         ids=["one-split", "three-splits", "a-split-of-no-key"])
def test_the_splits_partial_sums_join_into_the_whole_softmax(bounds):
    key = mx.random.key(1)
    scores = 4 * mx.random.normal((2, 3, 1, 12), key=key)
    values = mx.random.normal((2, 3, 12, 8), key=mx.random.split(key)[1])
    want = mx.softmax(scores, axis=-1) @ values
    got = kernel._joined(*_partials(scores, values, bounds))
    assert mx.allclose(got, want, atol=1e-5).item()


def test_the_kernel_is_given_a_mask_of_booleans_of_each_row_and_query():
    """mlx-lm's batch mask goes as it is (made once a step, for every layer);
    one sequence's None or "causal" becomes a mask up to its end."""
    one = SimpleNamespace(offset=5)
    causal = gpu._mask_array(one, "causal", 3)
    assert causal.shape == (1, 1, 3, 5)
    assert causal[0, 0].tolist() == [[True, True, True, False, False],
                                      [True, True, True, True, False],
                                      [True, True, True, True, True]]
    assert gpu._mask_array(SimpleNamespace(_idx=4), None, 1).shape == (1, 1, 1, 4)
    assert gpu._mask_array(one, None, 1).all().item()
    padded = mx.array([[True, True, False], [False, True, True]])[:, None, None, :]  # (B, 1, L, S)
    assert gpu._mask_array(one, padded, 1) is padded


def test_keys_are_split_to_fill_the_gpu_but_never_below_a_span():
    assert kernel._splits(blocks=32 * 8, span=8192) == 4  # a batch of 32: 256 blocks of 8 warps
    assert kernel._splits(blocks=32 * 8, span=2049) == 1  # its decode step at 2k: one operation
    assert kernel._splits(blocks=8, span=32768) == 16  # one sequence's long context
    assert kernel._splits(blocks=8, span=300) == 1  # a short one stays whole
    assert kernel._splits(blocks=10_000, span=8192) == 1


def test_only_what_the_kernel_reads_is_given_to_it():
    """A CUDA GPU, few queries, 8 or 4 bits in groups of 64, up to 8 query heads
    a KV head, a mask of booleans: anything else keeps the products."""
    q = mx.zeros((1, 8, 1, 64))
    keys = (mx.zeros((1, 2, 16, 16), dtype=mx.uint32),)
    assert kernel.usable(q, keys, 8, 64, None) == ON_CUDA
    assert not kernel.usable(q, keys, 2, 64, None)
    assert not kernel.usable(q, keys, 8, 32, None)
    assert not kernel.usable(mx.zeros((1, 8, kernel.MAX_QUERIES + 1, 64)), keys, 8, 64, None)
    assert not kernel.usable(mx.zeros((1, 32, 1, 64)), keys, 8, 64, None)  # 16 query heads a KV head
    assert not kernel.usable(q, keys, 8, 64, mx.zeros((1, 1, 1, 16)))  # additive


@pytest.mark.skipif(not ON_CUDA, reason="the kernel runs on a CUDA GPU only")
@pytest.mark.parametrize("shape", [(2, 32, 8, 1, 300, 64, 8), (3, 32, 8, 5, 1000, 64, 8), (2, 14, 2, 3, 2048, 64, 4),
                                   (4, 16, 8, 1, 4096, 128, 8), (1, 32, 8, 1, 20000, 64, 8), (2, 8, 8, 17, 700, 128, 4),
                                   (32, 32, 8, 1, 2049, 64, 8)])
@pytest.mark.parametrize("tail", [0, 1, 37], ids=lambda n: f"tail{n}")
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled-keys"])
def test_the_kernel_equals_attention_over_the_dequantized_kv(shape, tail, scaled):
    """Keys before the last `tail` quantized (divided by per-channel factors
    where `scaled`), the last `tail` read at 16 bits; padded rows, keys past
    the batch's end, one split and several."""
    batch, heads, kv_heads, length, span, width, bits = shape
    key = mx.random.key(7)
    q, k, v = (mx.random.normal(s, key=mx.random.split(key, 3)[i]).astype(mx.bfloat16)
               for i, s in enumerate([(batch, heads, length, width), (batch, kv_heads, span, width),
                                      (batch, kv_heads, span, width)]))
    factors = mx.where(mx.arange(width) % 9 == 0, 8.0, 1.0)[None, None, None].astype(mx.float32) \
        * mx.ones((1, kv_heads, 1, 1))
    start = span - tail
    kept = (k / factors).astype(mx.bfloat16) if scaled else k
    qk, qv = (mx.quantize(a[..., :start, :], group_size=64, bits=bits) for a in (kept, v))
    dk, dv = (mx.dequantize(*a, group_size=64, bits=bits) for a in (qk, qv))
    if scaled:
        dk = dk * factors
    dk, dv = (mx.concatenate([d, a[..., start:, :].astype(d.dtype)], axis=2) for d, a in ((dk, k), (dv, v)))
    end, left = span - 7, mx.array([(span // 3) * (i % 2) for i in range(batch)])  # padded rows, a buffer's end
    position = mx.arange(span)
    mask = ((position >= left[:, None, None]) & (position <= (end - length + mx.arange(length))[None, :, None]))[:, None]
    group = heads // kv_heads
    want = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), mx.repeat(dk, group, 1).astype(mx.float32), mx.repeat(dv, group, 1).astype(mx.float32),
        scale=width**-0.5, mask=mx.where(mask, 0.0, -mx.inf))
    assert kernel.usable(q, qk, bits, 64, mask)
    pieces = None
    if tail:
        pad = mx.zeros((batch, kv_heads, 5, width), mx.bfloat16)  # a tail's room past its tokens
        pieces = (mx.concatenate([k[..., start:, :], pad], axis=2), mx.concatenate([v[..., start:, :], pad], axis=2),
                  mx.array([start], dtype=mx.int32))
    got = kernel.attention(q, qk, qv, width**-0.5, mask, bits, tail=pieces, factors=factors if scaled else None)
    assert got.dtype == q.dtype
    assert mx.abs(got.astype(mx.float32) - want).max().item() < 0.01
