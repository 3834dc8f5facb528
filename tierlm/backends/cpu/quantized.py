"""Quantized weights on MLX's CPU backend, multiplied by tierlm's kernels.

MLX's CPU `quantized_matmul` computes one element at a time (~1 GB/s of
weights here), so the CPU fast path used to run every model in float32: four to
eight times the memory, and decode bound by reading it. native/qgemm.c computes
the same product on the weights as MLX stores them (affine, 4, 5 or 8 bits,
groups of 32, 64 or 128):

- with AVX-512 or AVX2 + FMA (qgemm_float.c, one source built for 16 and for 8
  lanes), in float32: each block of weights is unpacked in registers and
  multiplied into the float activations; a prompt's (or a large batch's)
  weights are dequantized once into cache-sized panels;
- for the models int8.py's probe lets take int8 activations, as llama.cpp
  computes its quantized products: the activations are quantized to int8 per
  32 values and each block is an integer dot product, 16 output columns a
  vector with AVX-512 VNNI (avx512-vnni, qgemm_vnni512.c), 8 with AVX2
  (avx2-int8, qgemm_int8_avx2.c): fewer instructions, but the int8
  activations move some models' answers; AVX-VNNI's by name only (avx-vnni);
- anywhere else, the integer products in plain C.

Every row has the same bits alone or batched.

native/qmm_hook.cpp puts it behind MLX's own operation: `install()` builds it
against the installed mlx package's headers, writes its function into the slot
of MLX's vtable through which QuantizedMatmul is evaluated on the CPU, and
proves it with one product (counted, and MLX's own answer within the int8
activations' error). Products it does not take (other bits, float16 or
bfloat16 activations, other bits) go to MLX's own code; strided activations
are gathered into rows first. Scales and biases are read as float32 or, on the
paths that keep them as stored (KEEPING_PATHS), float16; weights.py widens
them for the others.

TIERLM_QUANT_KERNEL picks the path: auto (avx512, else avx2, else portable),
avx512, avx2, avx512-vnni, avx-vnni, avx2-int8, portable (plain C, any CPU), or
off (MLX's own). Under auto the products of a model int8.py registered take the
avx512-vnni products where the CPU has VNNI, else the avx2-int8 ones. TIERLM_MAX_CPU_ISA caps what the CPU reports (isa.py): with
avx2, auto is avx2.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from tierlm.backends.cpu import isa, native
from tierlm.backends.cpu.route import Feature

HOOK_SOURCE = native.HERE / "qmm_hook.cpp"
# qgemm.c's path numbers, by the names TIERLM_QUANT_KERNEL takes
PATHS = {"avx512": 3, "avx2": 4, "avx512-vnni": 5, "avx-vnni": 2, "avx2-int8": 1, "portable": 0}
FLOAT_PATHS = ("avx512", "avx2")  # float32 activations; the others quantize them to int8 per 32 values
# the paths that keep every quantized model's weights quantized (not only those
# float32 does not fit), read their float16 scales and biases as stored, and give
# a row the same bits alone or batched: the float ones `auto` picks, and the
# int8 ones when named (int8.py's models take them under auto too)
KEEPING_PATHS = ("avx512-vnni", "avx2-int8") + FLOAT_PATHS
# each path's feature (isa.FEATURES)
NEEDS = {"avx512": "avx512f", "avx2": "avx2", "avx512-vnni": "avx512vnni", "avx-vnni": "avx-vnni", "avx2-int8": "avx2"}
NAMES = {number: name for name, number in PATHS.items()}
BITS = (4, 5, 8)  # what qgemm.c multiplies; MLX's own code takes the rest
GROUP_SIZES = (32, 64, 128)

_lock = threading.Lock()
_feature: Feature | None = None
_path: str | None = None  # the path install() put in use, by its PATHS name
_hook: ctypes.CDLL | None = None


def build_hook() -> Path:
    """qmm_hook.cpp compiled against the installed mlx, once per source and mlx version."""
    return native.build_against_mlx("tierlm_qmm_hook", HOOK_SOURCE)


def _load_hook() -> ctypes.CDLL:
    try:
        hook = ctypes.CDLL(str(build_hook()), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        raise native.BuildError(f"could not load it: {e}") from e
    hook.tierlm_qmm_hook_install.argtypes = [ctypes.c_void_p] * 3
    hook.tierlm_qmm_hook_taken.restype = ctypes.c_ulong
    hook.tierlm_qmm_hook_passed.restype = ctypes.c_ulong
    return hook


def install(lib: ctypes.CDLL | None) -> Feature:
    """Puts qgemm.c behind MLX's quantized matmul for this process, once; later
    calls return the same answer. Never raises: says why it is off."""
    global _feature
    with _lock:
        if _feature is None:
            try:
                _feature = _install(lib)
            except Exception as e:  # noqa: BLE001  optional: a bug here must not stop the model
                remove()
                _feature = Feature(False, f"setting it up failed: {type(e).__name__}: {e}")
        return _feature


def wanted() -> bool:
    """TIERLM_QUANT_KERNEL does not turn the kernels off: the hook is worth building."""
    return os.environ.get("TIERLM_QUANT_KERNEL", "auto") != "off"


def decided() -> bool:
    """Whether install() has run in this process (its library built or not)."""
    return _feature is not None


def on() -> bool:
    return _feature is not None and _feature.on


def float_products() -> bool:
    """The kernels in use multiply in float32 (avx512, avx2), not with int8 activations."""
    return on() and _path in FLOAT_PATHS


def keeps_weights_quantized() -> bool:
    """The path in use is one of KEEPING_PATHS: quantized weights stay
    quantized, and batching moves no bit."""
    return on() and _path in KEEPING_PATHS


def reads_half_scales() -> bool:
    """Whether layers keep float16 scales and biases for the float kernels to
    read as they are (graph_ops.HalfScalesQuantizedLinear): a decode step
    streams every one of them. TIERLM_HALF_SCALES=off widens them at load."""
    return keeps_weights_quantized() and os.environ.get("TIERLM_HALF_SCALES") != "off"


def _choose_path(lib: ctypes.CDLL) -> tuple[int | None, str]:
    """qgemm.c's path, and why; None: off."""
    choice = os.environ.get("TIERLM_QUANT_KERNEL", "auto")
    if not wanted():
        return None, "turned off by TIERLM_QUANT_KERNEL=off"
    if bad_cap := isa.bad_value(lib):
        return None, bad_cap
    if choice == "auto":
        number = lib.tierlm_qmm_select(-1)
        return number, f"the fastest this CPU has{isa.under(lib)}"
    if choice not in PATHS:
        return None, f"TIERLM_QUANT_KERNEL={choice} is not one of auto, off, {', '.join(PATHS)}"
    if not lib.tierlm_qmm_available(PATHS[choice]):
        return None, f"TIERLM_QUANT_KERNEL={choice}: this CPU lacks it{isa.hiding(lib, NEEDS[choice])}"
    return lib.tierlm_qmm_select(PATHS[choice]), f"TIERLM_QUANT_KERNEL={choice}"


