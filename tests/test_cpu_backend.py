"""The CPU backend (tierlm/backends/cpu/): the BLAS and the route in MLX's
cblas_sgemm slot (one-row products, attention's exact products, AMX bfloat16
products), the self-check, the native softmax and the exp-based kernels. Where a
part is reported in use, a test counts that it ran."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from tierlm import backends
from tierlm.backends.cpu import amx as cpu_amx
from tierlm.backends.cpu import dequantize as cpu_dequantize
from tierlm.backends.cpu import got, graph_ops, isa, native, route
from tierlm.backends.cpu import kernels as cpu_kernels
from tierlm.backends.cpu import weights as cpu_weights
from tierlm.engine.core import parameter_layout
from tierlm.models.random_model import make_random_model, tiny_model

STATE = route.prepare()  # what loading a model on MLX's CPU backend prepares first
OPENBLAS = route.CANDIDATES[0]
needs_route = pytest.mark.skipif(
    shutil.which("cc") is None or not sys.platform.startswith("linux"), reason="needs Linux and a C compiler")
needs_amx = pytest.mark.skipif(not STATE.amx.on, reason=f"AMX {STATE.amx}")
needs_native = pytest.mark.skipif(not cpu_kernels.native_kernels(), reason=f"native kernels {STATE.native_kernels}")
NATIVE_SOFTMAX = [False, pytest.param(True, marks=needs_native)]
# the float kernels' builds this CPU runs (native/float_kernels.c): 16 lanes (AVX-512), 8 (AVX2)
WIDTHS = [w for w in (16, 8) if STATE.lib is not None and STATE.lib.tierlm_float_select(w) == w]
if STATE.lib is not None:
    STATE.lib.tierlm_float_select(-1)


@pytest.fixture(params=WIDTHS or [0], ids=lambda w: f"lanes{w}")
def float_width(request):
    """Runs a test with each build of the float kernels this CPU has (an AVX-512
    machine runs the AVX2 one too), then puts back the CPU's own choice."""
    if request.param:
        assert STATE.lib.tierlm_float_select(request.param) == request.param
    yield request.param
    if STATE.lib is not None:
        STATE.lib.tierlm_float_select(-1)


def counts() -> dict[str, int]:
    return {**STATE.counts(), **{f"kernel_{k}": v for k, v in cpu_kernels.calls.items()}}


def ran(before: dict[str, int]) -> dict[str, int]:
    """What ran since `before`, per counter."""
    return {k: v - before.get(k, 0) for k, v in counts().items() if v != before.get(k, 0)}


def _in_fresh_process(code: str, **env) -> dict:
    """Runs `code` (which ends by printing one JSON line) in a new interpreter."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


STATE_JSON = """
from tierlm.backends.cpu import route
s = route.prepare()
print(json.dumps({"blas": s.blas_path, "route": s.route.on, "why": str(s.route), "gemv": str(s.gemv),
                  "amx": str(s.amx), "kernels": s.native_kernels.on, "check": s.self_check,
                  "warning": s.warning}))
"""


def _state_in_fresh_process(**env) -> dict:
    return _in_fresh_process("import json\n" + STATE_JSON, **env)


def test_importing_tierlm_compiles_and_loads_nothing(tmp_path):
    """No compiler runs and no BLAS or native library is loaded by importing the
    package, its CLI or its backend modules: only loading a model prepares them."""
    marker = tmp_path / "cc-ran"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\ntouch {marker}\nexec cc \"$@\"\n")
    cc.chmod(0o755)
    maps = _in_fresh_process("""
        import json, sys
        import tierlm
        mlx_after_tierlm = "mlx.core" in sys.modules
        import tierlm.cli, tierlm.backends, tierlm.backends.cpu, tierlm.backends.cpu.route
        maps = open("/proc/self/maps").read()
        print(json.dumps({"mlx": mlx_after_tierlm, "native": "tierlm_native" in maps,
                          "openblas": "openblas-pthread" in maps or "libopenblasp" in maps}))
    """, CC=str(cc), XDG_CACHE_HOME=str(tmp_path))
    assert maps == {"mlx": False, "native": False, "openblas": False}
    assert not marker.exists()


@needs_route
def test_openblas_sits_behind_the_route_in_mlxs_slot():
    assert (STATE.blas_path, STATE.route.on, STATE.gemv.on, STATE.warning) == (OPENBLAS, True, True, None)
    assert STATE.amx.on or STATE.amx.detail.startswith("no AMX-BF16 on this CPU")  # (TIERLM_MAX_CPU_ISA=...)
    assert STATE.native_kernels.on or STATE.native_kernels.detail.startswith("no AVX-512 on this CPU")
    assert STATE.self_check.startswith("a float32 product through MLX counted")
    slots = route.mlx_slots()
    assert slots and all(s.read() == native.function_address(STATE.lib, "cblas_sgemm") for s in slots)


@needs_route
def test_the_route_works_when_mlx_was_imported_and_used_first():
    """mlx.core imported and its cblas_sgemm slot bound to the bundled BLAS before
    tierlm is imported: the route still takes MLX's products, counted."""
    got_state = _in_fresh_process("""
        import json
        import mlx.core as mx
        mx.eval(mx.ones((4, 8)) @ mx.ones((8, 4)))  # binds MLX's slot to its bundled BLAS
        import tierlm
        from tierlm.backends.cpu import native, route
        state = route.prepare()
        before = native.counts(state.lib)["sgemm"]
        out = mx.ones((3, 600)) @ mx.ones((600, 700))
        mx.eval(out)
        print(json.dumps({"blas": state.blas_path, "route": state.route.on, "check": state.self_check,
                          "counted": native.counts(state.lib)["sgemm"] - before, "value": out[0, 0].item()}))
    """)
    assert got_state["blas"] == OPENBLAS and got_state["route"]
    assert got_state["counted"] == 1 and got_state["value"] == 600.0
    assert got_state["check"].startswith("a float32 product through MLX counted")


@needs_route
def test_the_self_check_tells_when_mlxs_matmuls_do_not_reach_the_route():
    """An MLX that stopped calling cblas_sgemm through its slot (simulated: the
    slot is left as it was) is caught by the self-check: the route and the BLAS
    are reported off, with a warning, the slot keeps what it held, products stay
    right, and the weights stay as stored."""
    result = _in_fresh_process("""
        import json
        from tierlm.backends.cpu import got, route
        got.write = lambda slot, value: slot.read()  # writes nothing
        s = route.prepare()
        import mlx.core as mx
        from tierlm.models.random_model import tiny_model
        from tierlm.backends.cpu import weights
        ok = (mx.ones((2, 600)) @ mx.ones((600, 3)))[0, 0].item() == 600.0
        print(json.dumps({"route": s.route.on, "blas": s.blas.on, "why": str(s.route), "warning": s.warning,
                          "check": s.self_check, "ok": ok,
                          "weights": weights.choose_dtype("auto", tiny_model("llama"), 2**40)}))
    """)
    assert not result["route"] and not result["blas"] and result["ok"]
    assert result["check"] == "a float32 product through MLX was not counted at cblas_sgemm"
    assert "MLX's matmuls do not reach it" in result["why"] and "bundled BLAS" in result["warning"]
    assert result["weights"] == "stored"


