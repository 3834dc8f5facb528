"""tierlm's own MLX operations on the CPU: RMSNorm, RoPE, attention, SwiGLU,
GELU and the logits' log-sum-exp as one node of MLX's graph each
(native/graph_ops.cpp).

An MLX operation on this backend costs a few microseconds whatever its size,
and `mx.fast.rms_norm` and `mx.fast.rope` have no CPU kernel: their fallback
graphs are many operations, twice a layer each; attention was about ten and
an evaluation. SwiGLU, GELU and the logits' log-sum-exp ran in native code
on evaluated arrays (kernels.py), so each split the step's graph: the next
step could not be queued while one ran (mlx-lm's BatchGenerator builds step
n + 1 while step n computes). graph_ops.cpp defines these as MLX primitives in C++ (built against
the installed mlx package, as qmm_hook.cpp is) and makes their arrays from the
`mx.array` objects Python passes by address; the arrays stay lazy, so nothing
splits the step's graph.

Finding the C++ array inside a Python `mx.array` reads nanobind's instance
layout: this is the one place that does. `install()` proves it on arrays of
known shapes and checks each operation against MLX's own (or, for attention,
kernels.attention's) before anything uses them; otherwise they stay off and
say why.

Each function returns None for what it does not take; the callers
(`NativeRMSNorm`, rope.FewerOpsRoPE, kernels.py) then compute it another way.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import mlx.core as mx
from mlx import nn

from tierlm.backends.cpu import native, route
from tierlm.backends.cpu.route import Feature

SOURCE = native.HERE / "graph_ops.cpp"

_lock = threading.Lock()
_feature: Feature | None = None
_lib: ctypes.CDLL | None = None


def install() -> Feature:
    """Builds, loads and proves graph_ops.cpp once per process; later calls
    return the same answer. Never raises: says why it is off.
    TIERLM_GRAPH_OPS=off keeps MLX's fallback graphs."""
    global _feature
    with _lock:
        if _feature is None:
            if os.environ.get("TIERLM_GRAPH_OPS", "on") == "off":
                _feature = Feature(False, "turned off by TIERLM_GRAPH_OPS=off")
            else:
                try:
                    _feature = _install()
                except Exception as e:  # noqa: BLE001  optional: a bug here must not stop the model
                    _feature = Feature(False, f"setting it up failed: {type(e).__name__}: {e}")
        return _feature


def state() -> Feature:
    """What install() found, or why it has not run."""
    return _feature if _feature is not None else Feature(False, "not set up (the native kernels are off)")


def decided() -> bool:
    """Whether install() has run in this process (its library built or not)."""
    return _feature is not None


def on() -> bool:
    return _feature is not None and _feature.on


def ran() -> int:
    """Operations graph_ops.cpp computed so far in this process."""
    return int(_lib.tierlm_graph_ran()) if _lib is not None else 0


def build() -> Path:
    """graph_ops.cpp compiled against the installed mlx, once per source and mlx version."""
    return native.build_against_mlx("tierlm_graph_ops", SOURCE, "-ffp-contract=off")


def _load() -> ctypes.CDLL:
    path = build()
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        raise native.BuildError(f"could not load it: {e}") from e
    lib.tierlm_graph_probe.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int)]
    lib.tierlm_graph_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float]
    lib.tierlm_graph_rope.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    lib.tierlm_graph_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.tierlm_graph_quantized_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float] + [ctypes.c_int] * 3
    lib.tierlm_graph_set_kernels.argtypes = [ctypes.c_void_p] * 5
    lib.tierlm_graph_ran.restype = ctypes.c_ulong
    lib.tierlm_graph_qmm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2
    lib.tierlm_graph_set_elementwise.argtypes = [ctypes.c_void_p] * 3
    lib.tierlm_graph_swiglu.argtypes = [ctypes.c_void_p] * 3
    lib.tierlm_graph_gelu_approx.argtypes = [ctypes.c_void_p] * 2
    lib.tierlm_graph_logsumexp.argtypes = [ctypes.c_void_p] * 2
    return lib


