"""Quantized weights on the CPU (tierlm/backends/cpu/quantized.py,
native/qgemm.c, native/qmm_hook.cpp): the kernels against numpy on every path
this CPU has, MLX's own quantized matmul reaching them (and what they do not
take reaching MLX), the path's choice, and the quality of a real model's
answers against the same weights in float32."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from tierlm.backends.cpu import isa, native, quantized, route

STATE = route.prepare()
pytestmark = pytest.mark.skipif(STATE.lib is None or shutil.which("c++") is None,
                                reason="needs the native library and a C++ compiler")
FEATURE = quantized.install(STATE.lib)
PATHS = [name for name, number in quantized.PATHS.items()
         if STATE.lib is not None and STATE.lib.tierlm_qmm_available(number)]


@pytest.fixture
def path():
    """Puts back the process's own path after a test that picks one."""
    yield
    STATE.lib.tierlm_qmm_select(-1 if os.environ.get("TIERLM_QUANT_KERNEL", "auto") == "auto"
                                else quantized.PATHS[os.environ["TIERLM_QUANT_KERNEL"]])


def _weights(rows, cols, bits, group, seed=0):
    rng = np.random.default_rng(seed)
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((rows, cols)).astype(np.float32)),
                                    group_size=group, bits=bits)
    return np.array(w), np.array(scales), np.array(biases)


def _kernel(x, w, scales, biases, bits, group) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    STATE.lib.tierlm_qmm(x.ctypes.data, x.shape[0], x.shape[1], w.ctypes.data, scales.ctypes.data,
                         biases.ctypes.data, w.shape[0], bits, group, out.ctypes.data)
    return out


def _half_kernel(x, w, scales, biases, bits, group) -> np.ndarray:
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    STATE.lib.tierlm_qmm_half(x.ctypes.data, x.shape[0], x.shape[1], w.ctypes.data, scales.ctypes.data,
                              biases.ctypes.data, w.shape[0], bits, group, out.ctypes.data)
    return out


def _int8_reference(x, w, scales, biases, bits, group) -> np.ndarray:
    """What the kernels compute, in float64: x quantized to int8 per 32 values
    times the weights centred on 2^(bits-1), plus the rest with x exact."""
    dense = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=group, bits=bits),
                     np.float64)
    offset = np.repeat(biases.astype(np.float64) + 2 ** (bits - 1) * scales, group, axis=1)
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    xq = (np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)) * step).reshape(x.shape)
    return xq @ (dense - offset).T + x.astype(np.float64) @ offset.T


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("bits", quantized.BITS)
@pytest.mark.parametrize("group", quantized.GROUP_SIZES)
def test_each_path_computes_its_product(name, bits, group, path):
    """Every path, width and group size, for a row alone, two and three rows
    (verifying draft tokens), a tile, its tail and a prompt's worth of rows (panels: from 16 rows, 32 for 8 bits on AVX-512). The AVX-512 path
    multiplies in float32: the dequantized weights' product within float32's
    rounding. The others: the int8 product exactly (float32 rounding), and the
    float product within the error of int8 activations (<= 1.5% of the largest
    output here)."""
    assert STATE.lib.tierlm_qmm_select(quantized.PATHS[name]) == quantized.PATHS[name]
    w, scales, biases = _weights(70, 384, bits, group)
    x = np.random.default_rng(1).standard_normal((37, 384)).astype(np.float32)
    dense = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=group, bits=bits))
    for rows in (1, 2, 3, 4, 5, 8, 9, 21, 37):
        got = _kernel(x[:rows].copy(), w, scales, biases, bits, group)
        exact = x[:rows].astype(np.float64) @ dense.T.astype(np.float64)
        if name in quantized.FLOAT_PATHS:
            assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
            continue
        want = _int8_reference(x[:rows], w, scales, biases, bits, group)
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
        assert np.abs(got - exact).max() <= 0.015 * np.abs(exact).max()


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("bits", quantized.BITS)
def test_a_row_has_the_same_bits_alone_and_in_a_batch(name, bits, path):
    """Each output is one chain of adds in one order whatever the tile or
    whether its weights came from a panel, so batching and the split over the
    cores change no bit."""
    STATE.lib.tierlm_qmm_select(quantized.PATHS[name])
    w, scales, biases = _weights(300, 256, bits, 32, seed=2)
    x = np.random.default_rng(3).standard_normal((35, 256)).astype(np.float32)
    batch = _kernel(x, w, scales, biases, bits, 32)
    for rows in (2, 3, 4, 5, 6, 7, 8, 11, 19):  # short batches (one tile), tiles and what they leave; panels (not yet for 8 bits on AVX-512)
        assert np.array_equal(_kernel(x[:rows].copy(), w, scales, biases, bits, 32), batch[:rows])
    for row in range(35):
        assert np.array_equal(_kernel(x[row:row + 1].copy(), w, scales, biases, bits, 32)[0], batch[row])


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("bits", quantized.BITS)
def test_float16_scales_give_the_bits_of_their_float32_widening(name, bits, path):
    """tierlm_qmm_half reads float16 scales and biases as the importer keeps
    them (the float paths in the tiles, the others widened first): the same
    product, to the bit, as their exact float32 widening, alone, tiled and in
    panels, for each group size."""
    STATE.lib.tierlm_qmm_select(quantized.PATHS[name])
    x = np.random.default_rng(7).standard_normal((37, 384)).astype(np.float32)
    for group in quantized.GROUP_SIZES:
        w, scales, biases = _weights(70, 384, bits, group, seed=6)
        half_scales, half_biases = scales.astype(np.float16), biases.astype(np.float16)
        for rows in (1, 2, 3, 5, 9, 21, 37):
            want = _kernel(x[:rows].copy(), w, half_scales.astype(np.float32), half_biases.astype(np.float32), bits,
                           group)
            got = _half_kernel(x[:rows].copy(), w, half_scales, half_biases, bits, group)
            assert np.array_equal(got, want), (group, rows)


