"""The CPU fast path: the BLAS and the route in front of it (one-row products,
AMX bfloat16 products), the native softmax and the exp-based kernels."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from tiny_models import tiny_model

from tierlm.backends.cpu import amx as cpu_amx
from tierlm.backends.cpu import kernels as cpu_kernels
from tierlm.backends.cpu import route as cpu_blas
from tierlm.backends.cpu import weights as cpu_weights
from tierlm.engine.core import parameter_layout

OPENBLAS = cpu_blas.CANDIDATES[0]
needs_route = pytest.mark.skipif(
    shutil.which("cc") is None or not sys.platform.startswith("linux"), reason="needs Linux and a C compiler")
needs_amx = pytest.mark.skipif(cpu_blas.status["amx"] != "available", reason="no AMX-BF16 here")
NATIVE_SOFTMAX = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.native_kernels(), reason="no AVX-512 here"))]


def _status_in_fresh_process(**env) -> dict:
    code = "import json, tierlm; from tierlm.backends.cpu import route; print(json.dumps(route.status))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@needs_route
def test_openblas_loads_behind_the_route():
    status = cpu_blas.status
    assert (status["library"], status["reason"], status["gemv_route"]) == (OPENBLAS, "loaded", "on")
    assert status["amx"] == "available" or status["amx"].startswith("off (no AMX-BF16")
    assert status["attention"] == "avx512" or status["attention"].startswith("off (no AVX-512")


@needs_route
def test_route_and_blas_can_be_turned_off():
    assert _status_in_fresh_process(TIERLM_GEMV_ROUTE="off")["gemv_route"].startswith("off")
    assert _status_in_fresh_process(TIERLM_GEMV_ROUTE="off")["library"] == OPENBLAS
    assert _status_in_fresh_process(TIERLM_BLAS="off")["library"] is None


@needs_route
def test_without_a_compiler_the_blas_still_loads(tmp_path):
    status = _status_in_fresh_process(CC="/nonexistent/cc", XDG_CACHE_HOME=str(tmp_path))
    assert status["library"] == OPENBLAS
    assert status["gemv_route"].startswith("off (could not build")


@needs_route
def test_a_compiler_without_amx_builds_the_rest(tmp_path):
    """An older compiler fails on the AMX intrinsics (a fault this machine's
    compiler cannot cause, so a stand-in refuses the build that has them)."""
    old_cc = tmp_path / "old-cc"
    old_cc.write_text('#!/bin/sh\ncase "$*" in *TIERLM_NO_AMX*) exec cc "$@";; esac\necho no AMX >&2; exit 1\n')
    old_cc.chmod(0o755)
    status = _status_in_fresh_process(CC=str(old_cc), XDG_CACHE_HOME=str(tmp_path))
    assert status["gemv_route"] == "on"
    assert status["amx"] == "off (the C compiler has no AMX intrinsics)"


@pytest.mark.parametrize("rows,cols", [(1, 80), (3, 80), (9, 80), (9, 64), (600, 700)])
def test_float32_matmuls_match_numpy_in_every_layout(rows, cols):
    """Every route the sgemm route has: one-row products through sgemv, small
    products through the exact kernels (eight-row and two-row blocks and their
    tails, the 64-wide path), large ones through the BLAS, in every transpose
    combination MLX emits. All must give numpy's answer."""
    rng = np.random.default_rng(rows)
    a, w = rng.standard_normal((rows, 96), np.float32), rng.standard_normal((cols, 96), np.float32)
    c = rng.standard_normal((rows, cols), np.float32)
    A, W, C = mx.array(a), mx.array(w), mx.array(c)
    expected = a @ w.T
    cases = {
        "a @ w.T": A @ W.T,
        "a @ contiguous(w.T)": A @ mx.contiguous(W.T),
        "transposed a": mx.contiguous(A.T).T @ W.T,
        "addmm": mx.addmm(C, A, W.T, alpha=0.5, beta=2.0),
    }
    for name, got in cases.items():
        want = 0.5 * expected + 2.0 * c if name == "addmm" else expected
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4, err_msg=name)


