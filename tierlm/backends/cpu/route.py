"""A real BLAS under MLX's Linux CPU backend, behind tierlm's sgemm route.

The `mlx[cpu]` wheel calls a bundled reference BLAS's `cblas_sgemm` for every
float32 matmul. A real one is much faster: a float32 matmul of SmolLM2's shapes
goes from ~4 to 120-250 GFLOP/s with OpenBLAS. MLX sends only float32 matmuls to
BLAS, which is why the CPU fast path also runs the weights in float32
(weights.py).

In front of the BLAS sits native/sgemm_route.c (built by native.py). It takes
MLX's `cblas_sgemm` calls and sends
- products by a weight packed for AMX (amx.py) to the tile unit;
- attention's small products, with AVX-512 or AVX2, to kernels that sum in one
  fixed order, so batching changes no bit (native/exact_gemm.c);
- the one-row products of decoding a single sequence to `cblas_sgemv`: OpenBLAS's
  sgemm reads that shape at a third of the memory bandwidth its sgemv reaches
  (SmolLM2 decode at batch 1: 86 -> 50 ms a step);
- the rest to the BLAS's own `cblas_sgemm`.

How MLX's calls get there: `prepare()`, run when the first model is loaded on
MLX's CPU backend, loads the BLAS and the route with RTLD_LOCAL and writes the
route's address into the slot through which MLX's own library calls
`cblas_sgemm` (got.py). So it works whatever was imported first and touches no
other library's calls. Then it proves it: one small float32 product through MLX
must be counted by the route (native/counters.h) and give numpy's answer.
Otherwise the slots get back what they held, the log and /stats say why, and
MLX runs on its bundled BLAS.

TIERLM_BLAS=off turns all of this off (and the native kernels with it),
TIERLM_BLAS=/path/to/lib.so picks a library, TIERLM_GEMV_ROUTE=off leaves the
one-row products to the BLAS's sgemm, TIERLM_EXACT_ATTENTION=off attention's
products (faster, not bit-exact batched), TIERLM_MAX_CPU_ISA=avx2 (or avx-vnni,
avx512) hides the CPU's newer features from the native code (isa.py). Without a
C compiler the BLAS's own `cblas_sgemm` goes into the slot, checked by a
counting stand-in for the one product.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from tierlm.backends.cpu import got, isa, native

# OpenBLAS's pthread build first: its OpenMP build collapsed when the CPU was shared.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian/Ubuntu libopenblas0-pthread
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL, pthread build
    "/usr/lib64/libopenblas.so.0",
)
SYMBOL = "cblas_sgemm"


@dataclass(frozen=True)
class Feature:
    """One part of the fast path: whether it is in use, and what (or why not)."""

    on: bool
    detail: str = ""

    def __str__(self) -> str:
        if self.on:
            return f"on ({self.detail})" if self.detail else "on"
        return f"off ({self.detail})"


def _off(why: str) -> Feature:
    return Feature(False, why)


@dataclass(frozen=True)
class State:
    """What MLX's float32 matmuls reach in this process, and what the native library offers."""

    blas: Feature  # on: the library's path
    route: Feature  # tierlm's sgemm route in MLX's slot, proved by the self-check
    gemv: Feature  # one-row products to cblas_sgemv
    exact_attention: Feature  # attention's products summed in a fixed order (AVX-512 or AVX2)
    amx: Feature  # AMX-BF16 tiles for packed weights
    native_kernels: Feature  # softmax, SwiGLU and log-sum-exp in native code (AVX-512 or AVX2)
    self_check: str  # what the start-up product showed
    lib: ctypes.CDLL | None = field(default=None, repr=False, compare=False)
    warning: str | None = None  # a part that should have worked and did not (an upgraded MLX, ...)

    @property
    def blas_path(self) -> str | None:
        return self.blas.detail if self.blas.on else None

    def counts(self) -> dict[str, int]:
        """The native library's call counters (native/counters.h)."""
        return native.counts(self.lib)


_lock = threading.Lock()
_state: State | None = None
_written: list[tuple[got.Slot, int]] = []  # the slots written, with what they held