@needs_route
def test_the_self_check_fails_once_the_slot_is_given_back():
    result = _in_fresh_process("""
        import json
        from tierlm.backends.cpu import native, route
        s = route.prepare()
        count = lambda: native.counts(s.lib)["sgemm"]
        before = route.self_check(count)[0]
        route.restore_slots()
        after = route.self_check(count)
        print(json.dumps({"before": before, "after": after[0], "why": after[1]}))
    """)
    assert result == {"before": True, "after": False,
                      "why": "a float32 product through MLX was not counted at cblas_sgemm"}


@needs_route
def test_mlxs_slot_is_found_in_its_elf_tables():
    slots = route.mlx_slots()
    assert [s.kind for s in slots] == ["JUMP_SLOT"]  # mlx 0.32's libmlx.so: lazy binding through the PLT
    assert slots[0].library.endswith("libmlx.so")
    assert got.expected(slots[0], also={native.function_address(STATE.lib, "cblas_sgemm")})
    held = slots[0].read()
    assert got.write(slots[0], held) == held  # a write gives back what the slot held


@needs_route
def test_route_and_blas_can_be_turned_off():
    no_gemv = _state_in_fresh_process(TIERLM_GEMV_ROUTE="off")
    assert no_gemv["gemv"] == "off (TIERLM_GEMV_ROUTE=off)"
    assert no_gemv["blas"] == OPENBLAS and no_gemv["route"]
    off = _state_in_fresh_process(TIERLM_BLAS="off")
    assert off["blas"] is None and not off["route"] and not off["kernels"]
    assert off["why"] == "off (turned off by TIERLM_BLAS=off)" and off["warning"] is None


def cpu_has(feature: str) -> bool:
    """What the CPU itself reports, whatever TIERLM_MAX_CPU_ISA this run is under."""
    return isa.reported(STATE.lib, feature)


ISA_JSON = """
import json
import mlx.core as mx
import numpy as np
from mlx import nn
from tierlm.backends.cpu import native, quantized, route, weights
from tierlm.models.random_model import tiny_model

state = route.prepare()
feature = quantized.install(state.lib)
model = tiny_model("llama")
nn.quantize(model, group_size=32, bits=4)
rng = np.random.default_rng(0)
w, x = rng.standard_normal((96, 256)).astype(np.float32), rng.standard_normal((5, 256)).astype(np.float32)
q, s, b = mx.quantize(mx.array(w), group_size=32, bits=4)
want = x @ np.array(mx.dequantize(q, s, b, group_size=32, bits=4)).T
before = native.counts(state.lib)
with mx.stream(mx.cpu):
    product = mx.quantized_matmul(mx.array(x), q, s, b, group_size=32, bits=4)
    scores = mx.array(x[:, :32]) @ mx.array(w[:40, :32]).T  # attention's: the exact kernels'
    mx.eval(product, scores)
after = native.counts(state.lib)
print(json.dumps({
    "exact": str(state.exact_attention), "kernels": str(state.native_kernels), "amx": str(state.amx),
    "warning": state.warning, "quantized": str(feature), "vbmi": state.lib.tierlm_qmm_avx512_vbmi(-1),
    "auto_dtype": weights.choose_dtype("auto", model, memory_bytes=2**34),
    "ran": {k: after[k] - before[k] for k in after if after[k] != before[k]},
    "error": float(np.abs(np.array(product) - want).max() / np.abs(want).max()),
    "scores_error": float(np.abs(np.array(scores) - x[:, :32] @ w[:40, :32].T).max())}))
"""


@needs_route
@pytest.mark.skipif(STATE.lib is None or not cpu_has("avx2"), reason="needs the native library and AVX2")
def test_max_cpu_isa_avx2_chooses_as_an_avx2_machine_would():
    """TIERLM_MAX_CPU_ISA=avx2 (native/cpu_features.c): on an AVX-512 machine,
    what an AVX2-only one runs. The exact attention products and the native
    kernels in their AVX2 build, AMX off, saying the cap is why; the quantized
    kernels' AVX2 build (float32 products), so `auto` keeps the weights
    quantized; each product right, and counted where it went."""
    got_ = _in_fresh_process(ISA_JSON, TIERLM_MAX_CPU_ISA="avx2")
    def lacks(feature, name):
        return f"off (no {name} on this CPU" + (" (TIERLM_MAX_CPU_ISA=avx2))" if cpu_has(feature) else ")")

    hidden = ", AVX-512 hidden under TIERLM_MAX_CPU_ISA=avx2" if cpu_has("avx512f") else ""
    assert got_["exact"] == got_["kernels"] == f"on (AVX2{hidden})"
    assert got_["amx"] == lacks("amx-bf16", "AMX-BF16")
    assert got_["quantized"].startswith("on (avx2, the fastest this CPU has under TIERLM_MAX_CPU_ISA=avx2; ")
    assert got_["warning"] is None and got_["vbmi"] == 0 and got_["auto_dtype"] == "quantized"
    assert got_["ran"] == {"qmm": 1, "sgemm": 1, "sgemm_exact": 1}
    assert got_["error"] <= 1e-5 and got_["scores_error"] <= 1e-4  # float32's rounding


@needs_route
@pytest.mark.skipif(STATE.lib is None, reason="needs the native library")
def test_a_max_cpu_isa_it_does_not_know_turns_off_what_it_caps_and_warns():
    got_ = _in_fresh_process(ISA_JSON, TIERLM_MAX_CPU_ISA="sse9")
    why = "TIERLM_MAX_CPU_ISA=sse9 is not one of native, avx512, avx-vnni, avx2"
    assert got_["warning"].startswith(why + ": ")
    assert got_["exact"] == got_["kernels"] == got_["amx"] == got_["quantized"] == f"off ({why})"
    assert got_["ran"] == {"sgemm": 1, "sgemm_blas": 1}  # the quantized product: MLX's own
    assert got_["scores_error"] <= 1e-4


