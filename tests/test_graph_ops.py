"""tierlm's own MLX operations on the CPU (backends/cpu/graph_ops.py): each one
node of MLX's graph, with MLX's answers (RMSNorm within rounding, RoPE and
attention bit for bit; SwiGLU, GELU and the log-sum-exp with the bits of the
native kernels on evaluated arrays), lazy until evaluated, on any thread."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import pytest
from mlx import nn

from tierlm.backends.cpu import graph_ops, kernels, quantized, route
from tierlm.backends.cpu.rope import FewerOpsRoPE

STATE = route.prepare()
ON = graph_ops.install()
pytestmark = [pytest.mark.skipif(not STATE.native_kernels.on, reason=f"native kernels {STATE.native_kernels}"),
              pytest.mark.skipif(os.environ.get("TIERLM_GRAPH_OPS") == "off", reason="TIERLM_GRAPH_OPS=off")]


def test_they_are_on_where_the_native_kernels_are():
    """On fails loudly when nanobind's layout or MLX's primitives move under graph_ops.cpp."""
    assert ON.on, ON.detail


def _random(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


@pytest.mark.parametrize("shape,view", [((1, 1, 896), None), ((4, 7, 64), None), ((5, 3, 40), "swap")])
def test_rms_norm_matches_mlx_and_a_row_has_its_bits_alone(shape, view):
    x, weight = _random(shape, 1), _random((shape[-1],), 2)
    if view == "swap":
        x = x.swapaxes(0, 1)
    got = graph_ops.rms_norm(x, weight, 1e-6)
    assert mx.allclose(got, mx.fast.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6).item()
    alone = graph_ops.rms_norm(x[:1, :1], weight, 1e-6)
    assert mx.array_equal(alone, got[:1, :1]).item()


def test_what_they_do_not_take_is_none():
    x = _random((2, 8), 3)
    assert graph_ops.rms_norm(x.astype(mx.float16), _random((8,), 4), 1e-6) is None
    assert graph_ops.rms_norm(x, _random((7,), 4), 1e-6) is None
    assert graph_ops.rope(x, mx.ones((4,)), 0, 8, False, 1.0) is None  # not (B, H, T, D)
    assert graph_ops.rope(x[None, None], mx.ones((4,)), mx.array([1.5]), 8, False, 1.0) is None  # not int32
    q = _random((1, 2, 1, 8), 5)
    assert graph_ops.attention(q, q, q, 1.0, "sliding") is None
    assert graph_ops.attention(q, q, q, 1.0, mx.zeros((1, 1, 1, 1))) is None  # not a boolean mask
    assert graph_ops.swiglu(x, x[:, :4]) is None  # shapes differ
    assert graph_ops.swiglu(x.astype(mx.float16), x.astype(mx.float16)) is None
    assert graph_ops.gelu_approx(x.astype(mx.bfloat16)) is None


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [0, 4093, mx.array([5, 811, 30000])])
def test_fewer_ops_rope_is_one_operation_with_mx_fast_ropes_bits(traditional, offset):
    rope = FewerOpsRoPE(24, traditional=traditional, base=10000.0)
    x = _random((3, 4, 2, 28), 6).swapaxes(1, 2)  # (B, H, T, D): strided, 4 values past dims
    before = graph_ops.ran()
    got = rope(x, offset)
    mx.eval(got)
    assert graph_ops.ran() == before + 1  # graph_ops.cpp's RoPE ran, angles included
    want = mx.fast.rope(x, 24, traditional=traditional, base=10000.0, scale=1.0, offset=offset)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("scale,offset", [(1.0, 0), (0.5, 70000), (1.0, mx.array([3, 0, 9])), (2.0, mx.array(4))])
def test_rope_at_long_positions_and_batches_is_mx_fast_ropes_bits(scale, offset):
    from tierlm.backends.cpu.rope import inverse_frequencies

    x = _random((3, 2, 7, 64), 16)
    got = graph_ops.rope(x, inverse_frequencies(64, 1e6), offset, 64, False, scale)
    want = mx.fast.rope(x, 64, traditional=False, base=1e6, scale=scale, offset=offset)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("length,mask,span", [(1, None, 30), (1, "batched", 30), (5, "causal", 30),
                                              (5, "batched", 30), (5, "shared", 30), (1, None, 1500),
                                              (1, "batched", 1500), (12, "causal", 1500)])
def test_attention_is_kernels_attention_bit_for_bit(length, mask, span):
    """The graph's attention shares a decode step's (sequence, KV head) pairs
    over the cores, a long context's keys and values fetched ahead; kernels'
    computes them one after another on this thread: the same bits."""
    keys = _random((2, span, 2, 64), 7).transpose(0, 2, 1, 3)  # (B, KV, S, D) strided, as a cache's slice is
    values = _random((2, 2, span + 10, 64), 8)[:, :, :span]
    queries = _random((2, length, 14, 64), 9).transpose(0, 2, 1, 3)
    masks = {"batched": mx.random.uniform(shape=(2, 1, length, span), key=mx.random.key(10)) > 0.2,
             "shared": mx.arange(span)[None, None, None] < span - 5 + mx.arange(length)[None, None, :, None]}
    mask = masks.get(mask, mask)
    got = graph_ops.attention(queries, keys, values, 0.125, mask)
    want = kernels._attention(queries, keys, values, 0.125, mask, True)
    assert got is not None and mx.array_equal(got, want).item()
    assert mx.allclose(got, mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask),
                       rtol=1e-4, atol=1e-5).item()


WIDTHS = [w for w in (16, 8) if STATE.lib.tierlm_float_select(w) == w]
STATE.lib.tierlm_float_select(-1)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("length,mask,span,dim", [(1, None, 4000, 64), (1, "batched", 777, 64), (7, "causal", 300, 64),
                                                  (1, None, 129, 128), (33, "causal", 200, 80), (3, None, 50, 24)])
def test_attention_over_float16_kv_has_the_bits_of_the_same_values_as_float32(width, length, mask, span, dim):
    """A KV cache kept at float16 (engine.half_kv) is read as it is, half the
    bytes, with each build of the kernels (AVX-512 and AVX2; head widths
    whole vectors or not): the bits of the same attention over those values
    as float32, for a cache's strided slice as for a contiguous buffer."""
    try:
        assert STATE.lib.tierlm_float_select(width) == width
        keys = _random((2, span + 3, 2, dim), 11).astype(mx.float16).transpose(0, 2, 1, 3)[:, :, :span]
        values = _random((2, 2, span, dim), 12).astype(mx.float16)
        queries = _random((2, 14, length, dim), 13)
        mask = mx.random.uniform(shape=(2, 1, length, span), key=mx.random.key(14)) > 0.2 if mask == "batched" else mask
        got = graph_ops.attention(queries, keys, values, 0.125, mask)
        want = graph_ops.attention(queries, keys.astype(mx.float32), values.astype(mx.float32), 0.125, mask)
        assert got is not None and got.dtype == mx.float32 and mx.array_equal(got, want).item()
    finally:
        STATE.lib.tierlm_float_select(-1)


