"""What a new attention shape costs on MLX's CUDA backend (a diagnostic).

MLX runs attention on CUDA through cuDNN when it can, and builds a cuDNN graph
for each shape of queries and keys it has not seen in the process (an LRU of
256, `MLX_CUDA_SDPA_CACHE_SIZE`). This times the first call of each shape
against a second, for the attention alone and, given a model folder, for a
whole prefill of a batch of 8:

    python scripts/probe_cudnn_sdpa.py [MODEL_DIR]
    MLX_CUDA_USE_CUDNN_SDPA=0 python scripts/probe_cudnn_sdpa.py [MODEL_DIR]

(the second: MLX's own kernels instead of cuDNN's). On a CPU it runs, but
times nothing of interest.
"""

from __future__ import annotations

import os
import sys
import time

import mlx.core as mx

BATCH, HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 64  # Llama-3.2-1B's attention


def timed(fn) -> float:
    """Milliseconds of one evaluated call."""
    mx.synchronize()
    tic = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - tic) * 1000


def attention(t_q: int, t_kv: int, batch: int = BATCH) -> float:
    q = mx.random.normal((batch, HEADS, t_q, HEAD_DIM)).astype(mx.bfloat16)
    k, v = (mx.random.normal((batch, KV_HEADS, t_kv, HEAD_DIM)).astype(mx.bfloat16) for _ in range(2))
    mx.eval(q, k, v)
    mask = "causal" if t_q == t_kv else None
    return timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, mask=mask))


def main() -> None:
    print("MLX_CUDA_USE_CUDNN_SDPA =", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1"), mx.default_device())
    attention(64, 64)  # the first call of all pays for more than its shape
    for n in (500, 501, 502, 517, 530, 777, 500, 501):
        print(f"attention, prefill of {BATCH} x {n}: first {attention(n, n):7.1f} ms, again {attention(n, n):6.1f} ms")
    for t_q, t_kv in ((37, 2085), (52, 4133), (37, 2085)):  # a new turn over a cached prefix
        print(f"attention, {t_q} new tokens over {t_kv}: first {attention(t_q, t_kv, 1):7.1f} ms, "
              f"again {attention(t_q, t_kv, 1):6.1f} ms")
    if len(sys.argv) > 1:
        from tierlm.models.loader import load_model

        model, _ = load_model(sys.argv[1])

        def prefill(n: int) -> float:
            tokens = mx.random.randint(100, 30000, (BATCH, n))
            mx.eval(tokens)
            return timed(lambda: model(tokens))

        prefill(64)
        for n in (500, 503, 511, 529, 500):
            print(f"model, prefill of {BATCH} x {n}: first {prefill(n):7.1f} ms, again {prefill(n):6.1f} ms")


if __name__ == "__main__":
    main()
