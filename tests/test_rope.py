"""RoPE in fewer MLX operations on the CPU (tierlm/backends/cpu/rope.py): the
same bits as `mx.fast.rope` (MLX's fallback graph on this device) for every
layout mlx-lm's models call it with, and the default model's logits unchanged
with it, prefilling and decoding."""

from __future__ import annotations

import re
import threading
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tierlm.backends.cpu import graph_ops
from tierlm.backends.cpu import rope as cpu_rope
from tierlm.backends.cpu.rope import FewerOpsRoPE


def _operations(out: mx.array, path) -> Counter:
    """The MLX operations `out`'s graph holds (its unevaluated part)."""
    mx.export_to_dot(str(path), out)
    return Counter(re.findall(r'label ="([A-Za-z]+)', path.read_text()))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, head, base, scale", [(64, 64, 10000.0, 1.0), (64, 64, 1e6, 1.0),
                                                     (32, 80, 10000.0, 0.25), (128, 128, 500000.0, 1.0)])
@pytest.mark.parametrize("batch, tokens, offset", [
    (1, 1, 0), (1, 1, 8191), (1, 256, 4096), (1, 7, 3),  # one sequence: an int offset
    (4, 1, [3, 0, 2047, 30001]), (2, 5, [0, 9]), (3, 1, [7])])  # a batch: each row its own
def test_the_bits_of_mx_fast_rope(traditional, dims, head, base, scale, batch, tokens, offset):
    x = mx.random.normal((batch, 3, tokens, head), key=mx.random.key(tokens + dims))
    offset = mx.array(offset) if isinstance(offset, list) else offset
    want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    got = FewerOpsRoPE(dims, traditional=traditional, base=base, scale=scale)(x, offset)
    assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert (mx.view(got, mx.uint32) == mx.view(want, mx.uint32)).all().item()  # the zeros' signs too


def test_fewer_operations_and_the_keys_reuse_the_queries_angles(tmp_path, monkeypatch):
    """MLX's operations, as where tierlm's own RoPE operation is off (graph_ops.py)."""
    monkeypatch.setattr(graph_ops, "rope", lambda *args: None)
    rope = nn.RoPE(64, traditional=True, base=10000.0)
    offset = mx.array([5, 9])
    queries, keys = mx.ones((2, 9, 1, 64)), mx.ones((2, 3, 1, 64))
    mx.eval(queries, keys, offset)
    before = sum(_operations(rope(queries, offset), tmp_path / "a.dot").values())
    rope.__class__ = FewerOpsRoPE
    first = _operations(out := rope(queries, offset), tmp_path / "b.dot")
    mx.eval(out)  # what the keys' graph adds, alone
    second = _operations(rope(keys, offset), tmp_path / "c.dot")
    # a layer's pair of calls: 66 operations in MLX's fallback, 39 here
    assert before >= 30 and sum(first.values()) + sum(second.values()) <= 2 * before * 0.65
    assert "Cos" in first and "Cos" not in second and sum(second.values()) <= 15


def test_angles_made_on_one_thread_are_not_reused_on_another():
    """An int offset's angles are kept for the next call; another engine's worker
    thread (another MLX stream) computes its own."""
    rope = FewerOpsRoPE(64, base=10000.0)
    x = mx.random.normal((1, 2, 3, 64), key=mx.random.key(0))
    mx.eval(x)
    kept = rope._angles(4, 3, 1)
    seen = {}

    def other():
        seen["angles"] = rope._angles(4, 3, 1)
        mx.eval(*seen["angles"])

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen["angles"] is not kept and rope._angles(4, 3, 1) is not kept  # the other thread's now


def test_float16_and_three_dimensional_inputs_go_to_mx_fast_rope():
    rope = FewerOpsRoPE(64, base=10000.0)
    for x in (mx.ones((1, 2, 3, 64), dtype=mx.float16), mx.ones((2, 3, 64))):
        assert mx.array_equal(rope(x, 2), mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0,
                                                        offset=2)).item()


def test_the_default_models_logits_are_those_of_mx_fast_rope(loaded):
    """Installed by the CPU backend at load (listed with the kernels); a prompt
    prefilled and three tokens decoded give the same logits, bit for bit, with
    the model's RoPE modules put back to nn.RoPE."""
    from tierlm import backends

    model, tokenizer = loaded
    assert "nn.RoPE" in backends.describe(model).summary["kernels"]
    ropes = [m for _, m in model.named_modules() if isinstance(m, nn.RoPE)]
    assert ropes and all(type(m) is FewerOpsRoPE for m in ropes)

    def logits() -> list[mx.array]:
        cache = make_prompt_cache(model)
        out = [model(mx.array([tokenizer.encode("The lighthouse keeper climbed the stairs")]), cache=cache)]
        for token in (11, 42, 7):
            out.append(model(mx.array([[token]]), cache=cache))
        mx.eval(out)
        return out

    fewer = logits()
    cpu_rope.uninstall(model)
    try:
        assert all(type(m) is nn.RoPE for m in ropes)
        plain = logits()
    finally:
        assert cpu_rope.install(model) == (len(ropes), None)
    assert all(mx.array_equal(a, b).item() for a, b in zip(fewer, plain))