def test_they_stay_lazy_until_evaluated():
    x, weight = _random((2, 16), 11), _random((16,), 12)
    mx.eval(x, weight)
    before = graph_ops.ran()
    out = graph_ops.rms_norm(graph_ops.rms_norm(x, weight, 1e-5), weight, 1e-5)
    assert graph_ops.ran() == before
    mx.eval(out)
    assert graph_ops.ran() == before + 2


@pytest.mark.parametrize("shape,view", [((1, 1, 4864), None), ((3, 7, 37), None), ((5, 3, 40), "swap")])
def test_swiglu_and_gelu_have_the_native_kernels_bits_and_stay_lazy(shape, view):
    """SwiGLU and GELU in the graph give the bits of native/swiglu.c run on
    evaluated arrays (kernels.native_swiglu / native_gelu): on a strided view,
    on a gate whose buffer they may take over, on one still held elsewhere."""
    gate, x = _random(shape, 21) * 4, _random(shape, 22)
    if view == "swap":
        gate, x = gate.swapaxes(0, 1), x.swapaxes(0, 1)
    mx.eval(gate, x)
    want = kernels.native_swiglu(mx.contiguous(gate) * 1, mx.contiguous(x))  # in place: a copy of the gate
    before = graph_ops.ran()
    held = graph_ops.swiglu(gate, x)  # `gate` is still held here: not taken over
    taken = graph_ops.swiglu(gate * 1, x)  # a fresh product: its buffer may be taken over
    assert graph_ops.ran() == before  # lazy until evaluated
    assert mx.array_equal(held, want).item() and mx.array_equal(taken, want).item()
    assert graph_ops.ran() == before + 2
    assert mx.array_equal(graph_ops.gelu_approx(x), kernels.native_gelu(x)).item()
    alone = graph_ops.swiglu(gate[:1, :1], x[:1, :1])
    assert mx.array_equal(alone, want[:1, :1]).item()  # a row has its bits alone