def _install() -> Feature:
    global _lib
    try:
        lib = _load()
    except native.BuildError as e:
        return Feature(False, f"could not build or load graph_ops.cpp: {e}")
    if (why := _finds_arrays(lib)) is not None:
        return Feature(False, why)
    state = route.current()
    if state is None or state.lib is None or not state.native_kernels.on:
        return Feature(False, "the native kernels are off")
    # attention over float16 KV only where its float32 products go to exact_gemm.c too (same bits)
    exact_half = native.function_address(state.lib, "tierlm_exact_sgemm_half") if state.exact_attention.on else None
    lib.tierlm_graph_set_kernels(*(native.function_address(state.lib, name) for name in (
        "cblas_sgemm", "tierlm_softmax_rows", "tierlm_softmax_rows_masked", "tierlm_parallel_chunks")), exact_half)
    lib.tierlm_graph_set_elementwise(*(native.function_address(state.lib, name) for name in (
        "tierlm_swiglu", "tierlm_gelu_approx", "tierlm_logsumexp_rows")))
    _lib = lib
    if (why := _computes_mlx_answers()) is not None:
        _lib = None
        return Feature(False, why)
    return Feature(True, "RMSNorm, RoPE, attention, SwiGLU, GELU and log-sum-exp as one MLX operation each")


def _finds_arrays(lib: ctypes.CDLL) -> str | None:
    """Why the C++ arrays inside Python's mx.array objects are not where
    graph_ops.cpp reads them (nanobind's layout), or None: an evaluated array
    and a lazy one, of known shapes and dtypes."""
    for a in (mx.zeros((3, 5, 7), mx.int16), mx.ones((2, 9)) * 2):
        shape, size = (ctypes.c_int64 * 8)(), ctypes.c_int()
        ndim = lib.tierlm_graph_probe(id(a), shape, ctypes.byref(size))
        if ndim != a.ndim or tuple(shape[:ndim]) != a.shape or size.value != a.itemsize:
            return "the C++ array inside an mx.array is not where nanobind 2.x keeps it"
    return None


def _computes_mlx_answers() -> str | None:
    """Why these operations would not give MLX's answers, or None: RMSNorm
    within float32 rounding, RoPE and attention bit for bit."""
    x = mx.random.normal((2, 3, 40), key=mx.random.key(1))
    weight = mx.random.normal((40,), key=mx.random.key(2))
    got = rms_norm(x.swapaxes(0, 1), weight, 1e-5)
    if got is None or not mx.allclose(got, mx.fast.rms_norm(x.swapaxes(0, 1), weight, 1e-5), rtol=1e-5,
                                      atol=1e-6).item():
        return "its RMSNorm differs from mx.fast.rms_norm's"
    if (why := _rope_differs()) is not None:
        return why
    if (why := _elementwise_differs()) is not None:
        return why
    return _attention_differs()


def _elementwise_differs() -> str | None:
    """Why `swiglu`, `gelu_approx` or `logsumexp` would not give the bits of
    the native kernels run on evaluated arrays (kernels.py), or None: strided
    and contiguous inputs, a length that is no whole number of vectors."""
    from tierlm.backends.cpu import kernels  # kernels.py imports this module

    gate = mx.random.normal((3, 37), key=mx.random.key(8)) * 4
    x = mx.random.normal((37, 3), key=mx.random.key(9)).T  # strided
    for g in (gate, gate + 0):  # the second one's buffer may be taken over
        got = swiglu(g, x)
        if got is None or not mx.array_equal(got, kernels.native_swiglu(gate + 0, mx.contiguous(x))).item():
            return "its SwiGLU differs from native/swiglu.c's on evaluated arrays"
    got = gelu_approx(x)
    if got is None or not mx.array_equal(got, kernels.native_gelu(x)).item():
        return "its GELU differs from native/swiglu.c's on evaluated arrays"
    logits = mx.concatenate([x, mx.full((3, 2), -mx.inf)], axis=1)
    got = logsumexp(logits)
    if got is None or not mx.array_equal(got, kernels.native_logsumexp(logits)).item():
        return "its log-sum-exp differs from native/softmax.c's on evaluated arrays"
    return None


