"""Attention and SwiGLU for MLX's CPU backend, built around a faster exp.

MLX's Linux CPU build computes `exp` one element at a time (~13 ns each here),
and softmax and SiLU are mostly exp: in a 500-token prefill of SmolLM2 they took
~60% of the time, more than every matmul. On CPUs with AVX-512 or AVX2 both run
in native code (native/softmax.c, native/swiglu.c): the softmax of a prefill
layer ~25 -> ~0.7 ms (AVX-512); as one operation in MLX's graph each where
graph_ops.py is on, else on evaluated arrays, in place. Elsewhere attention's softmax
over many scores (a prefill's) takes numpy's vectorized exp in place, ~5x
faster than `fast_exp`, and smaller ones and SwiGLU take `fast_exp`, ordinary
arithmetic that MLX compiles, ~3x faster than MLX's exp, within 3e-5.

`attention` is mlx-lm's scaled dot-product attention done as two matmuls
(grouped-query heads share one per KV head; the sgemm route sends them to
native/exact_gemm.c, bit-exact whatever the padding) around the softmax.

`install(model)` puts both into the model's module in place of mlx-lm's, only on
MLX's CPU device and only for float32 inputs; everything else (attention
sinks, 16-bit activations) still goes to mlx-lm's own. KV kept at 8 or 4 bits
in the batch (engine.quantized_kv) takes the same attention, each KV head
read back as float32 just before its products (`quantized_attention`, one
operation: graph_ops.cpp), or the whole layer's KV at once
(dequantize.kv_float32) where that does not run: mlx-lm's quantized attention
(two quantized products and MLX's softmax) made a decode step of the default
model at batch 8 over 1k tokens ~3.5x as long as float32 KV's. Where
the native kernels run, mlx-lm's per-step log-sum-exp of the logits runs in
native code too (`GenerateMx`). `calls` counts what ran (the native library
counts its own calls too): the tests check that what is reported in use runs.
"""

from __future__ import annotations

import inspect
import math
import types
from collections import Counter
from functools import partial

import mlx.core as mx
import numpy as np
from mlx import nn

from tierlm.backends import mlx_lm_generate, mlx_lm_modules
from tierlm.backends.cpu import dequantize, graph_ops, rope, route

# times each replacement ran in this process: "attention", "swiglu" (either way),
# "logsumexp" (the native one, through mlx_lm.generate's proxy), "gelu" (native
# or numpy's, through the model modules' mlx.nn proxy). Every key is
# there from the start: /stats reads it from another thread, and a key added
# while it iterates would break the iteration.
calls: Counter = Counter(attention=0, quantized_kv=0, swiglu=0, logsumexp=0, gelu=0)

# exp(x) = (2^u)^128 with u = x·log2(e)/128: 2^u from its Taylor series (degree 9,
# error ~1e-9), then seven squarings (error x128). Plain arithmetic, so the
# compiled kernel stays shapeless: decode's growing shapes reuse it. Below
# exp(-87) the result is exactly 0: the tiny values the formula would give there
# are denormals, and one denormal in a matmul makes x86 CPUs ~10x slower.
_EXP2_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(9, -1, -1))
_SQUARINGS = 7
_LOWEST = -87.0  # exp(-87) ~ 1.6e-38, just above float32's smallest normal number
_SMALLEST_NORMAL = np.finfo(np.float32).tiny
# scores of at least this many elements take numpy's exp (`numpy_shifted_exp`):
# below it, evaluating them apart costs more than the exp (decode steps of a few
# sequences over short contexts)
NUMPY_EXP_MIN = 2**16


@partial(mx.compile, shapeless=True)
def fast_exp(x: mx.array) -> mx.array:
    u = mx.clip(x * (math.log2(math.e) / 2**_SQUARINGS), _LOWEST * math.log2(math.e) / 2**_SQUARINGS, 1.0)
    power = _EXP2_TAYLOR[0]
    for c in _EXP2_TAYLOR[1:]:
        power = power * u + c
    for _ in range(_SQUARINGS):
        power = power * power
    return mx.where(x < _LOWEST, 0.0, power)


@partial(mx.compile, shapeless=True)
def _shifted_exp(scores: mx.array, row_max: mx.array) -> mx.array:
    return fast_exp(scores - row_max)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate / (1 + fast_exp(-gate)) * x


