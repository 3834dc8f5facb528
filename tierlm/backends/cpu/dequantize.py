"""Affine-quantized weights (and KV) to float32, fast enough to load a model with.

MLX's CPU `mx.dequantize` runs at ~10-50 M values/s (a 5-bit 151936 x 896
embedding took 11 s on a 2-core Xeon, Qwen2.5-Coder-0.5B's whole import to
float32 ~30 s). Here numpy unpacks the codes and applies scale and bias in
float32, a block of rows at a time: ~1-2 s for that embedding. MLX packs a
row's b-bit codes as one little-endian bit stream (8 codes in b bytes), the
layout `test_cpu_backend` checks against `mx.dequantize` for every width.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BITS = (2, 3, 4, 5, 6, 8)
ROWS_PER_BLOCK = 2048  # keeps a block's codes (~1-2 MB) in cache


def takes(module) -> bool:
    """Whether `float32` can dequantize this quantized layer."""
    return module.mode == "affine" and "biases" in module and module.bits in BITS


def float32(weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The float32 matrix an affine-quantized (weight, scales, biases) stands for."""
    rows = weight.shape[0]
    packed = np.asarray(weight.view(mx.uint8)).reshape(rows, -1, bits)  # 8 codes per `bits` bytes
    scale = np.asarray(scales.astype(mx.float32))[..., None]
    bias = np.asarray(biases.astype(mx.float32))[..., None]
    out = np.empty((rows, packed.shape[1] * 8), np.float32)
    codes = np.empty((min(rows, ROWS_PER_BLOCK), packed.shape[1], 8), np.uint8)
    for start in range(0, rows, ROWS_PER_BLOCK):
        stop = min(start + ROWS_PER_BLOCK, rows)
        block = codes[:stop - start]
        _unpack(packed[start:stop], bits, block)
        grouped = out[start:stop].reshape(stop - start, -1, group_size)
        np.multiply(block.reshape(grouped.shape), scale[start:stop], out=grouped)
        grouped += bias[start:stop]
    return mx.array(out)


def _unpack(packed: np.ndarray, bits: int, codes: np.ndarray) -> None:
    """The i-th code of each 8 starts at bit i*bits of its `bits` bytes."""
    mask = (1 << bits) - 1
    for i in range(8):
        byte, shift = divmod(i * bits, 8)
        code = packed[..., byte] >> shift
        if shift + bits > 8:  # runs into the next byte
            code = code | (packed[..., byte + 1] << (8 - shift))
        np.bitwise_and(code, mask, out=codes[..., i])


KV_BITS = (8, 4)


def kv_takes(cache) -> bool:
    """Whether `kv_float32` reads this quantized KV cache's keys and values."""
    return cache.bits in KV_BITS and getattr(cache, "mode", "affine") == "affine"


def kv_float32(triple, group_size: int, bits: int) -> mx.array:
    """A quantized KV cache's (values, scales, biases) keys or values as
    float32, in MLX operations (part of the step's graph): each code as a
    float, times its group's scale, plus its bias. MLX's CPU `mx.dequantize`
    took ~2.5x as long on a batch's keys and values (1.6M values: 9.5 ms
    against 3.8 on the 2-core Xeon)."""
    codes, scales, biases = triple
    if bits == 8:
        values = codes.view(mx.uint8).astype(mx.float32)
    else:  # 8 codes a word, the first in the lowest bits (MLX's packing)
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        values = ((codes[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.float32)
        values = values.reshape(*codes.shape[:-1], -1)
    grouped = values.reshape(*values.shape[:-1], values.shape[-1] // group_size, group_size)
    out = grouped * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return out.reshape(values.shape)