def _rope_differs() -> str | None:
    """Why `rope` would not give mx.fast.rope's bits (MLX's CPU fallback), or
    None: a strided prefill chunk and decode steps, one offset or one per batch
    entry, both pairings, a scale, a head wider than the rotated part."""
    from tierlm.backends.cpu.rope import inverse_frequencies  # rope.py imports this module

    x = mx.random.normal((3, 5, 2, 20), key=mx.random.key(3)).transpose(0, 2, 1, 3)  # (B, H, T, D) strided
    for traditional, scale, offset in ((False, 1.0, 0), (True, 1.0, 4093), (False, 0.25, mx.array([5, 811, 30000])),
                                       (True, 1.0, mx.array([7])), (False, 1.0, mx.array(12))):
        for tokens in (1, 5):
            part = x[:, :, :tokens]
            got = rope(part, inverse_frequencies(16, 10000.0), offset, 16, traditional, scale)
            want = mx.fast.rope(part, 16, traditional=traditional, base=10000.0, scale=scale, offset=offset)
            if got is None or not mx.array_equal(got, want).item():
                return f"its RoPE differs from mx.fast.rope's (traditional={traditional}, scale {scale}, {tokens} tokens)"
    return None


def _attention_differs() -> str | None:
    """Why `attention` would not give kernels.attention's bits, or None:
    grouped heads, strided keys, with each kind of mask."""
    from tierlm.backends.cpu.kernels import _attention  # kernels.py imports this module

    keys = mx.random.normal((2, 9, 2, 16), key=mx.random.key(5)).transpose(0, 2, 1, 3)  # (B, KV, S, D), strided
    values = mx.random.normal((2, 2, 9, 16), key=mx.random.key(6))
    mask = mx.random.uniform(shape=(2, 1, 3, 9), key=mx.random.key(7)) > 0.3
    for length, mask_of in ((1, None), (3, "causal"), (3, mask), (3, mask[:1])):
        queries = mx.random.normal((2, 6, length, 16), key=mx.random.key(length))
        got = attention(queries, keys, values, 0.25, mask_of)
        if got is None or not mx.array_equal(got, _attention(queries, keys, values, 0.25, mask_of, True)).item():
            return f"its attention differs from kernels.attention's ({length} queries, mask {type(mask_of).__name__})"
    return None


def _result(code: int, out: mx.array) -> mx.array | None:
    return out if code == 0 else None


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """mx.fast.rms_norm(x, weight, eps) of float32 arrays as one operation, or
    None (off, or inputs it does not take)."""
    if _lib is None:
        return None
    out = mx.array(0.0)  # its array becomes the result
    return _result(_lib.tierlm_graph_rms_norm(id(x), id(weight), id(out), eps), out)


def rope(x: mx.array, inverse: mx.array, offset: int | mx.array, dims: int, traditional: bool,
         scale: float) -> mx.array | None:
    """mx.fast.rope of float32 (B, H, T, D) `x` as one operation, angles
    included (`inverse`: its float32 inverse frequencies), bit for bit what
    MLX's fallback gives; `offset` a number or an int32 array (one, or one per
    batch entry). None for anything else."""
    if _lib is None:
        return None
    offsets = offset if isinstance(offset, mx.array) else None
    if offsets is None and not -2**31 <= offset < 2**31:
        return None
    out = mx.array(0.0)
    code = _lib.tierlm_graph_rope(id(x), id(inverse), id(offsets) if offsets is not None else None, id(out), dims,
                                  int(traditional), scale, 0 if offsets is not None else offset)
    return _result(code, out)


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group: int,
                     bits: int) -> mx.array | None:
    """x times the affine-quantized `weight` transposed, its scales and
    biases float16, as MLX's QuantizedMatmul made directly (MLX's op would
    widen them every call); None for anything else. Only for products
    quantized.takes() says the hook computes."""
    if _lib is None:
        return None
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_qmm(id(x), id(weight), id(scales), id(biases), id(out), group, bits), out)


def swiglu(gate: mx.array, x: mx.array) -> mx.array | None:
    """silu(gate) · x of float32 arrays of one shape as one operation, bit for
    bit native/swiglu.c's; None for anything else."""
    if _lib is None:
        return None
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_swiglu(id(gate), id(x), id(out)), out)


def gelu_approx(x: mx.array) -> mx.array | None:
    """GELU (tanh approximation) of a float32 as one operation, bit for bit
    native/swiglu.c's; None for anything else."""
    if _lib is None:
        return None
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_gelu_approx(id(x), id(out)), out)