def _register(w, scales, biases, group) -> int:
    return STATE.lib.tierlm_qmm_int8_add(w.ctypes.data, scales.ctypes.data, biases.ctypes.data,
                                         int(scales.dtype == np.float16), w.shape[0], scales.shape[1] * group, group)


@pytest.mark.skipif("avx2-int8" not in PATHS, reason="needs AVX2")
def test_a_registered_weight_takes_the_int8_tiles_and_the_rest_keep_the_path(path):
    """cpu.int8 registers a model's weights with qgemm.c: their products take the
    int8 products (AVX-512 VNNI's where the CPU has it, else AVX2's: the bits
    the path of that name gives), alone, a few rows and in a batch, with float32
    or float16 scales, while another weight keeps the path in use; removed, a
    weight's products are the float path's again. A registered weight keeps its
    scales laid out by strips (70 columns: the last strip part empty): the same
    bits as laying them out for each product, and other scales with the same
    weights are read as they are. With VNNI a K of an odd number of block pairs
    stays on the path in use (its tiles read blocks two at a time); AVX2's take
    any K."""
    vnni = "avx512-vnni" in PATHS
    x = np.random.default_rng(11).standard_normal((21, 384)).astype(np.float32)
    w, scales, biases = _weights(70, 384, 5, 32, seed=12)
    halves = scales.astype(np.float16), biases.astype(np.float16)
    other = _weights(70, 384, 5, 32, seed=13)
    odd = _weights(70, 96, 5, 32, seed=14)
    odd_x = x[:, :96].copy()
    STATE.lib.tierlm_qmm_select(quantized.PATHS["avx512-vnni" if vnni else "avx2-int8"])
    int8, odd_int8 = _kernel(x, w, scales, biases, 5, 32), _kernel(odd_x, *odd, 5, 32)
    half_int8, other_scales_int8 = _half_kernel(x, w, *halves, 5, 32), _kernel(x, w, *other[1:], 5, 32)
    STATE.lib.tierlm_qmm_select(quantized.PATHS["avx512" if "avx512" in PATHS else "avx2"])
    floats, other_floats = _kernel(x, w, scales, biases, 5, 32), _kernel(x, *other, 5, 32)
    odd_floats = _kernel(odd_x, *odd, 5, 32)
    assert not np.array_equal(int8, floats)
    before = STATE.lib.tierlm_qmm_int8_weights()
    w_half = w.copy()  # the same weights at another address, registered with float16 scales
    try:
        for weight, *rest in ((w, scales, biases), (odd[0], *odd[1:]), (w_half, *halves)):
            assert _register(weight, *rest, 32) == 1
        assert STATE.lib.tierlm_qmm_int8_weights() == before + 3
        assert STATE.lib.tierlm_qmm_int8_laid_bytes(70, 384, 32, 1) == (80 if vnni else 72) * 12 * 2 * 2
        for rows in (1, 3, 21):
            assert np.array_equal(_kernel(x[:rows].copy(), w, scales, biases, 5, 32), int8[:rows])
            assert np.array_equal(_half_kernel(x[:rows].copy(), w_half, *halves, 5, 32), half_int8[:rows])
        assert np.array_equal(_kernel(x[3:4].copy(), w, scales, biases, 5, 32)[0], int8[3])
        assert np.array_equal(_kernel(x, w, *other[1:], 5, 32), other_scales_int8)
        assert np.array_equal(_kernel(x, *other, 5, 32), other_floats)
        assert np.array_equal(_kernel(odd_x, *odd, 5, 32), odd_floats if vnni else odd_int8)
    finally:
        for weight in (w, odd[0], w_half):
            STATE.lib.tierlm_qmm_int8_remove(weight.ctypes.data)
    assert STATE.lib.tierlm_qmm_int8_weights() == before
    assert np.array_equal(_kernel(x, w, scales, biases, 5, 32), floats)