# The most bytes of scores one native attention call makes: longer prompts' are
# computed a block of queries at a time. MLX's CPU allocator takes each buffer
# from malloc, which maps one this large afresh (and faults its pages in) for
# every layer of every chunk: a 256-token chunk at 8k keys made ~120 MB of scores
# a layer, and page faults were ~9% of a long prefill.
SCORES_BLOCK_BYTES = 16 << 20


def attention(queries, keys, values, scale: float, mask, native: bool | None = None) -> mx.array:
    """softmax(q kᵀ · scale + mask) v for (B, heads, L, D) queries and (B, kv_heads, S, D) keys;
    the softmax in native code when `native` (by default where the CPU allows)."""
    batch, heads, length, _ = queries.shape
    span = keys.shape[2]
    native = native if native is not None else native_kernels()
    mask = _four_axes(mask)
    rows = _rows_a_block(batch, heads, span)
    if native and length <= rows and (out := graph_ops.attention(queries, keys, values, scale, mask)) is not None:
        return out  # one operation in MLX's graph (graph_ops.py), the same bits as _attention's
    if keys.dtype == mx.float16:  # a KV cache kept at float16: its values as float32 are exact
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    if native and length > rows and _foldable(mask, batch, length, span):
        # each query's scores, softmax and sum are its own: blocks give the same bits
        return mx.concatenate([_attention(queries[:, :, i : i + rows], keys, values, scale,
                                          mask[:, :, i : i + rows], True) for i in range(0, length, rows)], axis=2)
    return _attention(queries, keys, values, scale, mask, native)


def quantized_attention(queries, keys: tuple, values: tuple, scale: float, mask, group: int,
                        bits: int) -> mx.array | None:
    """`attention` over KV kept at `bits` as one operation that reads each
    sequence's KV head as float32 just before its products (graph_ops), where
    the native kernels run and the scores fit a block; the same bits as
    `attention` over the KV as float32. None where it does not take them."""
    batch, heads, length, _ = queries.shape
    if not native_kernels() or length > _rows_a_block(batch, heads, keys[0].shape[2]):
        return None
    mask = _four_axes(mask)
    if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[2] == 1 < length:  # one row for every query
        mask = mx.broadcast_to(mask, (*mask.shape[:2], length, mask.shape[3]))
    return graph_ops.quantized_attention(queries, keys, values, scale, mask, group, bits)


def _four_axes(mask):
    """A sliding window's (L, S) boolean mask as (1, 1, L, S): the shape the
    native softmax folds in; any other mask as it is."""
    if isinstance(mask, mx.array) and mask.ndim == 2 and mask.dtype == mx.bool_:
        return mask[None, None]
    return mask