def _bfloat16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to bfloat16 (nearest, ties to even), as float64."""
    bits = a.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.view(np.float32).astype(np.float64)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_packed_weight_multiplies_in_bfloat16_on_amx(rows):
    """80 x 96: five 16-column blocks (one left over after the pairs) and three
    32-deep steps (one left over); 33 rows take the two-row-block path too."""
    rng = np.random.default_rng(rows)
    a, w = rng.standard_normal((rows, 96), np.float32), rng.standard_normal((80, 96), np.float32)
    c = rng.standard_normal((rows, 80), np.float32)
    A, W, C = mx.array(a), mx.array(w), mx.array(c)
    mx.eval(W)
    address = np.array(W, copy=False).ctypes.data
    assert cpu_blas.native.tierlm_amx_pack(address, 80, 96)
    try:
        got, got_addmm = np.array(A @ W.T), np.array(mx.addmm(C, A, W.T, alpha=0.5, beta=2.0))
    finally:
        cpu_blas.native.tierlm_amx_unpack(address)
    want = _bfloat16(a) @ _bfloat16(w).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_addmm, 0.5 * want + 2.0 * c, rtol=1e-4, atol=1e-4)
    exact = a.astype(np.float64) @ w.T.astype(np.float64)
    assert not np.allclose(got, exact, rtol=1e-4, atol=1e-4)  # bfloat16, so not the BLAS's answer
    np.testing.assert_allclose(np.array(A @ W.T), exact, rtol=1e-4, atol=1e-4)  # unpacked: the BLAS again


@needs_amx
def test_a_packed_model_keeps_its_logits_and_frees_its_copies():
    model = tiny_model("llama")
    want = _logits_through_a_cache(model)
    mx.eval(want)  # before packing: MLX is lazy
    layout = parameter_layout(model)
    assert cpu_amx.pack(model) == 2 * 7 + 1  # seven Linears a layer, and the tied embedding
    assert parameter_layout(model) != layout  # other arithmetic, other KV: other prefix-cache keys
    assert cpu_amx.packed_bytes(model) == sum(w.size * 2 for w in cpu_amx._matmul_weights(model))
    got = _logits_through_a_cache(model)
    for w, g in zip(want, got):
        assert not mx.array_equal(g, w).item()
        assert mx.allclose(g, w, rtol=0.05, atol=0.05).item()
    model_id = id(model)
    del model
    gc.collect()
    assert model_id not in cpu_amx._packed_bytes


def test_fast_exp_is_close_to_exp_and_exactly_zero_far_below():
    x = mx.linspace(-87, 88, 200_001)
    rel = mx.abs(cpu_kernels.fast_exp(x) / mx.exp(x) - 1)
    assert mx.max(rel).item() < 5e-5
    tiny = cpu_kernels.fast_exp(mx.array([-88.0, -1e4, -mx.inf]))
    assert tiny.tolist() == [0.0, 0.0, 0.0]  # no denormals: they make BLAS crawl


def _qkv(batch, heads, kv_heads, length, span, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, length, 32)), mx.random.normal((batch, kv_heads, span, 32)),
            mx.random.normal((batch, kv_heads, span, 32)))


@pytest.mark.parametrize("native", NATIVE_SOFTMAX)
@pytest.mark.parametrize("length,span,mask_kind", [
    (1, 40, None), (7, 7, "causal"), (5, 40, "causal"), (6, 30, "bool"), (6, 30, "additive"),
])
def test_attention_matches_mlx(length, span, mask_kind, native):
    q, k, v = _qkv(2, 6, 2, length, span)
    mask = mask_kind
    if mask_kind == "bool":
        mask = mx.random.uniform(shape=(2, 1, length, span)) > 0.3
        mask[..., -1] = True  # every row keeps one position, as real masks do
    elif mask_kind == "additive":
        mask = mx.random.normal((1, 1, length, span))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    got = cpu_kernels.attention(q, k, v, 0.2, mask, native=native)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("native", NATIVE_SOFTMAX)
def test_attention_is_bit_exact_alone_and_left_padded_in_a_batch(native):
    """Batched prefill masks left padding and the causal future with an array;
    alone the mask is "causal". The outputs must be identical, not just close:
    greedy output and cached KV must not depend on what else ran."""
    q, k, v = _qkv(1, 6, 2, 9, 23)
    alone = cpu_kernels.attention(q, k, v, 0.2, "causal", native=native)
    for pad in (1, 5, 16, 17):
        zeros = mx.zeros((1, 2, pad, 32))
        span = 23 + pad
        visible = (mx.arange(span)[None] <= mx.arange(span - 9, span)[:, None]) & (mx.arange(span)[None] >= pad)
        batched = cpu_kernels.attention(q, mx.concatenate([zeros, k], axis=2), mx.concatenate([zeros, v], axis=2),
                                        0.2, visible[None, None], native=native)
        assert mx.array_equal(batched, alone).item(), f"left padding {pad}"


@pytest.mark.skipif(not cpu_kernels.native_kernels(), reason="no AVX-512 here")
def test_native_logsumexp_matches_mlx_and_serves_mlx_lms_batch_step():
    import sys

    logits = mx.random.normal((4, 1000)) * 20
    logits[1, :] = -mx.inf  # a row that sees nothing
    logits[3, 500] = mx.nan  # a broken model's logits must not look fine
    want = mx.logsumexp(logits, axis=-1, keepdims=True)
    got = cpu_kernels._native_logsumexp(logits)
    assert got.shape == (4, 1) and got[1, 0].item() == -np.inf and np.isnan(got[3, 0].item())
    assert mx.allclose(got[::2], want[::2], rtol=1e-6, atol=1e-5).item()
    generate = sys.modules["mlx_lm.generate"]
    model = tiny_model("llama")
    try:
        cpu_kernels.install(model)
        assert isinstance(generate.mx, cpu_kernels._GenerateMx)
        assert generate.mx.logsumexp is cpu_kernels._GenerateMx.logsumexp and generate.mx.arange is mx.arange
    finally:
        cpu_kernels.uninstall(model)
    assert generate.mx is mx


@pytest.mark.skipif(not cpu_kernels.native_kernels(), reason="no AVX-512 here")
def test_native_softmax_of_a_strided_array_works_on_a_copy():
    scores = mx.random.normal((1, 2, 5, 7)).transpose(0, 1, 3, 2)  # not row-major
    got = cpu_kernels._native_softmax(scores, causal=0)
    assert mx.allclose(got, mx.softmax(scores, axis=-1), rtol=1e-5, atol=1e-6).item()


@pytest.mark.skipif(not cpu_kernels.native_kernels(), reason="no AVX-512 here")
def test_native_softmax_gives_zeros_for_a_row_that_sees_nothing():
    q, k, v = _qkv(1, 2, 1, 3, 17)
    mask = mx.ones((1, 1, 3, 17), dtype=mx.bool_)
    mask[..., 1, :] = False
    got = cpu_kernels.attention(q, k, v, 0.2, mask, native=True)
    assert mx.all(got[:, :, 1] == 0).item()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mx.ones_like(mask))
    assert mx.allclose(got[:, :, ::2], want[:, :, ::2], rtol=1e-4, atol=1e-5).item()


def test_swiglu_matches_mlx():
    gate, x = mx.random.normal((3, 50)) * 30, mx.random.normal((3, 50))
    assert mx.allclose(cpu_kernels.swiglu(gate, x), nn.silu(gate) * x, rtol=1e-4, atol=1e-5).item()


@pytest.mark.skipif(not cpu_kernels.native_kernels(), reason="no AVX-512 here")
def test_native_swiglu_matches_mlx_and_leaves_views_to_the_compiled_one():
    gate, x = mx.random.normal((3, 50)) * 30, mx.random.normal((3, 50))
    want = nn.silu(gate) * x
    mx.eval(want)
    assert mx.allclose(cpu_kernels._native_swiglu(gate, x), want, rtol=1e-5, atol=1e-5).item()
    both = mx.random.normal((3, 100))
    assert cpu_kernels._native_swiglu(both[:, :50], both[:, 50:]) is None  # views of one buffer


def _logits_through_a_cache(model) -> list[mx.array]:
    """A 40-token prefill (past gemma3's 32-token window) and three decode steps."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([[(7 * i) % 250 + 3 for i in range(40)]]), cache=cache)]
    for token in (5, 9, 2):
        out.append(model(mx.array([[token]]), cache=cache))
    return out


@pytest.mark.parametrize("name,replaced", [
    ("llama", ["llama.scaled_dot_product_attention", "llama.swiglu"]),
    ("gemma3_text", ["gemma3_text.scaled_dot_product_attention"]),
    ("qwen3_next", ["qwen3_next.scaled_dot_product_attention", "qwen3_next.swiglu", "switch_layers.swiglu"]),
])
def test_installed_kernels_give_the_models_own_logits(name, replaced):
    model = tiny_model(name)
    want = _logits_through_a_cache(model)
    try:
        native = ["generate.logsumexp"] if cpu_kernels.native_kernels() else []
        assert cpu_kernels.install(model) == replaced + native
        got = _logits_through_a_cache(model)
    finally:
        cpu_kernels.uninstall(model)
    for w, g in zip(want, got):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()


def test_weights_go_float32_only_when_they_fit():
    model = tiny_model("llama")
    model_bytes = cpu_weights.float32_bytes(model)
    if cpu_blas.status["library"] is None:
        pytest.skip("no BLAS: auto keeps the stored weights")
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=4 * model_bytes) == "float32"
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=model_bytes) == "stored"
    with_copies = "stored" if cpu_amx.available() else "float32"  # AMX adds bfloat16 copies, half again
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=5 * model_bytes // 2) == with_copies
    assert cpu_weights.choose_dtype("bfloat16", model, memory_bytes=model_bytes) == "bfloat16"