def prepare() -> State:
    """Sets up the BLAS and the route for this process, once; later calls return
    the same state. Never raises for a missing piece: it says why it is off."""
    global _state
    with _lock:
        if _state is None:
            try:
                _state = _prepare()
            except Exception as e:  # noqa: BLE001  the fast path is optional: a bug in it must not stop the model
                _restore()
                _state = _nothing(f"setting it up failed: {type(e).__name__}: {e}", warn=True)
        return _state


def current() -> State | None:
    """The state once `prepare` has run, else None."""
    return _state


def _nothing(why: str, lib: ctypes.CDLL | None = None, check: str = "not run", warn: bool = False) -> State:
    off = _off(why)
    return State(blas=off, route=off, gemv=off, exact_attention=off, amx=off,
                 native_kernels=_native_kernels(lib) if lib else off, self_check=check, lib=lib,
                 warning=f"CPU fast path off: {why}; MLX runs on its bundled BLAS" if warn else None)


def _find(choice: str) -> str | None:
    if choice not in ("", "auto"):
        return choice
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))  # `pip install mkl`
    return next((p for p in (*CANDIDATES, *mkl) if os.path.exists(p)), None)


def mlx_slots() -> list[got.Slot]:
    """The slots through which the libraries of the loaded mlx package call cblas_sgemm."""
    package = Path(mx.__file__).resolve().parent
    slots = []
    for obj in got.loaded_objects():
        real = Path(os.path.realpath(obj.path))
        if package in real.parents:
            slots += got.slots_in(got.LoadedObject(str(real), obj.base), SYMBOL)
    return slots


def _product() -> tuple[mx.array, np.ndarray]:
    """One small float32 product through MLX's CPU backend, and numpy's answer."""
    a = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    b = np.linspace(1, -1, 64 * 40, dtype=np.float32).reshape(64, 40)
    with mx.stream(mx.cpu):
        out = mx.array(a) @ mx.array(b)
        mx.eval(out)
    return out, a @ b


def _prepare() -> State:
    choice = os.environ.get("TIERLM_BLAS", "auto")
    if choice == "off":
        return _nothing("turned off by TIERLM_BLAS=off")
    if not sys.platform.startswith("linux"):
        return _nothing("not needed on this backend")
    path = _find(choice)
    if path is None:
        return _nothing("no BLAS found (install libopenblas0-pthread)")
    try:
        slots = mlx_slots()
    except (OSError, got.ElfError) as e:
        return _nothing(f"could not read MLX's library: {e}", warn=True)
    if not slots:
        return _nothing(f"MLX's libraries import no {SYMBOL}: its matmuls cannot be reached", warn=True)
    _product()  # binds a lazily bound slot now, so that the linker does not overwrite it later
    if unexpected := [s for s in slots if not got.expected(s)]:
        where = unexpected[0].library
        return _nothing(f"{where}'s {SYMBOL} slot holds an address the linker did not put there", warn=True)
    try:
        blas = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        return _nothing(f"could not load {path}: {e}")
    if not hasattr(blas, SYMBOL):
        return _nothing(f"no {SYMBOL} in {path}")
    try:
        lib = native.load()
    except native.BuildError as e:
        return _blas_alone(path, blas, slots, f"could not build or load it: {e}")
    one_row = os.environ.get("TIERLM_GEMV_ROUTE") != "off"
    exact = os.environ.get("TIERLM_EXACT_ATTENTION") != "off"
    if not lib.tierlm_route_open(path.encode(), int(one_row), int(exact)):
        return _blas_alone(path, blas, slots, "the library lacks cblas_sgemm or cblas_sgemv", lib)
    _write(slots, native.function_address(lib, SYMBOL))
    proved, check = self_check(lambda: native.counts(lib)["sgemm"])
    if not proved:
        _restore()
        return _nothing(f"MLX's matmuls do not reach it: {check}", lib, check, warn=True)
    kernels = _native_kernels(lib)  # the exact attention products are float kernels too
    bad_cap = isa.bad_value(lib)
    return State(
        blas=Feature(True, path),
        route=Feature(True, f"{len(slots)} slot of MLX's {SYMBOL}" if len(slots) == 1
                      else f"{len(slots)} slots of MLX's {SYMBOL}"),
        gemv=Feature(True) if one_row else _off("TIERLM_GEMV_ROUTE=off"),
        exact_attention=kernels if exact or not kernels.on else _off("TIERLM_EXACT_ATTENTION=off"),
        amx=_amx(lib),
        native_kernels=kernels,
        self_check=check,
        lib=lib,
        warning=f"{bad_cap}: every kernel it caps is off" if bad_cap else None,
    )