def test_logsumexp_has_the_native_kernels_bits_on_logits():
    """The log-sum-exp of each row of the logits, in the graph: a row of -inf
    gives -inf, a strided view is read as it is."""
    logits = mx.concatenate([_random((3, 1000), 23) * 8, mx.full((1, 1000), -mx.inf)])
    got = graph_ops.logsumexp(logits)
    assert got.shape == (4, 1)
    assert mx.array_equal(got, kernels.native_logsumexp(logits)).item()
    assert mx.allclose(got[:3], mx.logsumexp(logits[:3], axis=-1, keepdims=True), rtol=1e-6).item()
    assert got[3, 0].item() == -float("inf")
    strided = logits[:3, ::2]
    assert mx.array_equal(graph_ops.logsumexp(strided), kernels.native_logsumexp(mx.contiguous(strided))).item()
    assert graph_ops.logsumexp(logits[None]) is None  # not (rows, cols)


def test_they_run_on_the_stream_of_the_thread_that_made_them():
    """Engines run on worker threads, each with its own MLX stream."""
    results, errors = [], []

    def work():
        try:
            x, weight = _random((3, 32), 13), _random((32,), 14)
            results.append(mx.array_equal(graph_ops.rms_norm(x, weight, 1e-5),
                                          graph_ops.rms_norm(x, weight, 1e-5)).item())
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True, True]


@pytest.mark.skipif(not quantized.install(STATE.lib).on, reason="needs the quantized kernels")
@pytest.mark.parametrize("bits", quantized.BITS)
@pytest.mark.parametrize("view", [None, "swap"])
def test_a_layer_reading_float16_scales_has_the_bits_of_float32_ones(bits, view):
    """HalfScalesQuantizedLinear: MLX's QuantizedMatmul made directly over
    float16 scales and biases (MLX's op would widen them every call), the
    same bits as the layer with them widened, for a strided view of x too."""
    layer = nn.QuantizedLinear(256, 96, bias=True, group_size=32, bits=bits)
    layer.update({"scales": layer.scales.astype(mx.float16), "biases": layer.biases.astype(mx.float16),
                  "bias": _random((96,), 9)})
    wide = nn.QuantizedLinear(256, 96, bias=True, group_size=32, bits=bits)
    wide.update({"weight": layer.weight, "scales": layer.scales.astype(mx.float32),
                 "biases": layer.biases.astype(mx.float32), "bias": layer.bias})
    assert graph_ops.install_half_scales(layer, lambda m: True) == 1
    x = _random((3, 5, 256), 8)
    if view == "swap":
        x = x.swapaxes(0, 1)
    taken = quantized.taken()
    got = layer(x)
    assert mx.array_equal(got, wide(x)).item() and got.dtype == mx.float32
    assert quantized.taken() - taken == 2  # both through qgemm.c, neither widened by MLX
    graph_ops.uninstall_half_scales(layer)
    assert type(layer) is nn.QuantizedLinear


def test_native_rms_norm_modules_switch_back():
    model = nn.Sequential(nn.RMSNorm(16), nn.Linear(16, 16), nn.RMSNorm(16))
    x = _random((2, 16), 15)
    want = model(x)
    assert graph_ops.install_norms(model) == 2
    assert all(type(m) is graph_ops.NativeRMSNorm for m in (model.layers[0], model.layers[2]))
    assert mx.allclose(model(x), want, rtol=1e-5, atol=1e-6).item()
    graph_ops.uninstall_norms(model)
    assert type(model.layers[0]) is nn.RMSNorm
