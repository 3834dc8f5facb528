"""MLX's CPU backend, made fast.

MLX's Linux CPU wheel computes with a bundled reference BLAS, its 4-bit matmul
does not get faster with batch size, and its element-wise kernels are scalar.
For a model on MLX's CPU backend this room arranges, when the model is loaded:

- route.py: a real BLAS (OpenBLAS) behind tierlm's sgemm route, put in the slot
  through which MLX's library calls `cblas_sgemm` (got.py), and proved by one
  counted product (the self-check);
- native.py, native/: the C behind it (the route, AMX tiles, attention's
  fixed-order products shared over the cores, softmax, SwiGLU, GELU,
  log-sum-exp), built once into the user's cache;
- quantized.py: MLX's quantized matmul on tierlm's kernels (qgemm.c and
  qgemm_float.c: float32 products with AVX-512 or AVX2, int8 ones by name or in
  plain C; behind MLX's own operation by qmm_hook.cpp);
- int8.py: int8 activations (AVX-512 VNNI) for the quantized models a probe at
  load finds they barely move;
- weights.py: quantized models kept quantized where those kernels take their
  format, else the weights in float32 when they fit (MLX sends only float32
  matmuls to BLAS);
- kernels.py: attention, SwiGLU and GELU for float32, in native code where the
  CPU has AVX2 or AVX-512 (native/float_kernels.c: one source, both widths);
- rope.py: mlx-lm's RoPE in fewer MLX operations, bit for bit mx.fast.rope's;
- graph_ops.py: RMSNorm, RoPE and attention as one MLX operation
  each (tierlm's own MLX primitives, native/graph_ops.cpp);
- amx.py: bfloat16 copies of the weights on AMX tiles, where the CPU has them;
- isa.py: TIERLM_MAX_CPU_ISA, which hides the CPU's newer features from the
  native code (an AVX-512 machine choosing its kernels as an AVX2 one would).

`prepare(model, ...)` is the one entry point (tierlm.backends.prepare calls it
for a model on MLX's CPU device); it returns the `Backend` description the
engine reads. Importing this package compiles and loads nothing.
docs/cpu-backend.md has the whole story and its measurements.
"""

from __future__ import annotations

from tierlm.backends import Backend

# Prompt tokens per prefill chunk. Attention over a whole chunk dominates long
# prefills here, and smaller chunks skip most of the masked-out half: a
# 2,048-token prompt prefilled 1.5x faster in chunks of 256 than in one chunk
# (measured on SmolLM2, 2 cores).
PREFILL_STEP = 256

# What the prefix cache's keys get when the products run in bfloat16 on AMX:
# other arithmetic, other KV (the same bytes as before this room existed, so
# stored blocks stay valid).
AMX_LAYOUT_TAG = b" products: bfloat16 on AMX"


def prepare(model, *, weights_dtype: str = "auto", memory_bytes: int, kernels: bool = True,
            amx: bool = True, probe_tokens: list[int] | None = None) -> Backend:
    """Sets up the fast path for `model` on MLX's CPU device, in place: the BLAS
    and the route (once per process), the weights' dtype, the kernels, the AMX
    copies. `weights_dtype`, `kernels` and `amx` are --cpu-weights-dtype,
    --cpu-kernels and --cpu-amx; `probe_tokens`: a reference text's tokens for
    int8.choose (None: float32 products only)."""
    from tierlm.backends.cpu import amx as amx_tiles
    from tierlm.backends.cpu import kernels as cpu_kernels
    from tierlm.backends.cpu import graph_ops, int8, isa, native, quantized, route, weights
    from tierlm.backends.cpu.route import Feature

    # the C++ libraries compile beside the C one, the first time (native.in_background)
    native.in_background(*([] if quantized.decided() or not quantized.wanted() else [quantized.build_hook]),
                         *([] if graph_ops.decided() or not kernels else [graph_ops.build]))
    state = route.prepare()
    products = quantized.install(state.lib)
    dtype = weights.apply(weights_dtype, model, memory_bytes)
    replaced = cpu_kernels.install(model) if kernels else []
    half = weights.settle_half_scales(model, quantized.reads_half_scales()) if dtype == "quantized" else 0
    packed = amx_tiles.pack(model) if amx else 0
    if dtype != "quantized" or not kernels:
        int8_state, int8_on = Feature(False, f"weights {dtype}" if kernels else "--no-cpu-kernels"), False
    else:
        int8_state, int8_on = int8.choose(model, probe_tokens)
    packed_bytes = amx_tiles.packed_bytes(model)

    blas = state.blas_path or f"bundled reference ({state.blas.detail})"
    log = [(f"CPU fast path: weights {dtype} (setting {weights_dtype}); BLAS {blas}, route {state.route}, "
            f"one-row gemv route {state.gemv}, AMX {state.amx}, exact attention products "
            f"{state.exact_attention}, native kernels {state.native_kernels}"),
           f"CPU fast path self-check: {state.self_check}",
           f"CPU quantized kernels: {products}"
           + (f"; {half} layers read their float16 scales as stored" if half else ""),
           f"CPU int8 activations: {int8_state}"]
    if not kernels:
        log.append("CPU kernels off (--no-cpu-kernels): mlx-lm's attention and SwiGLU")
    elif replaced:
        log.append(f"CPU kernels in use for float32: {', '.join(replaced)}; graph operations {graph_ops.state()}")
    if amx_tiles.available() and not amx:
        log.append("AMX off (--no-cpu-amx): float32 matmuls through the BLAS")
    elif packed:
        log.append(f"AMX: {packed} float32 weights packed as bfloat16 tiles ({packed_bytes / 2**20:.0f} MiB)")
    warnings = (state.warning,) if state.warning else ()

    summary = {
        "weights": dtype,
        "blas": blas,
        "route": str(state.route),
        "self_check": state.self_check,
        "warning": state.warning,
        "gemv_route": str(state.gemv),
        "exact_attention": str(state.exact_attention),
        "amx": str(state.amx),
        "amx_packed_weights": packed,
        "native_kernels": str(state.native_kernels),
        "quantized_kernels": str(products),
        "half_scale_layers": half,  # quantized layers reading their float16 scales as stored
        "int8_activations": str(int8_state),  # this model's products with int8 activations, and why
        "kernels": replaced,
        "graph_ops": str(graph_ops.state()) if kernels else "off (--no-cpu-kernels)",
        "max_cpu_isa": isa.cap(state.lib) if state.lib is not None else None,  # TIERLM_MAX_CPU_ISA as applied
    }

    def counters() -> dict:
        python = dict(cpu_kernels.calls)  # one copy under the GIL; the worker thread may be counting
        return {"calls": {**state.counts(), **{f"kernel_{k}": v for k, v in python.items()},
                          "quantized_hook": quantized.taken(), "quantized_left_to_mlx": quantized.left_to_mlx()}}

    # tierlm's products of quantized weights (AVX-512 VNNI, AVX-512 or AVX2) and
    # its attention products sum each output in one fixed order; a BLAS's gemv
    # and gemm do not
    invariant = dtype == "quantized" and quantized.keeps_weights_quantized() and state.exact_attention.on
    summary["batch_invariant"] = invariant
    # both where both: a model's float32 layers on AMX and its quantized ones with int8 activations
    layout_tag = (AMX_LAYOUT_TAG if packed else b"") + (int8.LAYOUT_TAG if int8_on else b"")
    return Backend(name="cpu", extra_bytes=packed_bytes + int8.laid_bytes(model), layout_tag=layout_tag,
                   batch_invariant=invariant, log=tuple(log), warnings=warnings, summary=summary,
                   counters=counters)
