"""mlx-lm's rotary position embedding (`nn.RoPE`) in fewer MLX operations.

On MLX's CPU device `mx.fast.rope` has no kernel: MLX builds its fallback
graph, 32 operations a call, and a decode step calls it twice a layer. An MLX
operation costs ~2 us on this backend whatever its size (MLX's stream thread
takes each one from a queue, waking for it), so at one sequence's decode step
RoPE alone was ~1,900 of SmolLM2's ~3,600 operations.

`FewerOpsRoPE` computes what the fallback computes, bit for bit, with the same
element-wise operations on the same values, and leaves out what need not be
done again: the inverse frequencies (computed once), the angles' cosines and
sines (computed once for the queries and reused for the keys of the same call
pair), and the broadcasts MLX would insert for each product. A layer's pair of
calls takes 39 operations instead of 66. Where tierlm's own MLX operations are
on (graph_ops.py), a call is one operation, angles included, with the same bits.

`install` proves it at load: for a few shapes and offsets, its output equals
`mx.fast.rope`'s bit for bit, or the model keeps `nn.RoPE` (and the reason is
logged). Only float32 inputs in (batch, heads, tokens, dims) layout take the
short graph; anything else goes to `mx.fast.rope`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tierlm.backends.cpu import graph_ops

log = logging.getLogger(__name__)


class FewerOpsRoPE(nn.RoPE):
    """An `nn.RoPE` whose instances `install` switched to this class: same fields."""

    def __call__(self, x, offset: int | mx.array = 0):
        if x.dtype != mx.float32 or x.ndim != 4:
            return super().__call__(x, offset)
        batch, heads, tokens, _ = x.shape
        inverse = inverse_frequencies(self.dims, self.base)
        if (out := graph_ops.rope(x, inverse, offset, self.dims, self.traditional, self.scale)) is not None:
            return out  # one operation, its angles included
        cos, sin = self._angles(offset, tokens, batch)
        if self.traditional:  # rotated pairs (2i, 2i + 1), interleaved again after
            x1, x2 = x[..., 0 : self.dims : 2], x[..., 1 : self.dims : 2]
        else:  # pairs (i, i + dims / 2)
            x1, x2 = x[..., : self.dims // 2], x[..., self.dims // 2 : self.dims]
        cos, sin = mx.broadcast_to(cos, x1.shape), mx.broadcast_to(sin, x1.shape)
        first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        if self.traditional:
            rotated = [mx.stack([first, second], axis=-1).reshape(batch, heads, tokens, self.dims)]
        else:
            rotated = [first, second]
        if self.dims < x.shape[-1]:
            rotated.append(x[..., self.dims :])
        return rotated[0] if len(rotated) == 1 else mx.concatenate(rotated, axis=-1)

    def _angles(self, offset, tokens: int, batch: int) -> tuple[mx.array, mx.array]:
        """cos and sin of the angles at positions offset .. offset + tokens - 1,
        as the fallback computes them; the last call's kept, since the keys'
        call follows the queries' with the same offset."""
        shape = (tokens, batch, threading.get_ident())  # its thread's: their graph is on its stream
        kept = self.__dict__.get("_last")
        same = kept is not None and (kept[0] is offset or isinstance(offset, int) and isinstance(kept[0], int)
                                     and kept[0] == offset)  # an array offset: the very one (kept alive here)
        if same and kept[1] == shape:
            return kept[2]
        positions = mx.arange(tokens, dtype=mx.float32)
        if isinstance(offset, mx.array) and offset.size > 1:
            positions = positions + offset.reshape(-1, 1, 1)  # (batch, 1, tokens)
        else:
            positions = positions + offset
        if self.scale != 1.0:  # a product by 1.0 changes no bit
            positions = positions * mx.array(self.scale, mx.float32)
        theta = positions[..., None] * inverse_frequencies(self.dims, self.base)
        angles = (mx.cos(theta), mx.sin(theta))
        self.__dict__["_last"] = (offset, shape, angles)  # in __dict__: not one of the module's parameters
        return angles


_inverse: dict[tuple[int, float], mx.array] = {}


def inverse_frequencies(dims: int, base: float) -> mx.array:
    """exp(-i · log(base) / (dims / 2)) for i < dims / 2, as MLX's fallback
    computes them: log in single precision (C's logf), divided in single
    precision, times the float32 range, exp in MLX."""
    key = (dims, float(base))
    if key not in _inverse:
        half = dims // 2
        step = np.float32(_logf(base)) / np.float32(half)
        values = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, mx.float32))
        mx.eval(values)  # concrete: it is shared by every engine's thread (see key_scaling.KeyScales)
        _inverse[key] = values
    return _inverse[key]


def _logf(value: float) -> float:
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.logf(value)


def install(model: nn.Module) -> tuple[int, str | None]:
    """Switches the model's `nn.RoPE` modules (that class exactly: subclasses
    compute other frequencies) to FewerOpsRoPE where each one's output equals
    `mx.fast.rope`'s bit for bit; returns how many, and why none where a check failed."""
    ropes = [m for _, m in model.named_modules() if type(m) is nn.RoPE]
    for rope in {(r.dims, r.traditional, r.base, r.scale): r for r in ropes}.values():  # each kind once
        if (why := _differs(rope)) is not None:
            log.warning("RoPE left to mx.fast.rope: %s", why)
            return 0, why
    for rope in ropes:
        rope.__class__ = FewerOpsRoPE
    return len(ropes), None


def uninstall(model: nn.Module) -> None:
    for _, m in model.named_modules():
        if type(m) is FewerOpsRoPE:
            m.__dict__.pop("_last", None)
            m.__class__ = nn.RoPE


def _differs(rope: nn.RoPE) -> str | None:
    """Why FewerOpsRoPE would not give `rope`'s bits, or None: a prefill chunk
    and a decode step at offsets, one sequence and a batch with its own offsets."""
    head = rope.dims + (rope.dims // 2) % 8  # a head wider than the rotated part too
    cases = [(1, 2, 7, 0), (1, 2, 1, 4093), (3, 2, 1, mx.array([5, 811, 30000])), (2, 1, 5, mx.array([0, 9]))]
    shorter = FewerOpsRoPE(rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale)
    for batch, heads, tokens, offset in cases:
        x = mx.random.normal((batch, heads, tokens, head), key=mx.random.key(tokens))
        want = mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale,
                            offset=offset)
        got = shorter(x, offset)
        if not mx.array_equal(want, got).item():
            return (f"its output differs from mx.fast.rope's (dims {rope.dims}, base {rope.base}, "
                    f"{batch} x {tokens} tokens)")
    return None