@pytest.mark.skipif("avx512-vnni" not in PATHS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("bits", quantized.BITS)
def test_the_vnni_path_takes_an_odd_number_of_blocks_as_avx2_int8_does(bits, path):
    """A K of an odd number of 32-value blocks takes the avx2-int8 tiles under
    the avx512-vnni path: the int8 product still, to float32 rounding."""
    w, scales, biases = _weights(70, 96, bits, 32, seed=15)
    x = np.random.default_rng(16).standard_normal((9, 96)).astype(np.float32)
    STATE.lib.tierlm_qmm_select(quantized.PATHS["avx512-vnni"])
    got = _kernel(x, w, scales, biases, bits, 32)
    want = _int8_reference(x, w, scales, biases, bits, 32)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


@pytest.mark.skipif(STATE.lib is None or "avx512" not in PATHS or not STATE.lib.tierlm_qmm_avx512_vbmi(-1),
                    reason="needs AVX-512 VBMI")
def test_vbmi_unpacking_gives_the_same_bits(path):
    """5-bit blocks unpacked with VBMI (four instructions) or the AVX2 way:
    the same values, so the same products to the bit, alone, tiled and in
    panels."""
    STATE.lib.tierlm_qmm_select(quantized.PATHS["avx512"])
    w, scales, biases = _weights(70, 640, 5, 32, seed=4)
    x = np.random.default_rng(5).standard_normal((21, 640)).astype(np.float32)
    try:
        for rows in (1, 3, 4, 7, 9, 21):
            STATE.lib.tierlm_qmm_avx512_vbmi(1)
            with_vbmi = _kernel(x[:rows].copy(), w, scales, biases, 5, 32)
            STATE.lib.tierlm_qmm_avx512_vbmi(0)
            assert np.array_equal(_kernel(x[:rows].copy(), w, scales, biases, 5, 32), with_vbmi)
    finally:
        STATE.lib.tierlm_qmm_avx512_vbmi(1)


def test_the_kernels_compute_zeros_and_constant_rows():
    w, scales, biases = _weights(40, 64, 4, 32)
    x = np.zeros((2, 64), np.float32)
    x[1] = 3.0
    got = _kernel(x, w, scales, biases, 4, 32)
    dense = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=32, bits=4))
    assert np.array_equal(got[0], np.zeros(40, np.float32))
    assert np.allclose(got[1], x[1] @ dense.T, rtol=1e-5, atol=1e-4)


def _mlx_product(x, w, scales, biases, bits, group, **kwargs):
    with mx.stream(mx.cpu):
        out = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits, **kwargs)
        mx.eval(out)
    return out


@pytest.mark.skipif(not FEATURE.on, reason=f"quantized kernels off: {FEATURE}")
@pytest.mark.parametrize("tokens", [1, 3])
def test_mlxs_quantized_matmul_reaches_the_kernels(tokens):
    """A float32 product of an MLX-quantized weight with (sequences, tokens,
    features) activations, as a model sends them (a decode step's, a prompt's),
    is taken by the hook and is the dense product within int8's error."""
    w, scales, biases = (mx.array(a) for a in _weights(96, 256, 5, 32))
    x = mx.array(np.random.default_rng(4).standard_normal((2, tokens, 256)).astype(np.float32))
    before, counted = quantized.taken(), native.counts(STATE.lib)
    got = _mlx_product(x, w, scales, biases, 5, 32)
    ran = {k: v - counted[k] for k, v in native.counts(STATE.lib).items() if v != counted[k]}
    assert quantized.taken() == before + 1
    assert ran == {"qmm": 1}
    dense = mx.dequantize(w, scales, biases, group_size=32, bits=5)
    want = np.array(x @ dense.T)
    assert got.shape == (2, tokens, 96) and np.abs(np.array(got) - want).max() <= 0.015 * np.abs(want).max()