def _rows_a_block(batch: int, heads: int, span: int) -> int:
    """Queries whose scores (every row and head, over `span` keys) fit SCORES_BLOCK_BYTES."""
    return max(1, SCORES_BLOCK_BYTES // (4 * batch * heads * span))


def _attention(queries, keys, values, scale: float, mask, native: bool) -> mx.array:
    batch, heads, length, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads  # query heads h*group .. h*group+group-1 read KV head h
    grouped = (queries * scale).reshape(batch, kv_heads, group * length, dim)
    scores = (grouped @ keys.swapaxes(-1, -2)).reshape(batch, heads, length, span)
    causal = isinstance(mask, str)  # "causal": query i sits at position span - length + i
    if native and _foldable(mask, batch, length, span):
        weights = native_masked_softmax(scores, mask)
        return (weights.reshape(batch, kv_heads, group * length, span) @ values).reshape(batch, heads, length, dim)
    if not causal and mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    if native:
        weights = native_softmax(scores, length if causal else 0)
        return (weights.reshape(batch, kv_heads, group * length, span) @ values).reshape(batch, heads, length, dim)
    if causal:
        allowed = mx.arange(span)[None] <= mx.arange(span - length, span)[:, None]
        scores = mx.where(allowed, scores, -mx.inf)
    if scores.size >= NUMPY_EXP_MIN:
        weights = numpy_shifted_exp(scores)
    else:
        weights = _shifted_exp(scores, scores.max(axis=-1, keepdims=True))
    out = weights.reshape(batch, kv_heads, group * length, span) @ values
    return out.reshape(batch, heads, length, dim) / weights.sum(axis=-1, keepdims=True)


def native_kernels() -> bool:
    """Attention's softmax and SwiGLU in native code (CPUs with AVX2 or AVX-512, once the
    native library is loaded: route.prepare)."""
    state = route.current()
    return state is not None and state.native_kernels.on


def _lib():
    return route.current().lib


def _in_place(scores: mx.array, compute, *also: mx.array) -> mx.array:
    """`compute(view)` over the evaluated float32 `scores` (and `also` evaluated
    with them), writing into MLX's own buffer when it is a writable row-major one,
    as a fresh matmul or mask output is, else into a copy; the scores it leaves.
    Evaluating here splits the step's graph, which costs far less than MLX's
    one-at-a-time exp."""
    mx.eval(scores, *also)
    view = np.array(scores, copy=False)
    in_place = view.flags.c_contiguous and view.flags.writeable
    if not in_place:
        view = np.ascontiguousarray(view, dtype=np.float32)
    compute(view)
    return scores if in_place else mx.array(view)


def native_softmax(scores: mx.array, causal: int) -> mx.array:
    """Softmax over the last axis of float32 `scores` in native code
    (native/softmax.c), in place when MLX's buffer allows (else on a copy): what
    `attention` runs where `native_kernels()`. With `causal` > 0 the rows are
    blocks of `causal` queries ending at the last key, and each sees the keys up
    to its own position; a row that sees nothing becomes all 0. Needs the native
    library (route.prepare)."""
    rows, cols = scores.size // scores.shape[-1], scores.shape[-1]
    return _in_place(scores, lambda view: _lib().tierlm_softmax_rows(view.ctypes.data, rows, cols, causal))


def numpy_shifted_exp(scores: mx.array) -> mx.array:
    """exp(scores - row max) by numpy's vectorized exp, in place on the evaluated
    scores (as `native_softmax` does): `attention`'s softmax over many scores on
    CPUs without the native kernels (it divides by the sum after the product by
    the values). ~5x faster than `fast_exp` over a prefill layer's scores
    (SmolLM2, 256 queries x 2,048 keys: ~20 ms against ~95 ms on an AVX2-only
    AMD EPYC), where the softmax was most of a long prefill. Results below float32's smallest normal
    number become 0, as in `fast_exp`: a denormal in a matmul is ~10x slower."""
    def shifted_exp(view: np.ndarray) -> None:
        view -= view.max(axis=-1, keepdims=True)
        np.exp(view, out=view)
        np.copyto(view, 0.0, where=view < _SMALLEST_NORMAL)

    return _in_place(scores, shifted_exp)


def _foldable(mask, batch: int, length: int, span: int) -> bool:
    """A boolean mask of one row block per batch entry or one shared, as mlx-lm's
    caches make them ((B or 1, 1, L, S)): the native softmax applies it itself."""
    return (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4
            and mask.shape[0] in (1, batch) and mask.shape[1] == 1 and mask.shape[2:] == (length, span))


def native_masked_softmax(scores: mx.array, mask: mx.array) -> mx.array:
    """`attention`'s softmax of (B, heads, L, S) float32 scores under a boolean
    (B or 1, 1, L, S) mask, as mlx-lm's caches make for a prefill, where
    `native_kernels()`: native/softmax.c with the mask applied in its first pass
    over each row, in place. What MLX's where(mask, scores, -inf) and then
    `native_softmax` give, bit for bit, without writing the scores once more
    (~40 ms a layer at 16k keys)."""
    _, heads, length, span = scores.shape

    def masked_softmax(view: np.ndarray) -> None:
        bits = np.ascontiguousarray(np.array(mask, copy=False))  # a view when it already is
        _lib().tierlm_softmax_rows_masked(view.ctypes.data, scores.size // span, span, bits.ctypes.data, heads,
                                          length, int(mask.shape[0] > 1))

    return _in_place(scores, masked_softmax, mask)


def _wrap_attention(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is not None or queries.dtype != mx.float32 or isinstance(mask, str) and mask != "causal" \
                or hasattr(cache, "bits") and not dequantize.kv_takes(cache):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        calls["attention"] += 1
        if hasattr(cache, "bits"):  # KV kept at 8 or 4 bits (engine.quantized_kv): read as float32 here
            if getattr(keys, "key_scales", None) is not None:  # keys kept divided by them (engine.key_scaling)
                queries = keys.key_scales.queries(queries)
            calls["quantized_kv"] += 1
            if (out := quantized_attention(queries, keys, values, scale, mask, cache.group_size, cache.bits)) is not None:
                return out
            keys, values = (dequantize.kv_float32(t, cache.group_size, cache.bits) for t in (keys, values))
        return attention(queries, keys, values, scale, mask)

    scaled_dot_product_attention.original = original
    return scaled_dot_product_attention


def native_swiglu(gate: mx.array, x: mx.array) -> mx.array | None:
    """silu(gate) · x of float32 arrays, the SwiGLU `install` gives mlx-lm's
    models where `native_kernels()`: native/swiglu.c into the evaluated gate
    projection, in place (mlx-lm's models pass a fresh projection output, or
    column views of a fused one); None when the two are not plain row-major
    arrays of one shape (the compiled `swiglu` takes those)."""
    mx.eval(gate, x)
    g, u = np.array(gate, copy=False), np.array(x, copy=False)
    if g.shape != u.shape or not (g.flags.c_contiguous and g.flags.writeable and u.flags.c_contiguous):
        return None
    _lib().tierlm_swiglu(g.ctypes.data, u.ctypes.data, g.size)
    return gate


def _wrap_swiglu(original):
    def float32_swiglu(gate, x):
        if gate.dtype != mx.float32 or x.dtype != mx.float32:
            return original(gate, x)
        calls["swiglu"] += 1
        if native_kernels() and (out := graph_ops.swiglu(gate, x)) is not None:
            return out  # one operation in MLX's graph, the same bits as native_swiglu's
        if native_kernels() and (out := native_swiglu(gate, x)) is not None:
            return out
        return swiglu(gate, x)

    float32_swiglu.original = original
    return float32_swiglu


_WRAPPERS = {"scaled_dot_product_attention": _wrap_attention, "swiglu": _wrap_swiglu}


def native_logsumexp(a: mx.array) -> mx.array:
    """log(sum(exp(a))) over the last axis of a (rows, cols) float32, keepdims, in
    native code (native/softmax.c): what `GenerateMx.logsumexp` runs for mlx-lm's
    per-step normalization of the logits. A row of -inf gives -inf, a nan gives nan."""
    mx.eval(a)
    view = np.ascontiguousarray(np.array(a, copy=False))  # a view when it already is
    out = np.empty((view.shape[0], 1), np.float32)
    _lib().tierlm_logsumexp_rows(view.ctypes.data, view.shape[0], view.shape[1], out.ctypes.data)
    return mx.array(out)


class GenerateMx(types.ModuleType):
    """mlx.core as mlx_lm.generate sees it once installed where `native_kernels()`
    (`install` puts one in the module's `mx`): the same, except that the
    log-sum-exp of float32 (batch, vocabulary) logits runs in native code.
    mlx-lm's BatchGenerator normalizes every decode step's logits with it, which
    took ~11 ms a step at batch 16 over SmolLM2's 49k vocabulary in MLX's
    scalar exp (~10 % of the step)."""

    def __init__(self):
        super().__init__(mx.__name__)

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def logsumexp(a, axis=None, keepdims=False, **kwargs):
        if a.dtype == mx.float32 and a.ndim == 2 and axis in (-1, 1) and keepdims and not kwargs:
            calls["logsumexp"] += 1
            out = graph_ops.logsumexp(a)  # in the graph: the next step can be queued while this one runs
            return out if out is not None else native_logsumexp(a)
        return mx.logsumexp(a, axis=axis, keepdims=keepdims, **kwargs)


_GELU_C = math.sqrt(2 / math.pi)


def numpy_gelu(x: mx.array) -> mx.array:
    """GELU (tanh approximation) of a float32 by numpy's vectorized exp, into a
    new array: what `ModelNn.gelu_approx` runs where the native kernels are off.
    0.5·(1 + tanh z) is 1 / (1 + exp(-2z)), z = √(2/π)·(x + 0.044715·x³). One Gemma 3 MLP activation
    of 256 × 2,048 took ~19 ms in MLX's scalar tanh, ~4 ms this way (AVX2-only
    AMD EPYC), within 5e-7 of it."""
    mx.eval(x)
    v = np.array(x, copy=False)
    t = v * v  # then -2z, in place
    t *= -2 * _GELU_C * 0.044715
    t -= 2 * _GELU_C
    t *= v
    with np.errstate(over="ignore"):  # exp(-2z) = inf far below zero: x / inf, GELU's limit 0
        np.exp(t, out=t)
    t += 1
    return mx.array(np.divide(v, t, out=t))


def native_gelu(x: mx.array) -> mx.array:
    """GELU (tanh approximation) of a float32 in native code (native/swiglu.c),
    into a new array: what `ModelNn.gelu_approx` runs where `native_kernels()`."""
    mx.eval(x)
    view = np.ascontiguousarray(np.array(x, copy=False))  # a view when it already is
    out = np.empty(view.shape, np.float32)
    _lib().tierlm_gelu_approx(view.ctypes.data, out.ctypes.data, view.size)
    return mx.array(out)


def gelu_erf(x: mx.array) -> mx.array:
    """BERT's exact GELU, x·Φ(x) = 0.5·x·(1 + erf(x/√2)), of an evaluated
    float32, into a new array: erf by Abramowitz and Stegun's 7.1.26 (error
    ≤ 1.5e-7), in native code (native/swiglu.c) where the CPU allows, else by
    numpy's vectorized exp. An encoder's activation of 64 × 20 × 1,536 took
    ~48 ms in MLX's scalar erf, ~17 ms through numpy (AMD EPYC, AVX-512)."""
    mx.eval(x)
    if native_kernels():
        calls["gelu"] += 1
        view = np.ascontiguousarray(np.array(x, copy=False))  # a view when it already is
        out = np.empty(view.shape, np.float32)
        _lib().tierlm_gelu_erf(view.ctypes.data, out.ctypes.data, view.size)
        return mx.array(out)
    v = np.array(x, copy=False)
    z = np.abs(v) * np.float32(1 / math.sqrt(2))
    t = 1 / (1 + np.float32(0.3275911) * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1 - poly * np.exp(-z * z)
    return mx.array(0.5 * v * (1 + np.copysign(erf, v)))


# Below this many elements (decode steps) MLX's own GELU stays: its ~20 ns an
# element costs less than splitting the step's graph to run native code.
NATIVE_GELU_MIN = 1 << 16


class ModelNn(types.ModuleType):
    """mlx.nn as an mlx-lm model module sees it once installed (`install` puts
    one in the module's `nn`): the same, except that `gelu_approx` of float32
    runs in native code (numpy's exp without the native kernels). MLX's tanh on this backend is scalar: Gemma 3's MLP
    activation took ~20 ns an element, ~40 % of a prefill chunk at the start of
    a prompt (0.2 ms in native code)."""

    def __init__(self):
        super().__init__(nn.__name__)

    def __getattr__(self, name):
        return getattr(nn, name)

    @staticmethod
    def gelu_approx(x):
        if x.dtype == mx.float32 and native_kernels() and (out := graph_ops.gelu_approx(x)) is not None:
            calls["gelu"] += 1
            return out  # one operation in MLX's graph, at any size
        if x.dtype == mx.float32 and x.size >= NATIVE_GELU_MIN:
            calls["gelu"] += 1
            return native_gelu(x) if native_kernels() else numpy_gelu(x)
        return nn.gelu_approx(x)


def install(model: nn.Module) -> list[str]:
    """Use these kernels in the mlx-lm modules `model` is built from; returns the
    names replaced (module.function). Only on MLX's CPU device."""
    if mx.default_device() != mx.cpu:
        return []
    replaced = []
    for module in mlx_lm_modules(model):
        for name, wrap in _WRAPPERS.items():
            current = getattr(module, name, None)
            if current is None:
                continue
            if not hasattr(current, "original"):
                setattr(module, name, wrap(current))
            replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
        if getattr(module, "nn", None) is nn:
            module.nn = ModelNn()
        if isinstance(getattr(module, "nn", None), ModelNn) and _calls_gelu(module):
            replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.gelu_approx")
    if native_kernels():
        mlx_lm_generate().mx = GenerateMx()
        replaced.append("generate.logsumexp")
        if graph_ops.install().on and graph_ops.install_norms(model):
            replaced.append("nn.RMSNorm")
    if rope.install(model)[0]:
        replaced.append("nn.RoPE")
    return replaced


def _calls_gelu(module) -> bool:
    try:
        return "nn.gelu_approx" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def uninstall(model: nn.Module) -> None:
    """Put mlx-lm's own functions back (for comparisons)."""
    mlx_lm_generate().mx = mx
    rope.uninstall(model)
    graph_ops.uninstall_norms(model)
    for module in mlx_lm_modules(model):
        if isinstance(getattr(module, "nn", None), ModelNn):
            module.nn = nn
        for name in _WRAPPERS:
            current = getattr(module, name, None)
            if hasattr(current, "original"):
                setattr(module, name, current.original)