@needs_amx
def test_the_loader_packs_for_amx_unless_told_not_to(model_path):
    from tierlm.models.loader import load_model

    model, _ = load_model(model_path, use_amx=False)
    assert cpu_amx.packed_bytes(model) == 0
    model, _ = load_model(model_path)
    assert cpu_amx.packed_bytes(model) > 100 * 2**20  # SmolLM2's 135M weights, two bytes each


@needs_amx
def test_a_collected_model_does_not_free_tiles_a_queued_graph_still_reads(model_path):
    """mlx-lm queues the next step with mx.async_eval; if the model is dropped
    meanwhile, its packed copies must outlive the products still running (this
    segfaulted when unpacking freed them at once)."""
    import time

    from tierlm.models.loader import load_model

    model, _ = load_model(model_path)
    logits = model(mx.array([[(7 * i) % 1000 + 3 for i in range(2048)]]))
    mx.async_eval(logits)
    time.sleep(0.2)  # let the products start (a race: this can miss it, never fail falsely)
    del model
    gc.collect()
    assert bool(mx.isfinite(logits).all().item())


def test_no_cpu_kernels_keeps_mlx_lms_functions(model_path):
    from mlx_lm.models import llama

    from tierlm.models.loader import load_model

    model, _ = load_model(model_path, use_cpu_kernels=False)
    cpu_kernels.uninstall(model)  # another test in this process may have loaded it with them
    model, _ = load_model(model_path, use_cpu_kernels=False)
    assert not hasattr(llama.scaled_dot_product_attention, "original")
    assert not hasattr(llama.swiglu, "original")
    model, _ = load_model(model_path)
    try:
        assert hasattr(llama.scaled_dot_product_attention, "original")
    finally:
        cpu_kernels.uninstall(model)