@pytest.mark.skipif(not FEATURE.on, reason=f"quantized kernels off: {FEATURE}")
def test_strided_activations_are_gathered_into_rows_and_taken():
    """x as a transposed view (as mlx-lm's attention output can be): the hook
    gathers it row by row, and the product is the contiguous x's, to the bit."""
    rng = np.random.default_rng(6)
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((64, 128)).astype(np.float32)), group_size=32, bits=4)
    rows = rng.standard_normal((128, 5)).astype(np.float32)
    before = quantized.taken()
    with mx.stream(mx.cpu):
        strided = mx.quantized_matmul(mx.array(rows).T, w, scales, biases, transpose=True, group_size=32, bits=4)
        contiguous = mx.quantized_matmul(mx.array(rows.T.copy()), w, scales, biases, transpose=True, group_size=32,
                                         bits=4)
        mx.eval(strided, contiguous)
    assert quantized.taken() == before + 2
    assert mx.array_equal(strided, contiguous).item()


@pytest.mark.skipif(not FEATURE.on, reason=f"quantized kernels off: {FEATURE}")
@pytest.mark.parametrize("case", ["bfloat16", "6-bit", "3-D weight", "not transposed"])
def test_what_the_kernels_do_not_take_goes_to_mlx(case):
    """Other dtypes, widths and layouts are MLX's own product: right, and not counted."""
    rng = np.random.default_rng(5)
    bits, transpose = (6 if case == "6-bit" else 4), case != "not transposed"
    shape = (2, 64, 128) if case == "3-D weight" else ((128, 64) if not transpose else (64, 128))
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal(shape).astype(np.float32)), group_size=32,
                                    bits=bits)
    x = mx.array(rng.standard_normal((5, 128 if transpose else 128)).astype(np.float32))
    if case == "3-D weight":
        x = mx.array(rng.standard_normal((2, 5, 128)).astype(np.float32))
    if case == "bfloat16":
        x, scales, biases = x.astype(mx.bfloat16), scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
    before, left = quantized.taken(), quantized.left_to_mlx()
    with mx.stream(mx.cpu):
        got = mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=32, bits=bits)
        dense = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
        want = x.astype(mx.float32) @ (dense.swapaxes(-1, -2) if transpose else dense).astype(mx.float32)
        mx.eval(got, want)
    assert quantized.taken() == before and quantized.left_to_mlx() == left + 1
    tolerance = 0.05 if case == "bfloat16" else 1e-4  # MLX sums bfloat16 products in bfloat16
    assert np.abs(np.array(got.astype(mx.float32)) - np.array(want)).max() <= tolerance * np.abs(np.array(want)).max()


