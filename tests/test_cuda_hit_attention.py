"""tierlm.backends.cuda_hit_attention: a hit remainder's attention on tensor
cores, one CUDA kernel. The kernel runs only on a CUDA GPU (its test is skipped
elsewhere, saying so); which calls it takes and how it splits the keys are
checked here on any device."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from tierlm.backends import cuda_hit_attention as kernel
from tierlm.backends import gpu

ON_CUDA = mx.default_device() != mx.cpu and mx.cuda.is_available()


def test_the_kernel_takes_16_bit_heads_up_to_128_wide_and_masks_that_show_or_hide(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    q, keys = mx.zeros((1, 32, 40, 64), mx.bfloat16), mx.zeros((1, 8, 1000, 64), mx.bfloat16)
    assert kernel.usable(q, keys, "causal") and kernel.usable(q, keys, None)
    assert kernel.usable(q, keys, mx.zeros((1, 1, 40, 1000), mx.bool_))
    assert kernel.usable(q, keys, mx.zeros((40, 1000), mx.bool_))
    assert not kernel.usable(q, keys, mx.zeros((1, 1, 40, 999), mx.bool_))  # not over every key
    assert not kernel.usable(q, keys, mx.zeros((1, 1, 40, 1000)))  # additive
    assert not kernel.usable(q.astype(mx.float32), keys.astype(mx.float32), "causal")
    assert not kernel.usable(mx.zeros((1, 32, 40, 256), mx.bfloat16), mx.zeros((1, 8, 1000, 256), mx.bfloat16), None)
    assert not kernel.usable(mx.zeros((1, 32, 40, 72), mx.bfloat16), mx.zeros((1, 8, 1000, 72), mx.bfloat16), None)


def test_keys_are_split_to_fill_one_wave_but_never_below_a_span():
    assert kernel._splits(8, 8000) == 8000 // kernel.MIN_SPAN  # one row block a KV head: as many as the keys allow
    assert kernel._splits(8, 100_000) == kernel.MAX_SPLITS  # a lane each when they are joined
    assert kernel._splits(8 * 4, 100_000) == kernel.TARGET_BLOCKS // 32
    assert kernel._splits(8, 300) == 1
    assert kernel._splits(kernel.TARGET_BLOCKS * 2, 100_000) == 1
    # never a second wave that one would not need
    assert all(blocks * kernel._splits(blocks, 10**6) <= max(blocks, kernel.TARGET_BLOCKS) for blocks in range(1, 600))


def test_a_hit_remainder_goes_to_the_kernel_and_a_lone_decode_step_does_not(monkeypatch):
    """Through the GPU wrapper: the kernel takes what the products would
    (a remainder from PAD_FROM_QUERIES queries; with "all" any few queries),
    MLX's own keeps the rest (a lone decode step, cuDNN's long remainders)."""
    monkeypatch.setattr(kernel, "usable", lambda *a: True)
    monkeypatch.setattr(kernel, "attention", lambda *a: "kernel")
    monkeypatch.setattr(gpu, "attention_products", lambda *a: "products")
    monkeypatch.setattr(gpu, "QUERY_BUCKET", 0)  # MLX's own called as it is (not padded to a bucket)
    wrapped = gpu._wrap(lambda *a, **k: "mlx")
    keys = mx.zeros((1, 8, 20000, 64), mx.bfloat16)

    def route(queries, keys=keys, mask="causal"):
        return wrapped(queries, keys, keys, None, scale=0.125, mask=mask)

    assert route(mx.zeros((1, 32, gpu.PAD_FROM_QUERIES, 64))) == "kernel"
    assert route(mx.zeros((1, 32, gpu.MAX_QUERIES, 64))) == "kernel"
    # longer ones where the products took them (their scores' bound), else cuDNN's as before
    assert route(mx.zeros((1, 32, gpu.MAX_HIT_QUERIES, 64)), keys[:, :, :5000]) == "kernel"
    assert route(mx.zeros((1, 32, gpu.MAX_HIT_QUERIES, 64))) == "mlx"
    assert route(mx.zeros((1, 32, gpu.MAX_HIT_QUERIES + 1, 64)), keys[:, :, :5000]) == "mlx"
    assert route(mx.zeros((1, 32, 5, 64))) == "products"  # a verification
    assert route(mx.zeros((1, 32, 100, 64)), keys[:, :, :100]) == "products"  # a prompt's first chunk
    monkeypatch.setattr(gpu, "HIT_KERNEL", "all")
    assert route(mx.zeros((1, 32, 5, 64))) == "kernel"
    assert route(mx.zeros((gpu.FEW_DECODE_ROWS + 1, 32, 1, 64)), mask=None) == "kernel"
    assert route(mx.zeros((gpu.FEW_DECODE_ROWS, 32, 1, 64)), mask=None) == "mlx"  # MLX's own
    monkeypatch.setattr(gpu, "HIT_KERNEL", "off")
    assert route(mx.zeros((1, 32, 40, 64))) == "products"


def test_a_batch_caches_mask_reaches_the_kernel_as_causal_and_its_left_padding(monkeypatch):
    """mlx-lm's batch cache's mask is "causal" from each row's left padding (it
    fails here if mlx-lm's mask changes), so the kernel computes it instead of
    reading it a key at a time; a subclass's mask (rows of their own ends) is
    passed as it is."""
    cache = BatchKVCache([3, 0])
    cache.update_and_fetch(*(mx.zeros((2, 8, 100, 64)),) * 2)
    mask = cache.make_mask(40)
    span = cache._idx + 40
    assert mask.shape == (2, 1, 40, span)
    expected = gpu.causal_mask(40, span, span)[None, None] & (mx.arange(span) >= cache.left_padding[:, None, None, None])
    assert mx.array_equal(mask, expected).item()

    monkeypatch.setattr(kernel, "usable", lambda *a: True)
    calls = []
    monkeypatch.setattr(kernel, "attention", lambda *a: calls.append(a) or "kernel")
    wrapped = gpu._wrap(lambda *a, **k: "mlx")
    q, keys = mx.zeros((2, 32, 40, 64), mx.bfloat16), mx.zeros((2, 8, span, 64), mx.bfloat16)
    assert wrapped(q, keys, keys, cache, scale=0.125, mask=mask) == "kernel"
    assert calls[-1][4] == "causal" and calls[-1][5] is cache.left_padding

    class OwnEnds(BatchKVCache):
        pass

    assert wrapped(q, keys, keys, OwnEnds([3, 0]), scale=0.125, mask=mask) == "kernel"
    assert calls[-1][4] is mask and len(calls[-1]) == 5


def _reference(q, k, v, scale, mask):
    group = q.shape[1] // k.shape[1]
    k, v = (mx.repeat(a.astype(mx.float32), group, axis=1) for a in (k, v))
    scores = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = gpu.causal_mask(q.shape[2], k.shape[2], k.shape[2])
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


@pytest.mark.skipif(not ON_CUDA, reason="the kernel runs on a CUDA GPU only")
@pytest.mark.parametrize("shape", [(1, 32, 8, 40, 20040, 64), (3, 32, 8, 20, 700, 64), (1, 14, 2, 66, 3000, 64),
                                   (2, 16, 8, 100, 5000, 128), (1, 28, 4, 1, 9000, 128), (32, 32, 8, 1, 2000, 64),
                                   (1, 32, 8, 300, 700, 64), (1, 32, 8, 17, 33, 64)])
@pytest.mark.parametrize("mask", ["causal", "rows", "padding", None])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])
def test_the_kernel_equals_attention_in_float32(shape, mask, dtype):
    """Keys and values as views of longer buffers (a cache's); "rows": a batch
    mask of left-padded rows, as mlx-lm's batch cache makes; "padding": the
    same rows given as "causal" and their left padding, as the GPU wrapper
    gives a batch cache's; one split and several."""
    batch, heads, kv_heads, length, span, width = shape
    key = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((batch, heads, length, width), key=key[0]).astype(dtype)
    k, v = (mx.random.normal((batch, kv_heads, span + 256, width), key=key[i]).astype(dtype)[:, :, :span]
            for i in (1, 2))
    left = mx.array([(span // 3) * (i % 2) for i in range(batch)])
    padding = left if mask == "padding" else None
    if mask in ("rows", "padding"):
        mask = gpu.causal_mask(length, span, span)[None, None] & (mx.arange(span) >= left[:, None, None, None])
    assert kernel.usable(q, k, mask)
    got = kernel.attention(q, k, v, width**-0.5, "causal" if padding is not None else mask, padding)
    assert got.dtype == dtype and got.shape == q.shape
    assert mx.abs(got.astype(mx.float32) - _reference(q, k, v, width**-0.5, mask)).max().item() < 0.02
