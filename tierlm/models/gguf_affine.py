"""GGUF quantized tensors -> MLX affine quantization (group size 32), from the blocks.

MLX's affine format keeps, for each group of 32 values of a row, a scale s and a
bias b, and each value as an unsigned integer q of `bits` bits: w = s * q + b.
Most GGUF block formats are that already, 32 values at a time, and are written
over as they are (q unchanged, s and b from the block's own scales):

    Q4_0  w = d (q - 8)          4 bits  s = d         b = -8 d
    Q4_1  w = d q + m            4 bits  s = d         b = m
    Q5_0  w = d (q - 16)         5 bits  s = d         b = -16 d
    Q5_1  w = d q + m            5 bits  s = d         b = m
    Q8_0  w = d q, q signed      8 bits  q + 128, s = d, b = -128 d
    Q4_K  w = d sc q - dmin m    4 bits  s = d sc      b = -dmin m  (sc, m: the 32-value sub-block's)
    Q5_K  as Q4_K, 5-bit q       5 bits  s = d sc      b = -dmin m

Scales and biases are stored as float16. For Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
that is exact (d and m are float16 in the file; -8d, -16d, -128d are d times a
power of two). Q4_K's and Q5_K's products d*sc and dmin*m have up to 17
significant bits and are rounded to float16's 11: each is off by at most 2^-11
of itself, and a value by at most 2^-11 (|s| q + |b|).

Q6_K is 16-value sub-blocks, each with its own scale, so a 32-value group holds
two scales and no 32-group grid holds it exactly: each group is quantized again
to 8 bits from its exact values (`requantize`). Every other quantized type (Q2_K,
Q3_K, the IQ and TQ formats, ...) is dequantized with the `gguf` package and
quantized again the same way to 4 bits, or to 8 bits where the type has 6 bits
a weight or more (Q8_1, Q8_K). MLX's 5-bit packing is a bit stream: value i of
a row holds bits [5i, 5i + 5) of the row's bytes, read as little-endian uint32
(`pack`); for 4 and 8 bits that is MLX's usual packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from tierlm.models.gguf_dequant import GGUFTensor

GROUP_SIZE = 32
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# types whose 32-value groups are MLX affine groups, and their bits
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8}
_CHUNK = 1 << 22  # values converted at a time (bounds the temporary arrays)


@dataclass(frozen=True)
class Affine:
    weight: mx.array  # uint32, (rows, cols * bits / 32)
    scales: mx.array  # float16 (float32 where a scale or bias does not fit float16), (rows, cols / 32)
    biases: mx.array
    bits: int


def affine_bits(type_name: str) -> int:
    """The bits a quantized GGUF type becomes: exact where EXACT_BITS says,
    else 8 for types of 6 bits a weight or more (Q6_K), else 4."""
    if type_name in EXACT_BITS:
        return EXACT_BITS[type_name]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return 8 if size * 8 >= 6 * block else 4


def convertible(t: GGUFTensor) -> bool:
    """A quantized matrix whose rows split into 32-value groups (every GGUF block
    format's rows do: its blocks are 32 or 256 values)."""
    return t.type_name not in FLOAT_TYPES and len(t.shape) == 2 and t.shape[-1] % GROUP_SIZE == 0


def to_affine(t: GGUFTensor) -> Affine:
    """`t` (see `convertible`) as MLX affine arrays, a chunk of rows at a time."""
    rows, cols = t.shape
    bits = affine_bits(t.type_name)
    exact = t.type_name in EXACT_BITS
    raw = np.asarray(t.raw).reshape(rows, -1)
    step = max(1, _CHUNK // cols)
    parts = [(_from_blocks(t.type_name, raw[r:r + step]) if exact else
              requantize(_dequantize(t, raw[r:r + step]), bits)) for r in range(0, rows, step)]
    q = np.concatenate([p[0] for p in parts]).reshape(rows, cols)
    scales, biases = (np.concatenate([p[i] for p in parts]).reshape(rows, cols // GROUP_SIZE) for i in (1, 2))
    scales, biases = _as_float16(scales, biases)
    return Affine(mx.array(pack(q, bits)), mx.array(scales), mx.array(biases), bits)


def _dequantize(t: GGUFTensor, raw_rows: np.ndarray) -> np.ndarray:
    part = GGUFTensor(t.name, t.type_name, (raw_rows.shape[0], t.shape[1]), raw_rows)
    return part.to_float32()


def _as_float16(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16, unless a value would overflow it (no real model's): then float32."""
    with np.errstate(over="ignore"):
        s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
    if np.isfinite(s16).all() and np.isfinite(b16).all():
        return s16, b16
    return scales.astype(np.float32), biases.astype(np.float32)


# ---- the block formats, each as (q, scale, bias) per 32 values --------------


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 (n_blocks, 1)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k, 16 or 32) bytes -> (n, k, 2, ...) low nibbles, then high ones."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _from_blocks(type_name: str, raw_rows: np.ndarray):
    """(q uint8 (n_groups, 32), scale (n_groups,), bias (n_groups,)) for `raw_rows`
    of an EXACT_BITS type, in the order of the row's values."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    b = raw_rows.reshape(-1, size)
    n = b.shape[0]
    if type_name == "Q8_0":
        d = _f16(b, 0)
        return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q + 128 is its byte with the top bit flipped
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        offset = 4 if type_name == "Q4_1" else 2
        q = _nibbles(b[:, offset:offset + 16]).reshape(n, 32)
        return q, d, _f16(b, 2) if type_name == "Q4_1" else -8 * d
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        offset = 4 if type_name == "Q5_1" else 2
        qh = np.ascontiguousarray(b[:, offset:offset + 4]).view(np.uint32)  # (n, 1): bit j is value j's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles(b[:, offset + 4:offset + 20]).reshape(n, 32) | (high << 4)
        return q, d, _f16(b, 2) if type_name == "Q5_1" else -16 * d
    # Q4_K, Q5_K: 256-value super-blocks of eight 32-value sub-blocks, each with a 6-bit scale and min
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    scale, bias = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if type_name == "Q4_K":  # sub-blocks 2j, 2j+1: the low, high nibbles of bytes 32j..32j+31
        return _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n * 8, 32), scale, bias
    # Q5_K: the same from bytes 48.., and bit k of the 32 qh bytes is sub-block k's fifth bit
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    return (low | (high << 4)).reshape(n * 8, 32), scale, bias


# ---- quantizing again ---------------------------------------------------------


def _float16_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """`x` rounded to a float16 on the side of `direction` (+inf: not below x, -inf: not above)."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    wrong = h.astype(np.float32) < x if direction > 0 else h.astype(np.float32) > x
    return np.where(wrong, np.nextafter(h, np.float16(direction)), h)


def requantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each 32-value group of `values` (rows, cols) on a grid of 2^bits levels:
    b = the group's min rounded down to float16, s = (max - b) / (2^bits - 1)
    rounded up to float16, q = round((w - b) / s). The grid [b, b + (2^bits - 1) s]
    covers the group, so each value is off by at most s / 2 (and float32's
    rounding, ~2^-23 of the group's magnitude). For Q6_K at 8 bits: its values
    in a group are two 16-value sub-blocks' d*sc*(q6 - 32), q6 in 0..63, so they
    span at most 64 of the coarser sub-block's steps (|d*sc|), and the error is
    at most 64 / 255 / 2 = 0.1255 of that step; 0.1257 with b's rounding down (at
    most 2^-10 of 32 steps more span) and s's rounding up (2^-10 of s)."""
    levels = (1 << bits) - 1
    groups = values.astype(np.float32, copy=False).reshape(-1, GROUP_SIZE)
    low, high = groups.min(-1), groups.max(-1)
    bias = _float16_toward(low, -np.inf).astype(np.float32)
    scale = _float16_toward((high - bias) / np.float32(levels), np.inf).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[:, None] > 0, np.rint((groups - bias[:, None]) / scale[:, None]), 0)
    return np.clip(q, 0, levels).astype(np.uint8), scale, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) values below 2^bits -> MLX's packing, (rows, cols * bits / 32)
    uint32: an LSB-first bit stream, value i at bits [bits*i, bits*i + bits)."""
    rows, cols = q.shape
    groups = q.reshape(rows, cols // 32, 32).astype(np.uint32)
    out = np.zeros((rows, cols // 32, bits), np.uint32)
    for i in range(32):
        word, shift = divmod(bits * i, 32)
        out[..., word] |= groups[..., i] << np.uint32(shift)
        if shift + bits > 32:
            out[..., word + 1] |= groups[..., i] >> np.uint32(32 - shift)
    return out.reshape(rows, cols // 32 * bits)
