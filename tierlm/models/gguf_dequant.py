"""Reading GGUF files, and GGUF tensors of any block format -> float32 (with the
`gguf` package) -> MLX.

The import with `bits` asked for (4, 8 or 16) goes this way: every tensor is
dequantized by `gguf.quants` and quantized again with `mx.quantize` (affine, 4
or 8 bits; the widest types never below 8), or kept as bfloat16 (`bits=16`).
The default import writes the GGUF blocks as MLX affine weights directly
(gguf_affine) and comes here only for what is not a quantized matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

BITS = (4, 8, 16)
GROUP_SIZES = {4: 64, 8: 32}  # per bits: 8-bit groups match GGUF's 32-value blocks
# tensors the GGUF keeps at 6 bits or more (llama.cpp's Q4_K_M keeps the token
# embedding, which is also the tied output head, at Q8_0): never below 8 bits
_WIDE_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q8_1", "Q8_K", "Q6_K"})


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a matrix
    raw: Any  # the reader's memory-mapped block data

    def bits_for(self, bits: int) -> int:
        """The bits this tensor is converted to when `bits` are asked for."""
        return 8 if bits == 4 and self.type_name in _WIDE_TYPES else bits

    def to_float32(self) -> np.ndarray:
        """The tensor's values, dequantized by gguf's reference code."""
        values = gguf_dequantize(self.raw, GGMLQuantizationType[self.type_name])
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


class _Reader(GGUFReader):
    """gguf's reader on a plain ndarray view of its memory map. It slices the map
    once or more per value (Gemma 3's 262k-token vocabulary: ~1M slices), and a
    slice of an np.memmap is an np.memmap, made through two Python-level hooks:
    12.4 s of the reader's 12.7 s for Gemma 3 270M on an AVX2 AMD EPYC. The same
    bytes, still memory-mapped (each view keeps the map alive)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata (plain Python values) and the tensors, memory-mapped, of a GGUF file."""
    reader = _Reader(str(path))
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [
        GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
        for t in reader.tensors
    ]
    return meta, tensors


def type_counts(tensors: list[GGUFTensor]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return counts


def quantizable(values: np.ndarray, group_size: int) -> bool:
    """Matrices (linear and embedding weights) whose rows split into whole groups."""
    return values.ndim == 2 and values.shape[-1] % group_size == 0


def to_mlx(name: str, values: np.ndarray, bits: int) -> dict[str, mx.array]:
    """`name` (ending in `.weight`) as MLX arrays: quantized to `bits` (4 or 8), or
    bfloat16 (16). Vectors and matrices that don't split into groups stay bfloat16."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    array = mx.array(values, dtype=mx.float32)
    group_size = GROUP_SIZES.get(bits, 0)
    if bits == 16 or not quantizable(values, group_size):
        return {name: array.astype(mx.bfloat16)}
    weight, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    module = name.removesuffix(".weight")
    return {
        f"{module}.weight": weight,
        f"{module}.scales": scales.astype(mx.bfloat16),
        f"{module}.biases": biases.astype(mx.bfloat16),
    }


def quantization_config(bits: int, overrides: dict[str, int] | None = None) -> dict | None:
    """mlx-lm's `quantization` entry for weights made by `to_mlx` with `bits`, and
    `overrides` (module -> bits) where a module got other bits; None for 16 bits."""
    if bits == 16:
        return None
    quant: dict = {"group_size": GROUP_SIZES[bits], "bits": bits, "mode": "affine"}
    for module, b in (overrides or {}).items():
        if b != bits:
            quant[module] = {"group_size": GROUP_SIZES[b], "bits": b}
    return quant