@needs_route
def test_without_a_compiler_the_blas_still_goes_in_the_slot(tmp_path):
    """The BLAS's own sgemm in MLX's slot, proved by a counting stand-in."""
    state = _state_in_fresh_process(CC="/nonexistent/cc", XDG_CACHE_HOME=str(tmp_path))
    assert state["blas"] == OPENBLAS and not state["route"]
    assert state["why"].startswith("off (could not build or load it: no C compiler")
    assert state["check"] == "a float32 product through MLX counted 1 call(s), numpy's answer"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_library_two_threads_need_is_built_once_and_its_error_reaches_both(monkeypatch, tmp_path):
    """The C++ libraries start building beside the C one (native.in_background);
    the install that needs one then waits for that build instead of starting
    its own, and meets its error where it fails."""
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    compiled = []

    def compile_into(compiler, path):
        compiled.append(path)
        time.sleep(0.3)  # the other threads ask meanwhile
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(path), str(source)], check=True, capture_output=True)

    def failing(compiler, path):
        compiled.append(path)
        time.sleep(0.3)
        subprocess.run([compiler, "-c", "-o", str(path), str(tmp_path / "missing.c")], check=True,
                       capture_output=True)

    for how, inputs in ((compile_into, b"one"), (failing, b"missing")):
        results = []

        def need(how=how, inputs=inputs, results=results):
            try:
                results.append(native.build_once("tierlm_test", inputs, "C", "CC", "cc", how))
            except native.BuildError as e:
                results.append(e)

        threads = [threading.Thread(target=need) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if how is compile_into:
            assert len(compiled) == 1 and len(set(results)) == 1 and results[0].exists()
        else:
            assert len(compiled) == 2 and all(isinstance(r, native.BuildError) for r in results)
            assert "missing.c" in str(results[0])


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_new_build_leaves_the_newest_versions_and_no_abandoned_scratch(monkeypatch, tmp_path):
    """Each source version builds a file of its own: a new build removes all
    but the newest KEPT_VERSIONS of that library (other libraries untouched),
    and scratch folders a process left mid-build more than an hour ago, not
    one another build is using now."""
    import os
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "tierlm" / "native"
    cache.mkdir(parents=True)
    now = time.time()
    old = [cache / f"tierlm_test-{i:016x}.so" for i in range(native.KEPT_VERSIONS + 2)]
    for age, path in enumerate(old):  # old[0] the newest
        path.write_bytes(b"")
        os.utime(path, (now - 60 * (age + 1),) * 2)
    other = cache / "tierlm_other-0000000000000000.so"
    other.write_bytes(b"")
    os.utime(other, (now - 10**6,) * 2)
    abandoned, busy = cache / "build-abandoned", cache / "build-busy"
    abandoned.mkdir(), busy.mkdir()
    os.utime(abandoned, (now - 2 * 3600,) * 2)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")

    def compile_into(compiler, path):
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(path), str(source)], check=True, capture_output=True)

    built = native.build_once("tierlm_test", b"new", "C", "CC", "cc", compile_into)
    left = sorted(p.name for p in cache.iterdir())
    assert built.exists() and other.exists() and busy.exists() and not abandoned.exists()
    assert [p.name for p in old if p.exists()] == [p.name for p in old[:native.KEPT_VERSIONS - 1]]
    assert len([n for n in left if n.startswith("tierlm_test-")]) == native.KEPT_VERSIONS


@pytest.mark.slow  # compiles the kernels again
@needs_route
def test_a_compiler_without_amx_builds_the_rest(tmp_path):
    """An older compiler fails on the AMX intrinsics (a fault this machine's
    compiler cannot cause, so a stand-in refuses the build that has them)."""
    old_cc = tmp_path / "old-cc"
    old_cc.write_text('#!/bin/sh\ncase "$*" in *TIERLM_NO_AMX*) exec cc "$@";; esac\necho no AMX >&2; exit 1\n')
    old_cc.chmod(0o755)
    state = _state_in_fresh_process(CC=str(old_cc), XDG_CACHE_HOME=str(tmp_path))
    assert state["route"] and state["gemv"] == "on"
    assert state["amx"] == "off (the C compiler has no AMX intrinsics)"


@pytest.mark.parametrize("rows,cols", [(1, 80), (3, 80), (9, 80), (9, 64), (600, 700)])
def test_float32_matmuls_match_numpy_in_every_layout(rows, cols):
    """Every route the sgemm route has: one-row products through sgemv, small
    products through the exact kernels (eight-row and two-row blocks and their
    tails, the 64-wide path), large ones through the BLAS, in every transpose
    combination MLX emits. All must give numpy's answer, and each is counted
    once by the route and by exactly one of its destinations."""
    rng = np.random.default_rng(rows)
    a, w = rng.standard_normal((rows, 96), np.float32), rng.standard_normal((cols, 96), np.float32)
    c = rng.standard_normal((rows, cols), np.float32)
    A, W, C = mx.array(a), mx.array(w), mx.array(c)
    mx.eval(A, W, C)
    expected = a @ w.T
    before = counts()
    cases = {
        "a @ w.T": A @ W.T,
        "a @ contiguous(w.T)": A @ mx.contiguous(W.T),
        "transposed a": mx.contiguous(A.T).T @ W.T,
        "addmm": mx.addmm(C, A, W.T, alpha=0.5, beta=2.0),
    }
    for name, got_ in cases.items():
        want = 0.5 * expected + 2.0 * c if name == "addmm" else expected
        np.testing.assert_allclose(np.array(got_), want, rtol=1e-4, atol=1e-4, err_msg=name)
    if STATE.route.on:
        delta = ran(before)
        assert delta["sgemm"] == len(cases)
        assert sum(delta.get(f"sgemm_{d}", 0) for d in ("amx", "exact", "gemv", "blas")) == len(cases)


@needs_route
def test_each_destination_of_the_route_counts_what_it_takes():
    """One product of each shape the route tells apart; the counters say where it went."""
    def product(a_shape, b_shape, trans_b=False):
        a, b = mx.ones(a_shape), mx.ones(b_shape)
        mx.eval(a, b)
        before = counts()
        mx.eval(a @ (b.T if trans_b else b))
        return {k: v for k, v in ran(before).items() if k.startswith("sgemm_")}

    assert product((1, 96), (96, 600)) == {"sgemm_gemv": 1}  # decoding one sequence
    assert product((600, 96), (96, 700)) == {"sgemm_blas": 1}
    if STATE.exact_attention.on:
        assert product((9, 32), (40, 32), trans_b=True) == {"sgemm_exact": 1}  # attention's scores
        assert product((9, 40), (40, 64)) == {"sgemm_exact": 1}  # its weighted values


@needs_route
@pytest.mark.skipif(not STATE.exact_attention.on, reason="no exact attention products here")
@pytest.mark.parametrize("rows,keys,width", [(1024, 4096, 256), (768, 700, 64), (13, 300, 100), (7, 2000, 64),
                                             (3, 77, 64)])