def _feature_in_fresh_process(**env) -> dict:
    code = textwrap.dedent("""
        import json
        import numpy as np
        import mlx.core as mx
        from tierlm.backends.cpu import quantized, route
        state = route.prepare()
        feature = quantized.install(state.lib)
        w, s, b = mx.quantize(mx.array(np.linspace(-0.5, 1.5, 64 * 128, dtype=np.float32).reshape(64, 128)), bits=4,
                              group_size=32)
        with mx.stream(mx.cpu):
            y = mx.quantized_matmul(mx.ones((1, 128)), w, s, b, group_size=32, bits=4)
            mx.eval(y)
        print(json.dumps({"on": feature.on, "detail": feature.detail, "taken": quantized.taken(),
                          "value": float(y.sum().item())}))
    """)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _digests_in_fresh_process(threads: int) -> dict:
    """Each path's products of 1, 3 and 40 rows (digests of their bytes), and
    the int8 products of a registered weight, with `threads` native threads."""
    code = textwrap.dedent("""
        import hashlib, json
        import numpy as np
        import mlx.core as mx
        from tierlm.backends.cpu import quantized, route
        state = route.prepare()
        quantized.install(state.lib)
        rng = np.random.default_rng(5)
        x = rng.standard_normal((40, 384)).astype(np.float32)
        w, s, b = (np.array(a) for a in mx.quantize(mx.array(rng.standard_normal((300, 384)).astype(np.float32)),
                                                      group_size=32, bits=5))
        def product(rows):
            out = np.zeros((rows, 300), np.float32)
            state.lib.tierlm_qmm(x[:rows].ctypes.data, rows, 384, w.ctypes.data, s.ctypes.data, b.ctypes.data,
                                 300, 5, 32, out.ctypes.data)
            return hashlib.sha256(out.tobytes()).hexdigest()
        digests = {}
        for name, number in quantized.PATHS.items():
            if state.lib.tierlm_qmm_available(number):
                state.lib.tierlm_qmm_select(number)
                digests[name] = [product(rows) for rows in (1, 3, 40)]
        state.lib.tierlm_qmm_select(-1)
        if state.lib.tierlm_qmm_int8_add(w.ctypes.data, s.ctypes.data, b.ctypes.data, 0, 300, 384, 32):
            digests["registered"] = [product(rows) for rows in (1, 3, 40)]
        print(json.dumps({"threads": state.lib.tierlm_threads(), "digests": digests}))
    """)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TIERLM_NATIVE_THREADS": str(threads)},
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_bits_do_not_depend_on_how_many_threads_share_a_product():
    """A product's output columns go out in chunks to whichever thread is free
    (threads.c): each column is computed whole by one thread, so one thread and
    three give the same bits on every path, and for a registered weight."""
    alone, shared = _digests_in_fresh_process(1), _digests_in_fresh_process(3)
    assert alone["threads"] == 1 and shared["threads"] == 3
    assert alone["digests"] == shared["digests"] and len(alone["digests"]) >= 2


@pytest.mark.parametrize("name", PATHS)
def test_a_path_can_be_named_and_the_portable_one_runs_anywhere(name):
    """TIERLM_QUANT_KERNEL names the path (portable: plain C, what a CPU without
    AVX2 gets); the self-check proves each, and each gives the same sum."""
    got = _feature_in_fresh_process(TIERLM_QUANT_KERNEL=name)
    assert got["on"] and got["detail"].startswith(f"{name}, TIERLM_QUANT_KERNEL={name}; a 4-bit product")
    assert got["taken"] == 2  # the self-check's and ours
    reference = _feature_in_fresh_process(TIERLM_QUANT_KERNEL="off")
    assert abs(got["value"] - reference["value"]) <= 0.02 * abs(reference["value"])


def test_the_kernels_can_be_turned_off_and_a_wrong_name_says_so():
    off = _feature_in_fresh_process(TIERLM_QUANT_KERNEL="off")
    assert not off["on"] and off["detail"] == "turned off by TIERLM_QUANT_KERNEL=off" and off["taken"] == 0
    wrong = _feature_in_fresh_process(TIERLM_QUANT_KERNEL="sse9")
    assert not wrong["on"] and wrong["detail"].startswith("TIERLM_QUANT_KERNEL=sse9 is not one of auto, off")


def test_a_path_the_max_cpu_isa_hides_says_so():
    """Under TIERLM_MAX_CPU_ISA=avx2 the AVX-512 path cannot be named, and the
    reason names the cap where the CPU has AVX-512 (native/cpu_features.c)."""
    cpu_has_it = isa.reported(STATE.lib, "avx512f")  # whatever the cap
    got = _feature_in_fresh_process(TIERLM_MAX_CPU_ISA="avx2", TIERLM_QUANT_KERNEL="avx512")
    assert not got["on"] and got["taken"] == 0
    assert got["detail"] == "TIERLM_QUANT_KERNEL=avx512: this CPU lacks it" + (
        " (TIERLM_MAX_CPU_ISA=avx2)" if cpu_has_it else "")


# ---- a real model: the quantized path against the same weights in float32

REFERENCE_TEXT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The quick brown fox jumps over the lazy dog. Continuous batching lets a server run many requests "
    "at once, and a prefix cache keeps the work it has already done.")
PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "Explain recursion in one sentence.", "List three prime numbers.", "Write a haiku about the sea.",
           "How do I read a file in Python?", "What does HTTP stand for?",
           "Give me a SQL query that counts rows in a table named users."]