def self_check(count) -> tuple[bool, str]:
    """One small float32 product through MLX: proved when `count()` went up over
    it and the product is numpy's."""
    before = count()
    out, want = _product()
    calls = count() - before
    if calls == 0:
        return False, f"a float32 product through MLX was not counted at {SYMBOL}"
    if not np.allclose(np.array(out), want, rtol=1e-4, atol=1e-4):
        return False, "a float32 product through the route gave a wrong answer"
    return True, f"a float32 product through MLX counted {calls} call(s), numpy's answer"


_SGEMM = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int)


def _blas_alone(path: str, blas: ctypes.CDLL, slots, why: str, lib: ctypes.CDLL | None = None) -> State:
    """The BLAS's own cblas_sgemm in MLX's slots (no route). A counting stand-in
    takes the self-check's product first (a Python callback: too slow to keep)."""
    real = ctypes.cast(getattr(blas, SYMBOL), ctypes.c_void_p).value
    forward, calls = _SGEMM(real), [0]

    @_SGEMM
    def counting(*args):
        calls[0] += 1
        forward(*args)

    _write(slots, ctypes.cast(counting, ctypes.c_void_p).value)
    try:
        proved, check = self_check(lambda: calls[0])
    finally:
        _restore()
    route = _off(why)
    if not proved:
        return State(blas=_off(f"MLX's matmuls do not reach it: {check}"), route=route, gemv=route,
                     exact_attention=route, amx=route, native_kernels=_native_kernels(lib) if lib else route,
                     self_check=check, lib=lib,
                     warning=f"CPU fast path off: {check}; MLX runs on its bundled BLAS")
    _write(slots, real)
    return State(blas=Feature(True, path), route=route, gemv=route, exact_attention=route, amx=route,
                 native_kernels=_native_kernels(lib) if lib else route, self_check=check, lib=lib)


def _write(slots: list[got.Slot], address: int) -> None:
    for slot in slots:
        previous = got.write(slot, address)
        if not any(s == slot for s, _ in _written):
            _written.append((slot, previous))


def restore_slots() -> None:
    """Gives MLX's cblas_sgemm slots back what they held before `prepare` wrote
    them: MLX's matmuls run on its bundled BLAS again, so `self_check` fails.
    `current()` still describes what `prepare` set up. For tests and comparisons."""
    with _lock:
        _restore()


def _restore() -> None:
    """Gives every written slot back what it held before tierlm wrote it (under `_lock`)."""
    while _written:
        slot, previous = _written.pop()
        got.write(slot, previous)


def _native_kernels(lib: ctypes.CDLL) -> Feature:
    """The float kernels (native/float_kernels.c): AVX-512's where the CPU has
    it, else AVX2's (with FMA), else none."""
    lanes = lib.tierlm_float_lanes()
    if lanes == 16:
        return Feature(True, "AVX-512")
    if lanes == 8:
        hidden = f", AVX-512 hidden{isa.under(lib)}" if isa.hiding(lib, "avx512f") else ""
        return Feature(True, f"AVX2{hidden}")
    return _off(isa.lacks(lib, "avx2", "AVX2 and FMA"))


def _amx(lib: ctypes.CDLL) -> Feature:
    if not lib.tierlm_amx_compiled():
        return _off("the C compiler has no AMX intrinsics")
    if lib.tierlm_amx_available():
        return Feature(True, "AMX-BF16")
    return _off(isa.lacks(lib, "amx-bf16", "AMX-BF16"))
