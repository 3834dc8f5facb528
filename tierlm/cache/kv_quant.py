"""Packed KV blocks kept at 8 or 4 bits in the cache tiers (`cache_kv_bits`).

A packed block (all of a block's keys and values in one array, prefix_cache.py)
is quantized with MLX's affine quantization as it is stored, and dequantized
when a hit rebuilds the batch's cache from it: the hot tier and the SSD tier
hold ~half the bytes of 16-bit KV (a quarter of float32's) per token, so
twice the tokens fit their sizes. The running batch keeps the KV it computes.

Groups run along the packed array's last axis, two tokens' head vectors at a
time where a head holds 64 values: groups of 128 at 8 bits (8.25 bits a value
with their float16 scale and bias: 1.94x fewer bytes than 16-bit KV), of 64 at
4 bits (4.5 bits). The payload says how it was made, so a reader needs nothing
else; the bits are in the cache's block keys too (PrefixCache), so a block is
never read as another layout.
"""

from __future__ import annotations

import mlx.core as mx

MARK = "affine-kv"  # a quantized payload's first element
BITS = (16, 8, 4)  # 16: kept as computed


def group_size(bits: int) -> int:
    return 128 if bits == 8 else 64


def fits(packed: mx.array, bits: int) -> bool:
    """Whether a head's values in the block fill whole groups (else it is kept as is)."""
    return packed.shape[2] * packed.shape[3] % group_size(bits) == 0


def quantize(packed: mx.array, bits: int) -> tuple:
    """(MARK, bits, group size, shape, quantized values, scales, biases) of a packed block."""
    group = group_size(bits)
    flat = packed.reshape(*packed.shape[:2], -1, group)
    values, scales, biases = mx.quantize(flat, group_size=group, bits=bits)
    dtype = mx.float16 if packed.dtype == mx.float32 else packed.dtype
    return (MARK, bits, group, [int(d) for d in packed.shape], str(packed.dtype).split(".")[-1],
            values, scales.astype(dtype), biases.astype(dtype))


def is_quantized(payload) -> bool:
    return isinstance(payload, tuple) and len(payload) == 8 and payload[0] == MARK


def dequantize(payload: tuple) -> mx.array:
    """The packed block back, in the dtype it was computed in."""
    _, bits, group, shape, dtype, values, scales, biases = payload
    flat = mx.dequantize(values, scales, biases, group_size=group, bits=bits)
    return flat.reshape(shape).astype(getattr(mx, dtype))


def arrays(payload: tuple) -> list[mx.array]:
    return list(payload[5:])


def with_arrays(payload: tuple, new: list[mx.array]) -> tuple:
    """The payload with its arrays (values, scales, biases) replaced by `new`."""
    return (*payload[:5], *new)