def _answers(path, dtype, greedy=True):
    """The reference text's per-token log-probabilities, and greedy answers to
    PROMPTS. The quantized weights are fed the text one token at a time, as
    decoding does (the int8 kernels' rows); float32, the reference, in one pass
    (the same values to float rounding, in a fraction of the time)."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.models.cache import make_prompt_cache

    from tierlm import backends
    from tierlm.models.loader import load_model

    model, tokenizer = load_model(path, cpu_weights_dtype=dtype)
    assert backends.describe(model).summary["weights"] == dtype
    ids, cache = tokenizer.encode(REFERENCE_TEXT), make_prompt_cache(model)
    if dtype == "float32":
        logits = model(mx.array([ids[:-1]]), cache=cache)[0]
    else:
        rows = []
        for token in ids[:-1]:
            rows.append(model(mx.array([[token]]), cache=cache)[0])
            mx.eval(rows[-1])
        logits = mx.concatenate(rows)
    logits = logits.astype(mx.float32)
    chosen = mx.take_along_axis(logits, mx.array(ids[1:])[:, None], axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1)
    # all prompts in one batch: a step reads the weights once for the eight
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    answers = batch_generate(model, tokenizer, prompts, max_tokens=16).texts if greedy else []
    return np.array(chosen.tolist()), answers


def _compare(path, greedy=True):
    float32, quant = _answers(path, "float32", greedy), _answers(path, "quantized", greedy)
    change = np.abs(float32[0] - quant[0])
    same = sum(a == b for a, b in zip(float32[1], quant[1]))
    return change, same


@pytest.mark.slow  # loads the default model twice (the kernels' unit tests stay in the fast run)
@pytest.mark.skipif(not FEATURE.on, reason=f"quantized kernels off: {FEATURE}")
def test_the_default_models_log_probabilities_stay_close(model_path):
    """SmolLM2-135M (4 bits), decoding, on the products the loader chooses
    (float32: the int8 probe turns them down for this model, so the change is
    float rounding). The bound is twice what int8 activations move it by on
    every product (TIERLM_INT8_ACTIVATIONS=on or an int8 path named: 0.049 on
    average and 0.37 at most here, as llama.cpp quantizes them, on a small
    model that feels them most). Greedy answers are compared on the real
    agent model below."""
    change, _ = _compare(model_path, greedy=False)
    assert change.mean() < 0.11 and change.max() < 0.75


@pytest.mark.slow  # loads Qwen2.5-Coder-0.5B twice and generates 16 answers
@pytest.mark.skipif(not FEATURE.on, reason=f"quantized kernels off: {FEATURE}")
def test_the_agent_models_answers_stay_those_of_float32(qwen_path):
    """Qwen2.5-Coder-0.5B (from its Q4_K_M GGUF), on the products the loader
    chooses (int8 activations, since the model passes the probe): greedy answers equal those of the
    same weights in float32 on most prompts (batched, 16 tokens), and the
    reference text's per-token log-probabilities, decoding, move by < 0.05 on
    average and < 0.5 at most (int8: 0.019 and 0.15 here, 7 of 8 answers the
    same; float32 products, where the kernels are off: 0 and 0)."""
    change, same = _compare(qwen_path)
    assert same >= len(PROMPTS) - 2
    assert change.mean() < 0.05 and change.max() < 0.5


@pytest.mark.slow  # loads the default model and Qwen2.5-Coder-0.5B
@pytest.mark.skipif("avx2-int8" not in PATHS or FEATURE.detail.split(",")[0] not in quantized.FLOAT_PATHS,
                    reason="needs AVX2 and a float path in use")
def test_the_probe_keeps_int8_activations_for_the_agent_model_only(model_path, qwen_path):
    """The loader probes each quantized model (cpu.int8): Qwen2.5-Coder-0.5B's
    reference log-probabilities move by ~0.018 with int8 activations and it
    takes them; SmolLM2-135M's by ~0.07 (its greedy answer to "What is the
    capital of France?" is no longer Paris with them) and it keeps float32
    products. The default model's answer is the float path's."""
    from tierlm import backends
    from tierlm.backends.cpu import int8
    from tierlm.models.loader import load_model

    qwen, _ = load_model(qwen_path)
    summary = backends.describe(qwen).summary["int8_activations"]
    assert summary.startswith("on (") and "(< 0.03)" in summary
    assert backends.describe(qwen).layout_tag == int8.LAYOUT_TAG
    smol, _ = load_model(model_path)
    summary = backends.describe(smol).summary["int8_activations"]
    assert summary.startswith("off (the probe moved log-probabilities by ") and "float32 products" in summary
    assert backends.describe(smol).layout_tag == b""