def _install(lib: ctypes.CDLL | None) -> Feature:
    global _hook, _path
    if lib is None:
        return Feature(False, "the native library is not loaded")
    number, why = _choose_path(lib)
    if number is None:
        return Feature(False, why)
    try:
        hook = _load_hook()
    except native.BuildError as e:
        return Feature(False, f"could not build or load the hook: {e}")
    want = _product(mx.float32)  # MLX's own answer, before the slot is written
    functions = (native.function_address(lib, name) for name in ("tierlm_qmm", "tierlm_qmm_half", "tierlm_qmm_supports"))
    if not hook.tierlm_qmm_hook_install(*functions):
        return Feature(False, "MLX's QuantizedMatmul slot was not found where the C++ ABI puts it")
    _hook = hook
    proved, check = self_check(want)
    if not proved:
        remove()
        return Feature(False, check)
    _path = NAMES[number]
    vbmi = "; 5-bit blocks unpacked with VBMI" if _path == "avx512" and lib.tierlm_qmm_avx512_vbmi(-1) else ""
    return Feature(True, f"{_path}, {why}; {check}{vbmi}")


def remove() -> None:
    """Gives MLX's slot back its own function."""
    if _hook is not None:
        _hook.tierlm_qmm_hook_remove()


def taken() -> int:
    """Quantized products qgemm.c took so far in this process."""
    return int(_hook.tierlm_qmm_hook_taken()) if _hook is not None else 0


def left_to_mlx() -> int:
    """Quantized products the hook handed to MLX's own code (formats it does not take)."""
    return int(_hook.tierlm_qmm_hook_passed()) if _hook is not None else 0


def _product(dtype) -> np.ndarray:
    """One 4-bit product through MLX's CPU backend."""
    rng = np.random.default_rng(7)
    weight = mx.array(rng.standard_normal((48, 256)).astype(np.float32))
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    with mx.stream(mx.cpu):
        w, scales, biases = mx.quantize(weight, group_size=32, bits=4)
        out = mx.quantized_matmul(x.astype(dtype), w, scales.astype(dtype), biases.astype(dtype),
                                  transpose=True, group_size=32, bits=4)
        mx.eval(out)
    return np.array(out.astype(mx.float32))


def self_check(want: np.ndarray) -> tuple[bool, str]:
    """One quantized product through MLX: proved when the hook counted it and it
    is MLX's own answer within the error of int8 activations."""
    before = taken()
    got = _product(mx.float32)
    if taken() == before:
        return False, "a quantized product through MLX did not reach the kernels"
    error = float(np.abs(got - want).max() / np.abs(want).max())
    if error > 0.02:
        return False, f"a quantized product through the kernels was off by {error:.3f} of MLX's own"
    return True, f"a 4-bit product through MLX took them, within {error:.4f} of MLX's own"
