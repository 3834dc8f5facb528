"""Packed KV blocks kept at 8 or 4 bits in the cache tiers (`cache_kv_bits`).

A packed block (all of a block's keys and values in one array, prefix_cache.py)
is quantized with MLX's affine quantization as it is stored, and dequantized
when a hit rebuilds the batch's cache from it: the hot tier and the SSD tier
hold ~half the bytes of 16-bit KV (a quarter of float32's) per token, so
twice the tokens fit their sizes. The running batch keeps the KV it computes.

Groups run along the packed array's last axis, two tokens' head vectors at a
time where a head holds 64 values: groups of 128 at 8 bits (8.25 bits a value
with their float16 scale and bias: 1.94x fewer bytes than 16-bit KV), of 64 at
4 bits (4.5 bits). The payload says how it was made; the bits are in the
cache's block keys too (PrefixCache), so a block is never read as another
layout.

Where the engine scales key channels (engine/key_scaling.py), a block's keys
are divided by their layer's factors before they are quantized and multiplied
back after (`packed_factors`): a few large channels no longer size every
group's step. Such a payload is marked SCALED, and the factors' digest is in
the block keys (`factors_tag`), so it is only read with the same factors.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

MARK = "affine-kv"  # a quantized payload's first element
SCALED = "affine-kv-scaled"  # the same, its keys divided by per-channel factors
BITS = (16, 8, 4)  # 16: kept as computed


def group_size(bits: int) -> int:
    return 128 if bits == 8 else 64


def group_for(packed: mx.array, bits: int) -> int | None:
    """The group a block is quantized in: `group_size(bits)` where a head's values
    in the block fill whole groups of it, else the largest smaller group MLX
    quantizes that they fill (a part block of an odd number of tokens: one
    token's head vector a group); None: kept as is."""
    values = packed.shape[2] * packed.shape[3]
    return next((g for g in (group_size(bits), 64, 32) if g <= group_size(bits) and values % g == 0), None)


def packed_factors(key_scales: list) -> mx.array | None:
    """Per-layer key factors (engine.key_scaling.KeyScales) laid out as a packed
    block's rows, (2 x layers, kv heads, 1, head dim): keys' rows the factors,
    values' rows 1. None unless every layer has them."""
    if not key_scales or any(s is None for s in key_scales):
        return None
    rows = [r for s in key_scales for r in (s.factors[0], mx.ones_like(s.factors[0]))]
    return mx.stack(rows).astype(mx.float32)


def factors_tag(factors: mx.array | None) -> str:
    """What the block keys and the layout name of scaled blocks carry: the factors' digest."""
    if factors is None:
        return ""
    return "keys-" + hashlib.sha256(memoryview(factors.astype(mx.float32))).hexdigest()[:16]


def quantize(packed: mx.array, bits: int, factors: mx.array | None = None, group: int | None = None) -> tuple:
    """(MARK, bits, group size, shape, dtype, quantized values, scales, biases) of
    a packed block; SCALED, its keys divided by `factors` first, where given.
    `group`: `group_size(bits)` unless given (`group_for`)."""
    if factors is not None:
        packed = packed / factors.astype(packed.dtype)
    group = group or group_size(bits)
    flat = packed.reshape(*packed.shape[:2], -1, group)
    values, scales, biases = mx.quantize(flat, group_size=group, bits=bits)
    dtype = mx.float16 if packed.dtype == mx.float32 else packed.dtype
    return (MARK if factors is None else SCALED, bits, group, [int(d) for d in packed.shape],
            str(packed.dtype).split(".")[-1], values, scales.astype(dtype), biases.astype(dtype))


def is_quantized(payload) -> bool:
    return isinstance(payload, tuple) and len(payload) == 8 and payload[0] in (MARK, SCALED)


def dequantize(payload: tuple, factors: mx.array | None = None) -> mx.array:
    """The packed block back, in the dtype it was computed in (a SCALED one's
    keys multiplied by `factors`, the ones it was quantized with)."""
    mark, bits, group, shape, dtype, values, scales, biases = payload
    flat = mx.dequantize(values, scales, biases, group_size=group, bits=bits)
    packed = flat.reshape(shape).astype(getattr(mx, dtype))
    if mark == SCALED:
        if factors is None:
            raise ValueError("a block quantized with key factors, read without them")
        packed = packed * factors.astype(packed.dtype)
    return packed


def arrays(payload: tuple) -> list[mx.array]:
    return list(payload[5:])


def with_arrays(payload: tuple, new: list[mx.array]) -> tuple:
    """The payload with its arrays (values, scales, biases) replaced by `new`."""
    return (*payload[:5], *new)