def test_big_attention_products_are_row_by_row_bit_for_bit(rows, keys, width, float_width):
    """Attention's products run tiled (up to 6 rows by a tile of keys or
    columns, keys in blocks), a long prompt's over every core (exact_gemm.c,
    threads.c); a decode step's few rows (7: a tile and a row) the same way.
    Each element must still be summed in the one order: the whole product equals
    its rows computed alone, bit for bit, causal zeros included."""
    rng = np.random.default_rng(rows)
    q, k = mx.array(rng.standard_normal((rows, width), np.float32)), mx.array(rng.standard_normal((keys, width), np.float32))
    weights = rng.random((rows, keys), np.float32)
    weights[np.arange(keys)[None] > (np.arange(rows) * keys // rows)[:, None]] = 0  # causal spans
    weights[:, : keys // 7] = 0  # left padding
    p, v = mx.array(weights), mx.array(rng.standard_normal((keys, width), np.float32))
    before = counts()
    scores, out = q @ k.T, p @ v
    mx.eval(scores, out)
    assert ran(before).get("sgemm_exact") == 2
    for i in range(0, rows, max(1, rows // 9)):
        assert mx.array_equal(q[i : i + 1] @ k.T, scores[i : i + 1]).item(), f"scores row {i}"
        assert mx.array_equal(p[i : i + 1] @ v, out[i : i + 1]).item(), f"weighted row {i}"
    np.testing.assert_allclose(np.array(out), weights.astype(np.float64) @ np.array(v, np.float64), rtol=1e-4, atol=1e-3)


@needs_native
@pytest.mark.parametrize("batch,mask_batch", [(1, 1), (3, 3), (3, 1)])
def test_native_masked_softmax_is_where_then_softmax_bit_for_bit(batch, mask_batch, float_width):
    """mlx-lm's caches give prefill a boolean (B or 1, 1, L, S) mask; the native
    softmax applies it in its first pass, as MLX's where(mask, scores, -inf) did."""
    scores = mx.random.normal((batch, 4, 9, 45)) * 5
    mask = mx.random.uniform(shape=(mask_batch, 1, 9, 45)) > 0.4
    mask[..., -1] = True
    mask[..., 2, :] = False  # a row that sees nothing
    mx.eval(scores, mask)
    want = cpu_kernels.native_softmax(mx.where(mask, scores, -mx.inf), 0)
    got = cpu_kernels.native_masked_softmax(mx.array(scores), mask)
    assert np.array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))


@pytest.mark.parametrize("native", NATIVE_SOFTMAX)
def test_gelu_matches_mlx_and_runs_native_at_every_size(native, monkeypatch, float_width):
    """The mlx.nn proxy's GELU: native code where the CPU allows (one operation
    in the graph at any size where graph_ops is on), else numpy's for a prompt's
    activations and MLX's own for a decode step's."""
    monkeypatch.setattr(cpu_kernels, "native_kernels", lambda: native)
    x = mx.random.normal((2, 300, 256)) * 6
    if not native:
        x[0, 0, :4] = mx.array([-1e4, -60.0, 0.0, 1e4])  # exp(-2z) overflows to inf: 0, not nan
    want = nn.gelu_approx(x)
    got = cpu_kernels.native_gelu(x) if native else cpu_kernels.numpy_gelu(x)
    assert got.dtype == mx.float32 and mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    proxy = cpu_kernels.ModelNn()
    before = counts()
    assert mx.allclose(proxy.gelu_approx(x), want, rtol=1e-5, atol=1e-6).item()
    small = x[:1, :1]  # a decode step's activation
    in_graph = native and graph_ops.on()
    want_small = cpu_kernels.native_gelu(small) if in_graph else nn.gelu_approx(small)
    assert mx.array_equal(proxy.gelu_approx(small), want_small).item()
    assert proxy.Linear is nn.Linear
    delta = ran(before)
    # the proxy's count, and the native library's: the small one's reference is native too where in_graph
    assert delta.get("kernel_gelu") == 1 + in_graph and delta.get("gelu", 0) == int(native) + 2 * in_graph


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
    assert STATE.lib.tierlm_amx_pack(address, 80, 96)
    before = counts()
    try:
        got, got_addmm = np.array(A @ W.T), np.array(mx.addmm(C, A, W.T, alpha=0.5, beta=2.0))
    finally:
        STATE.lib.tierlm_amx_unpack(address)
    assert ran(before).get("sgemm_amx") == 2
    want = _bfloat16(a) @ _bfloat16(w).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_addmm, 0.5 * want + 2.0 * c, rtol=1e-4, atol=1e-4)
    exact = a.astype(np.float64) @ w.T.astype(np.float64)
    assert not np.allclose(got, exact, rtol=1e-4, atol=1e-4)  # bfloat16, so not the BLAS's answer
    np.testing.assert_allclose(np.array(A @ W.T), exact, rtol=1e-4, atol=1e-4)  # unpacked: the BLAS again


@needs_amx
def test_a_packed_model_keeps_its_logits_and_frees_its_copies():
    """Through the backend's entry point: the copies are memory it reports, its
    layout tag changes the prefix cache's keys, and the products run on AMX."""
    gc.collect()  # models other tests dropped: gone before the counts are taken
    packed, prepared = cpu_amx.packed_models(), backends.prepared_models()
    model = tiny_model("llama")
    want = _logits_through_a_cache(model)
    mx.eval(want)  # before packing: MLX is lazy
    layout = parameter_layout(model)
    backend = backends.prepare(model, cpu_weights_dtype="stored", memory_bytes=2**40, cpu_kernels=False)
    assert backend.summary["amx_packed_weights"] == 2 * 7 + 1  # seven Linears a layer, and the tied embedding
    assert backends.describe(model) is backend
    assert (cpu_amx.packed_models(), backends.prepared_models()) == (packed + 1, prepared + 1)
    assert parameter_layout(model) == layout + b" products: bfloat16 on AMX"  # other KV: other cache keys
    assert backend.extra_bytes == sum(w.size * 2 for w in cpu_amx.matmul_weights(model))
    before = counts()
    got = _logits_through_a_cache(model)
    mx.eval(got)
    assert ran(before).get("sgemm_amx", 0) >= 4 * (2 * 7 + 1)  # every Linear and the head, each step
    for w, g in zip(want, got):
        assert not mx.array_equal(g, w).item()
        assert mx.allclose(g, w, rtol=0.05, atol=0.05).item()
    del model, backend
    gc.collect()
    assert (cpu_amx.packed_models(), backends.prepared_models()) == (packed, prepared)


def test_fast_exp_is_close_to_exp_and_exactly_zero_far_below():
    x = mx.linspace(-87, 88, 200_001)
    rel = mx.abs(cpu_kernels.fast_exp(x) / mx.exp(x) - 1)
    assert mx.max(rel).item() < 5e-5
    tiny = cpu_kernels.fast_exp(mx.array([-88.0, -1e4, -mx.inf]))
    assert tiny.tolist() == [0.0, 0.0, 0.0]  # no denormals: they make BLAS crawl


def test_numpy_exp_softmax_is_exp_and_exactly_zero_far_below():
    """The in-place exp of `numpy_shifted_exp`: exp(x - row max), no denormals."""
    x = mx.concatenate([mx.linspace(-87, 0, 70_000), mx.array([-88.0, -100.0, -1e4, -mx.inf])])[None]
    mx.eval(x)
    got = cpu_kernels.numpy_shifted_exp(x * 1)  # in place: a fresh array
    assert mx.allclose(got[:, :70_000], mx.exp(x[:, :70_000]), rtol=1e-5, atol=0).item()  # fast_exp: 5e-5
    assert got[0, 70_000:].tolist() == [0.0, 0.0, 0.0, 0.0]  # exp(-88) would be a denormal


def _qkv(batch, heads, kv_heads, length, span, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((batch, heads, length, 32)), mx.random.normal((batch, kv_heads, span, 32)),
            mx.random.normal((batch, kv_heads, span, 32)))


@pytest.mark.parametrize("native", NATIVE_SOFTMAX)
@pytest.mark.parametrize("length,span,mask_kind", [
    (1, 40, None), (7, 7, "causal"), (5, 40, "causal"), (6, 30, "bool"), (6, 30, "additive"),
    # scores of NUMPY_EXP_MIN elements or more: numpy's exp where the native kernels are off
    (1, 6000, None), (64, 600, "causal"), (64, 600, "bool"),
])
def test_attention_matches_mlx(length, span, mask_kind, native, float_width):
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
def test_attention_is_bit_exact_alone_and_left_padded_in_a_batch(native, float_width):
    """Batched prefill masks left padding and the causal future with an array;
    alone the mask is "causal". The outputs must be identical, not just close:
    greedy output and cached KV must not depend on what else ran. This rests on
    the exact products (AVX-512): through the BLAS a product's edge tiles round
    otherwise, and docs/cpu-backend.md says batch invariance needs them."""
    if not STATE.exact_attention.on:
        pytest.skip(f"exact attention products {STATE.exact_attention}: batched attention may differ by a bit")
    q, k, v = _qkv(1, 6, 2, 9, 23)
    mx.eval(q, k, v)
    before = counts()
    alone = cpu_kernels.attention(q, k, v, 0.2, "causal", native=native)
    mx.eval(alone)
    if STATE.exact_attention.on:  # this bit-exactness rests on the exact products: they must have run
        delta = ran(before)
        assert delta.get("sgemm_exact", 0) >= 2 and delta["sgemm_exact"] == delta["sgemm"]
    if native:
        assert ran(before).get("softmax") == 1
    for pad in (1, 5, 16, 17):
        zeros = mx.zeros((1, 2, pad, 32))
        span = 23 + pad
        visible = (mx.arange(span)[None] <= mx.arange(span - 9, span)[:, None]) & (mx.arange(span)[None] >= pad)
        batched = cpu_kernels.attention(q, mx.concatenate([zeros, k], axis=2), mx.concatenate([zeros, v], axis=2),
                                        0.2, visible[None, None], native=native)
        assert mx.array_equal(batched, alone).item(), f"left padding {pad}"


@needs_native
def test_attention_in_blocks_of_queries_gives_the_bits_of_one_block(monkeypatch, float_width):
    """A long prompt's chunk is computed a block of queries at a time
    (SCORES_BLOCK_BYTES); each query's scores, softmax and sum are its own, so
    the blocks give what one call over all the queries gives, bit for bit, under
    a left-padded batch's mask."""
    if not STATE.exact_attention.on:
        pytest.skip(f"exact attention products {STATE.exact_attention}")
    q, k, v = _qkv(2, 6, 2, 37, 300)
    visible = (mx.arange(300)[None] <= mx.arange(300 - 37, 300)[:, None])[None, None]
    mask = mx.concatenate([visible, visible & (mx.arange(300) >= 40)], axis=0)  # the second row left-padded
    mx.eval(q, k, v, mask)
    whole = cpu_kernels.attention(q, k, v, 0.2, mask, native=True)
    mx.eval(whole)
    monkeypatch.setattr(cpu_kernels, "SCORES_BLOCK_BYTES", 4 * 2 * 6 * 300 * 8)  # blocks of 8 queries, then 5
    before = counts()
    blocks = cpu_kernels.attention(q, k, v, 0.2, mask, native=True)
    mx.eval(blocks)
    assert ran(before).get("softmax") == 5  # blocks of 8, 8, 8, 8 and 5 queries
    assert mx.array_equal(blocks, whole).item()


@needs_native
def test_native_logsumexp_matches_mlx_and_serves_mlx_lms_batch_step(float_width):
    from mlx_lm.generate import BatchGenerator

    logits = mx.random.normal((4, 1000)) * 20
    logits[1, :] = -mx.inf  # a row that sees nothing
    logits[3, 500] = mx.nan  # a broken model's logits must not look fine
    want = mx.logsumexp(logits, axis=-1, keepdims=True)
    got = cpu_kernels.native_logsumexp(logits)
    assert got.shape == (4, 1) and got[1, 0].item() == -np.inf and np.isnan(got[3, 0].item())
    assert mx.allclose(got[::2], want[::2], rtol=1e-6, atol=1e-5).item()
    generate = sys.modules["mlx_lm.generate"]
    model = tiny_model("llama")
    try:
        cpu_kernels.install(model)
        assert isinstance(generate.mx, cpu_kernels.GenerateMx)
        assert generate.mx.logsumexp is cpu_kernels.GenerateMx.logsumexp and generate.mx.arange is mx.arange
        before = counts()
        gen = BatchGenerator(model, completion_batch_size=2)
        pending = set(gen.insert([[5, 6, 7], [8, 9]], max_tokens=[3, 3]))
        while pending:
            pending -= {r.uid for r in gen.next()[1] if r.finish_reason is not None}
        gen.close()
        # the log-sum-exp is in the step's graph: the last step may still be running on mlx-lm's stream
        mx.synchronize(generate.generation_stream)
        steps = ran(before)
        assert steps.get("kernel_logsumexp", 0) >= 2 and steps.get("logsumexp") == steps["kernel_logsumexp"]
    finally:
        cpu_kernels.uninstall(model)
    assert generate.mx is mx


@needs_native
def test_native_softmax_of_a_strided_array_works_on_a_copy():
    scores = mx.random.normal((1, 2, 5, 7)).transpose(0, 1, 3, 2)  # not row-major
    got = cpu_kernels.native_softmax(scores, causal=0)
    assert mx.allclose(got, mx.softmax(scores, axis=-1), rtol=1e-5, atol=1e-6).item()


@needs_native
def test_native_softmax_gives_zeros_for_a_row_that_sees_nothing(float_width):
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


@needs_native
def test_native_swiglu_matches_mlx_and_leaves_views_to_the_compiled_one(float_width):
    gate, x = mx.random.normal((3, 50)) * 30, mx.random.normal((3, 50))
    want = nn.silu(gate) * x
    mx.eval(want)
    assert mx.allclose(cpu_kernels.native_swiglu(gate, x), want, rtol=1e-5, atol=1e-5).item()
    both = mx.random.normal((3, 100))
    assert cpu_kernels.native_swiglu(both[:, :50], both[:, 50:]) is None  # views of one buffer


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
def test_installed_kernels_give_the_models_own_logits(name, replaced, monkeypatch):
    """...and every kernel reported installed ran (counted), natively where the CPU allows."""
    monkeypatch.setattr(cpu_kernels, "NATIVE_GELU_MIN", 0)  # a tiny model's activations are decode-sized
    model = tiny_model(name)
    want = _logits_through_a_cache(model)
    mx.eval(want)
    try:
        native = ["generate.logsumexp"] if cpu_kernels.native_kernels() else []
        gelu = [f"{name}.gelu_approx"] if name.startswith("gemma") else []  # native or numpy's
        rope = ["nn.RoPE"] if any(type(m) is nn.RoPE for _, m in model.named_modules()) else []  # backends/cpu/rope.py
        norms = ["nn.RMSNorm"] if native and graph_ops.install().on and any(
            type(m) is nn.RMSNorm for _, m in model.named_modules()) else []
        assert cpu_kernels.install(model) == replaced + gelu + native + norms + rope
        before, graph_ops_before = counts(), graph_ops.ran()
        got = _logits_through_a_cache(model)
        if graph_ops.on():  # the whole forward pass one graph: nothing ran before it is evaluated
            assert ran(before) == {k: v for k, v in ran(before).items() if k.startswith("kernel_")}
            assert graph_ops.ran() == graph_ops_before
        mx.eval(got)
        delta = ran(before)
        assert (graph_ops.ran() > graph_ops_before) == bool(norms or rope and graph_ops.on())
    finally:
        cpu_kernels.uninstall(model)
    for w, g in zip(want, got):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()
    assert delta.get("kernel_attention", 0) > 0
    assert (delta.get("kernel_swiglu", 0) > 0) == any(r.endswith(".swiglu") for r in replaced)
    assert (delta.get("kernel_gelu", 0) > 0) == bool(gelu)
    if cpu_kernels.native_kernels():
        assert delta.get("softmax", 0) == delta["kernel_attention"]
        assert delta.get("swiglu", 0) > 0 or "kernel_swiglu" not in delta
        assert (delta.get("gelu", 0) > 0) == bool(gelu) and delta.get("gelu", 0) == delta.get("kernel_gelu", 0)


def test_weights_go_float32_only_when_they_fit():
    model = tiny_model("llama")
    model_bytes = cpu_weights.float32_bytes(model)
    if not STATE.blas.on:
        pytest.skip("no BLAS: auto keeps the stored weights")
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=4 * model_bytes) == "float32"
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=model_bytes) == "stored"
    with_copies = "stored" if cpu_amx.available() else "float32"  # AMX adds bfloat16 copies, half again
    assert cpu_weights.choose_dtype("auto", model, memory_bytes=5 * model_bytes // 2) == with_copies
    assert cpu_weights.choose_dtype("bfloat16", model, memory_bytes=model_bytes) == "bfloat16"


def test_a_sharded_models_quantized_layers_go_float32_too():
    """A model over several ranks holds mlx's sharded layers (loader.shard_model),
    not QuantizedLinear ones: float32 dequantizes them as well (they stayed
    quantized, behind the int8 kernels on AVX2 CPUs, while the log said float32),
    and "quantized" keeps them. Over a group of one, the logits are the unsharded
    model's."""
    from mlx.nn.layers import distributed

    from tierlm.models.loader import shard_model

    def model(shard: bool, dtype: str):
        m = tiny_model("llama")
        nn.quantize(m, group_size=32, bits=4)
        if shard:
            shard_model(m, mx.distributed.init())  # a group of one rank here
        cpu_weights.convert(m, dtype)
        return m

    layers = lambda m: {type(layer).__name__ for _, layer in m.named_modules()}
    kept = layers(model(True, "quantized"))
    assert {"QuantizedAllToShardedLinear", "QuantizedShardedToAllLinear"} <= kept
    sharded = model(True, "float32")
    assert {"AllToShardedLinear", "ShardedToAllLinear"} <= layers(sharded)
    assert not any(isinstance(layer, cpu_weights.QUANTIZED) for _, layer in sharded.named_modules())
    assert isinstance(sharded.layers[0].self_attn.o_proj, distributed.ShardedToAllLinear)
    tokens = mx.array([[3, 14, 15, 92, 65]])
    np.testing.assert_allclose(np.array(sharded(tokens)), np.array(model(False, "float32")(tokens)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", cpu_dequantize.BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantizing_to_float32_reads_mlxs_packing_of_every_width(bits, group_size):
    """Against `mx.dequantize` given the scales and biases in float32 (as the
    quantized kernels read them), so both compute in float32."""
    weight = mx.random.normal((200, 3 * 128), key=mx.random.key(bits)).astype(mx.float16)
    packed, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    reference = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=group_size, bits=bits)
    got = cpu_dequantize.float32(packed, scales, biases, group_size, bits)
    assert got.dtype == mx.float32 and mx.array_equal(got, reference).item()


@pytest.fixture(scope="module")
def tiny_model_path(model_path, tmp_path_factory):
    """A tiny random Llama folder (the default model's tokenizer): the loader's
    options, without loading 135M weights for each."""
    return make_random_model("tiny", tmp_path_factory.mktemp("tiny-llama") / "model", model_path, "float32")


@needs_amx
def test_the_loader_packs_for_amx_unless_told_not_to(tiny_model_path):
    from tierlm.models.loader import load_model

    model, _ = load_model(tiny_model_path, use_amx=False, tokenizer=lambda: None)
    assert backends.describe(model).extra_bytes == 0 and backends.describe(model).layout_tag == b""
    model, _ = load_model(tiny_model_path, tokenizer=lambda: None)
    matmul_weights = cpu_amx.matmul_weights(model)
    assert len(matmul_weights) == 2 * 7 + 1  # seven Linears a layer, and the tied embedding
    assert backends.describe(model).extra_bytes == sum(w.size * 2 for w in matmul_weights) > 0  # bfloat16 copies


@pytest.mark.slow  # loads the default model twice
@needs_route
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
def test_what_the_loader_reports_in_use_runs(model_path, amx):
    """Every part the backend of a loaded model reports in use is counted over a
    prefill and a few decode steps, alone and as a batch of two."""
    from mlx_lm.models.cache import make_prompt_cache

    from tierlm.models.loader import load_model

    # float32: the route's parts (the quantized kernels' are counted in test_quantized_kernels.py)
    model, _ = load_model(model_path, cpu_weights_dtype="float32", use_amx=amx, tokenizer=lambda: None)
    backend = backends.describe(model)
    assert backend.name == "cpu" and backend.summary["weights"] == "float32"
    before = counts()
    for batch in (1, 2):
        cache = make_prompt_cache(model)
        logits = model(mx.array([[(7 * i) % 1000 + 3 for i in range(40)]] * batch), cache=cache)
        for token in (5, 9):
            logits = model(mx.array([[token]] * batch), cache=cache)
        mx.eval(logits)
    delta = ran(before)
    expected = {"sgemm"}
    if amx:
        expected.add("sgemm_amx")
    else:
        expected |= {"sgemm_gemv", "sgemm_blas"}  # one row alone; the prefill and the batch: the BLAS
    if STATE.exact_attention.on:
        expected.add("sgemm_exact")
    if "llama.scaled_dot_product_attention" in backend.summary["kernels"]:
        expected.add("kernel_attention")
    if "llama.swiglu" in backend.summary["kernels"]:
        expected.add("kernel_swiglu")
    if STATE.native_kernels.on:
        expected |= {"softmax", "swiglu"}
    missing = {k for k in expected if not delta.get(k)}
    assert not missing, f"reported in use, never ran: {missing}"
    if not amx:
        assert "sgemm_amx" not in delta
    stats = backend.stats()
    assert stats["calls"]["sgemm"] >= delta["sgemm"] and stats["extra_bytes"] == backend.extra_bytes


def test_stats_and_log_of_a_served_model_report_the_backend(server):
    """/stats has the backend's description and its live counters; the log has
    the fast path's line and its self-check."""
    stats = server.stats()["backend"]
    assert stats["name"] == "cpu" and stats["weights"] in ("quantized", "float32", "stored")
    if STATE.route.on:
        assert stats["route"].startswith("on") and stats["calls"]["sgemm"] > 0
        assert "CPU fast path self-check: a float32 product through MLX counted" in server.log()
    assert "CPU fast path: weights" in server.log()


@needs_amx
def test_a_collected_model_does_not_free_tiles_a_queued_graph_still_reads(model_path):
    """mlx-lm queues the next step with mx.async_eval; if the model is dropped
    meanwhile, its packed copies must outlive the products still running (this
    segfaulted when unpacking freed them at once)."""
    from conftest import wait_until

    from tierlm.models.loader import load_model

    model, _ = load_model(model_path, tokenizer=lambda: None)  # its tokenizer is not needed here
    logits = model(mx.array([[(7 * i) % 1000 + 3 for i in range(1024)]]))  # hundreds of products
    native_calls = lambda: sum(STATE.counts().values())  # the native kernels that ran or run now
    before = native_calls()
    mx.async_eval(logits)
    # dropped once the products have started (a race: the graph may end first, never fail falsely)
    wait_until(lambda: native_calls() > before, timeout=60, interval=0.001)
    del model
    gc.collect()
    assert bool(mx.isfinite(logits).all().item())


def test_no_cpu_kernels_keeps_mlx_lms_functions(tiny_model_path):
    from mlx_lm.models import llama

    from tierlm.models.loader import load_model

    model, _ = load_model(tiny_model_path, use_cpu_kernels=False, tokenizer=lambda: None)
    cpu_kernels.uninstall(model)  # another test in this process may have loaded it with them
    model, _ = load_model(tiny_model_path, use_cpu_kernels=False, tokenizer=lambda: None)
    assert not hasattr(llama.scaled_dot_product_attention, "original")
    assert not hasattr(llama.swiglu, "original")
    model, _ = load_model(tiny_model_path, tokenizer=lambda: None)
    try:
        assert hasattr(llama.scaled_dot_product_attention, "original")
    finally:
        cpu_kernels.uninstall(model)


def _half_scaled_tiny_model():
    """A tiny quantized model whose linear layers keep float16 scales and
    biases, as the GGUF importer writes them."""
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.update({"scales": m.scales.astype(mx.float16), "biases": m.biases.astype(mx.float16)})
    return model


@pytest.mark.parametrize("dtype", ["stored", "quantized"])
def test_float16_scales_stay_as_stored_or_are_read_as_they_are(dtype):
    """"stored" leaves them alone; "quantized" reads them as they are where the
    float kernels compute (graph_ops.HalfScalesQuantizedLinear), else widens
    them to float32 (which the int8 kernels read); the logits are the float32
    widening's either way."""
    from tierlm.backends.cpu import quantized

    model = _half_scaled_tiny_model()
    tokens = mx.array([[3, 5, 7, 11]])
    backend = backends.prepare(model, cpu_weights_dtype=dtype, memory_bytes=2**40)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers
    if dtype == "stored":
        assert all(type(m) is nn.QuantizedLinear and m.scales.dtype == mx.float16 for m in layers)
        assert backend.summary["half_scale_layers"] == 0
        return
    reads = quantized.reads_half_scales()
    assert all((type(m) is graph_ops.HalfScalesQuantizedLinear) == reads for m in layers)
    assert all(m.scales.dtype == (mx.float16 if reads else mx.float32) for m in layers)
    assert (f"{len(layers)} layers read their float16 scales as stored" in backend.log[2]) == reads
    assert backend.summary["half_scale_layers"] == (len(layers) if reads else 0)
    wide = _half_scaled_tiny_model()
    wide.update(model.parameters())
    for _, m in wide.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.update({"scales": m.scales.astype(mx.float32), "biases": m.biases.astype(mx.float32)})
    got, want = model(tokens), wide(tokens)
    assert got.dtype == mx.float32 and mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


def _int8_available() -> bool:
    from tierlm.backends.cpu import quantized, route

    state = route.prepare()
    return state.lib is not None and bool(state.lib.tierlm_qmm_available(quantized.PATHS["avx2-int8"]))


@pytest.mark.skipif(not _int8_available(), reason="needs AVX2")
def test_int8_activations_are_registered_for_the_models_life_and_tagged(monkeypatch):
    """TIERLM_INT8_ACTIVATIONS=on registers every quantized layer of the model
    with qgemm.c (no probe): its logits are the int8 products' (close to the
    float path's, not equal), the prefix cache's keys get the int8 tag, and the
    registration goes with the model. off, a wrong value, or auto without a
    reference text keep the float32 products and say why."""
    import gc

    from tierlm.backends.cpu import int8, quantized, route

    tokens = mx.array([[3, 5, 7, 11, 13]])
    floats = _half_scaled_tiny_model()
    # AMX off: its bfloat16 copies of the float layers would add a layout tag of their own
    want = backends.prepare(floats, cpu_weights_dtype="quantized", memory_bytes=2**40, cpu_amx=False)
    if not quantized.float_products():
        pytest.skip("the process runs a path other than the float ones (TIERLM_QUANT_KERNEL)")
    assert want.layout_tag == b"" and want.summary["int8_activations"].startswith("off (no reference text")
    before = int8.registered()
    monkeypatch.setenv("TIERLM_INT8_ACTIVATIONS", "on")
    model = _half_scaled_tiny_model()  # the same weights (seeded), in buffers of its own
    backend = backends.prepare(model, cpu_weights_dtype="quantized", memory_bytes=2**40, cpu_amx=False)
    layers = len([m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)])
    kernel = int8.kernel(route.current().lib)  # AVX-512 VNNI, else AVX2
    assert backend.summary["int8_activations"] == f"on ({layers} layers, {kernel}, TIERLM_INT8_ACTIVATIONS=on)"
    assert backend.layout_tag == int8.LAYOUT_TAG and "CPU int8 activations: on" in backend.log[3]
    assert int8.registered() == before + layers
    assert backend.extra_bytes == int8.laid_bytes(model) > 0  # its scales laid out by strips, outside MLX
    got, float_logits = model(tokens), floats(tokens)
    assert not mx.array_equal(got, float_logits).item()
    assert mx.allclose(got, float_logits, rtol=0.05, atol=0.05).item()
    del model, backend, got
    gc.collect()
    assert int8.registered() == before
    for value, why in (("off", "off (turned off by TIERLM_INT8_ACTIVATIONS=off)"),
                       ("maybe", "off (TIERLM_INT8_ACTIVATIONS=maybe is not one of auto, on, off)")):
        monkeypatch.setenv("TIERLM_INT8_ACTIVATIONS", value)
        other = _half_scaled_tiny_model()
        assert backends.prepare(other, cpu_weights_dtype="quantized",
                                memory_bytes=2**40, cpu_amx=False).summary["int8_activations"] == why
    assert int8.registered() == before


@needs_amx
@pytest.mark.skipif(not _int8_available(), reason="needs AVX2")
def test_amx_and_int8_products_in_one_model_tag_its_keys_with_both(monkeypatch):
    """The tiny model's float32 (tied) embedding is packed for AMX while its
    quantized layers take int8 activations: the prefix cache's keys carry both
    tags, so KV computed with int8 activations on and off never share keys;
    the memory added counts the AMX copies and the laid-out scales."""
    from tierlm.backends import cpu as cpu_backend
    from tierlm.backends.cpu import int8, quantized

    monkeypatch.setenv("TIERLM_INT8_ACTIVATIONS", "off")
    without = _half_scaled_tiny_model()
    off = backends.prepare(without, cpu_weights_dtype="quantized", memory_bytes=2**40)
    if not quantized.float_products():
        pytest.skip("the process runs a path other than the float ones (TIERLM_QUANT_KERNEL)")
    monkeypatch.setenv("TIERLM_INT8_ACTIVATIONS", "on")
    model = _half_scaled_tiny_model()
    on = backends.prepare(model, cpu_weights_dtype="quantized", memory_bytes=2**40)
    assert off.layout_tag == cpu_backend.AMX_LAYOUT_TAG
    assert on.layout_tag == cpu_backend.AMX_LAYOUT_TAG + int8.LAYOUT_TAG
    assert on.extra_bytes == cpu_amx.packed_bytes(model) + int8.laid_bytes(model)
    assert cpu_amx.packed_bytes(model) > 0 and int8.laid_bytes(model) > 0


@pytest.mark.skipif(not _int8_available(), reason="needs AVX2")
def test_the_probes_figure_is_remembered_by_the_weights(monkeypatch, tmp_path):
    """auto probes a model once: its figure goes to int8-probe.json in the cache
    folder, by a fingerprint of the weights and the text; the same weights
    loaded again read it back (no passes), other weights are probed anew, and
    a memo file that is not JSON is probed over and rewritten."""
    import json

    from tierlm.backends.cpu import int8, quantized

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    memo = tmp_path / "tierlm" / "int8-probe.json"
    tokens = list(range(3, 40))
    first = backends.prepare(_half_scaled_tiny_model(), cpu_weights_dtype="quantized", memory_bytes=2**40,
                             probe_tokens=tokens)
    if not quantized.float_products():
        pytest.skip("the process runs a path other than the float ones (TIERLM_QUANT_KERNEL)")
    assert "the probe moved log-probabilities by" in first.summary["int8_activations"]
    assert len(json.loads(memo.read_text())) == 1
    passes = []
    monkeypatch.setattr(int8, "_log_probs", lambda *a: passes.append(1))
    again = backends.prepare(_half_scaled_tiny_model(), cpu_weights_dtype="quantized", memory_bytes=2**40,
                             probe_tokens=tokens)
    assert again.summary["int8_activations"] == first.summary["int8_activations"] and not passes
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    memo.write_text("not json")
    other = tiny_model("llama", seed=1)
    nn.quantize(other, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    backends.prepare(other, cpu_weights_dtype="quantized", memory_bytes=2**40, probe_tokens=tokens)
    assert len(json.loads(memo.read_text())) == 1


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mask", [None, "causal", "padded"])
def test_kv_kept_quantized_in_the_batch_is_read_as_float32_by_the_same_attention(bits, mask):
    """A batch's KV at 8 or 4 bits takes tierlm's attention over its keys and
    values dequantized (mlx-lm's quantized attention was ~3x slower a decode
    step on the default model): mlx-lm's answer, keys scaled per channel."""
    from mlx_lm.models import base

    from tierlm.engine.key_scaling import KeyScales
    from tierlm.engine.quantized_kv import QuantizedBatchKVCache

    key = mx.random.key(5)
    keys, values = (mx.random.normal((2, 2, 40, 64), key=k) for k in mx.random.split(key))
    queries = mx.random.normal((2, 8, 3, 64), key=mx.random.key(6))
    scales = KeyScales(mx.where(mx.arange(64) % 16 == 0, 4.0, 1.0).reshape(1, 1, 1, 64) * mx.ones((1, 2, 1, 64)))
    cache = QuantizedBatchKVCache([0, 5], bits, key_scales=scales)
    q_keys, q_values = cache.update_and_fetch(keys, values)
    masks = {None: None, "causal": "causal", "padded": mx.arange(40)[None, None, None] >= mx.array([0, 5])[:, None, None, None]}
    # (key_scaling has mlx-lm's quantized attention multiply the queries by the keys' factors)
    want = base.quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale=0.125,
                                                       mask=masks[mask], group_size=64, bits=bits)
    before = cpu_kernels.calls["quantized_kv"]
    got = cpu_kernels._wrap_attention(base.scaled_dot_product_attention)(queries, q_keys, q_values, cache, 0.125,
                                                                         masks[mask])
    assert cpu_kernels.calls["quantized_kv"] == before + 1
    assert mx.allclose(got, want, atol=1e-4).item(), mx.abs(got - want).max()
    # where the native kernels run, one operation that dequantizes a KV head at a time: the
    # same bits as the attention over the whole KV made float32 first
    from tierlm.backends.cpu import dequantize, graph_ops

    if cpu_kernels.native_kernels() and graph_ops.install().on:
        fused = cpu_kernels.quantized_attention(scales.queries(queries), q_keys, q_values, 0.125, masks[mask], 64, bits)
        whole = cpu_kernels.attention(scales.queries(queries), *(dequantize.kv_float32(t, 64, bits)
                                                                 for t in (q_keys, q_values)), 0.125, masks[mask])
        assert fused is not None and mx.array_equal(fused, whole).item() and mx.array_equal(got, fused).item()
