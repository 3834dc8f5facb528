"""tierlm.backends.gpu: attention of a few queries as two products (on a CUDA
GPU in place of cuDNN's per-shape graphs). The arithmetic is checked here, on
the CPU, against MLX's own attention; on a CPU (or Metal) nothing is installed."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tierlm.backends import gpu
from tierlm.models.random_model import tiny_model


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


def test_nothing_is_installed_without_a_cuda_gpu():
    with mx.stream(mx.cpu):
        assert gpu.install(tiny_model("llama")) == []