def logsumexp(x: mx.array) -> mx.array | None:
    """log(sum(exp(x))) over the last axis of a float32 (rows, cols), keepdims,
    as one operation, bit for bit native/softmax.c's; None for anything else."""
    if _lib is None:
        return None
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_logsumexp(id(x), id(out)), out)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
    """softmax(q kᵀ · scale + mask) v of float32 (B, H, L, D) queries and (B,
    KV, S, D) keys and values as one operation, bit for bit what
    kernels.attention computes with the native kernels; `mask` None, "causal"
    or a boolean (B or 1, 1, L, S) array. Keys and values may both be float16
    (a KV cache kept at float16) where attention's products run in
    exact_gemm.c: read as they are, with the bits of the same attention over
    them as float32. None for anything else."""
    if _lib is None or isinstance(mask, str) and mask != "causal":
        return None
    array_mask, causal = _mask_args(mask)
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_attention(id(queries), id(keys), id(values), array_mask, id(out), scale, causal),
                   out)


def _mask_args(mask) -> tuple:
    """An attention mask as the native attentions take it: the array's object
    (None: no array), and whether it is "causal"."""
    return (id(mask), 0) if isinstance(mask, mx.array) else (None, int(mask == "causal"))


def quantized_attention(queries: mx.array, keys: tuple, values: tuple, scale: float, mask, group: int,
                        bits: int) -> mx.array | None:
    """`attention` over keys and values kept at `bits` in groups of `group`
    (MLX's affine (codes, scales, biases), float32 scales), each sequence's KV
    head read as float32 just before its products: the same bits as `attention`
    over `dequantize.kv_float32` of them, without that copy of the whole
    context. None for anything it does not take."""
    if _lib is None or isinstance(mask, str) and mask != "causal":
        return None
    triples = [(ctypes.c_void_p * 3)(*(id(a) for a in t)) for t in (keys, values)]
    array_mask, causal = _mask_args(mask)
    out = mx.array(0.0)
    return _result(_lib.tierlm_graph_quantized_attention(id(queries), *triples, array_mask, id(out), scale, causal,
                                                         group, bits), out)


class NativeRMSNorm(nn.RMSNorm):
    """An `nn.RMSNorm` whose instances `install_norms` switched to this class: same fields."""

    def __call__(self, x):
        out = rms_norm(x, self["weight"], self.eps)
        return out if out is not None else super().__call__(x)


def install_norms(model: nn.Module) -> int:
    """Switches the model's `nn.RMSNorm` modules (that class exactly) to
    NativeRMSNorm where these operations are on; returns how many."""
    return _switch(model, lambda m: type(m) is nn.RMSNorm, NativeRMSNorm)


def uninstall_norms(model: nn.Module) -> None:
    _switch(model, lambda m: type(m) is NativeRMSNorm, nn.RMSNorm)


def _switch(model: nn.Module, chosen, to: type) -> int:
    """Switches the class of the model's modules `chosen(module)` picks to `to`
    (same fields, another __call__) where these operations are on, or back to
    mlx's own classes whatever their state; returns how many."""
    if to.__module__ == __name__ and not on():
        return 0
    modules = [m for _, m in model.named_modules() if chosen(m)]
    for module in modules:
        module.__class__ = to
    return len(modules)


class HalfScalesQuantizedLinear(nn.QuantizedLinear):
    """An `nn.QuantizedLinear` with float16 scales and biases, switched to this
    class by `install_half_scales`: its product reads them as they are."""

    def __call__(self, x):
        out = quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


def install_half_scales(model: nn.Module, takes) -> int:
    """Switches the model's `nn.QuantizedLinear` modules (that class exactly)
    whose scales and biases are float16 and whose products `takes(module)` to
    HalfScalesQuantizedLinear where these operations are on; returns how many."""
    def chosen(m) -> bool:
        return (type(m) is nn.QuantizedLinear and takes(m) and m["scales"].dtype == mx.float16
                and m.get("biases") is not None and m["biases"].dtype == mx.float16)

    return _switch(model, chosen, HalfScalesQuantizedLinear)


def uninstall_half_scales(model: nn.Module) -> None:
    _switch(model, lambda m: type(m) is HalfScalesQuantizedLinear, nn.QuantizedLinear)
