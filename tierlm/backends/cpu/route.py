"""A real BLAS under MLX's Linux CPU backend.

The `mlx[cpu]` wheel links a reference BLAS dynamically and calls `cblas_sgemm`
through it; a faster library loaded first with RTLD_GLOBAL takes those calls
over. Measured here: a float32 matmul of SmolLM2's shapes goes from ~4 to
120-250 GFLOP/s. MLX sends only float32 matmuls to BLAS, which is why the CPU
fast path also runs the weights in float32 (see weights.py).

In front of the BLAS sits native/sgemm_route.c, built here with the system C
compiler (with native/amx_bf16.c). It takes MLX's `cblas_sgemm` calls and sends
- products by a weight packed for AMX (amx.py) to the tile unit;
- attention's small products, with AVX-512, to kernels that sum in one fixed
  order, so batching changes no bit (native/exact_gemm.c);
- the one-row products of decoding a single sequence to `cblas_sgemv`: OpenBLAS's
  sgemm reads that shape at a third of the memory bandwidth its sgemv reaches
  (SmolLM2 decode at batch 1: 86 -> 50 ms a step);
- the rest to the BLAS's own `cblas_sgemm`.

This must run before anything imports `mlx.core`; `tierlm/__init__.py` calls it.
TIERLM_BLAS=off turns it off, TIERLM_BLAS=/path/to/lib.so picks a library,
TIERLM_GEMV_ROUTE=off leaves the one-row products to the BLAS's sgemm,
TIERLM_EXACT_ATTENTION=off attention's products (faster, not bit-exact batched).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# OpenBLAS's pthread build first: its OpenMP build collapsed when the CPU was shared.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian/Ubuntu libopenblas0-pthread
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL, pthread build
    "/usr/lib64/libopenblas.so.0",
)

status = {"library": None, "reason": "not attempted", "gemv_route": "off", "amx": "off", "attention": "off"}

NATIVE_SOURCES = [Path(__file__).parent / "native" / name for name in ("sgemm_route.c", "amx_bf16.c", "exact_gemm.c", "softmax.c", "swiglu.c")]
NATIVE_HEADERS = [Path(__file__).parent / "native" / "exp512.h"]

# tierlm's native library once loaded (the route, AMX packing, attention's softmax): amx.py and kernels.py call into it
native: ctypes.CDLL | None = None


def _has_cuda_mlx() -> bool:
    for dist in ("mlx-cuda", "mlx-cuda-12", "mlx-cuda-13"):
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def _find(choice: str) -> str | None:
    if choice not in ("", "auto"):
        return choice
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))  # `pip install mkl`
    return next((p for p in (*CANDIDATES, *mkl) if os.path.exists(p)), None)


def preload() -> dict:
    """Load the best BLAS found; records what happened in `status`."""
    choice = os.environ.get("TIERLM_BLAS", "auto")
    if choice == "off":
        status.update(reason="turned off by TIERLM_BLAS=off")
    elif not sys.platform.startswith("linux") or _has_cuda_mlx():
        status.update(reason="not needed on this backend")
    elif "mlx.core" in sys.modules:
        status.update(reason="mlx was imported before tierlm; import tierlm first")
    elif (path := _find(choice)) is None:
        status.update(reason="no BLAS found (install libopenblas0-pthread)")
    else:
        status.update(_load(path))
    return status


def _load(path: str) -> dict:
    """Loads the BLAS at `path` globally, behind the route when it builds."""
    routed = _route_for(path)  # says why when it is off; never raises
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # after the route: MLX finds its sgemm first
    except OSError as e:
        return {"reason": f"could not load {path}: {e}"}
    if not hasattr(lib, "cblas_sgemm"):
        return {"reason": "no cblas_sgemm in it"}
    return {"library": path, "reason": "loaded", **routed}


def _route_for(blas_path: str) -> dict:
    """Puts the route in front of `blas_path`; the status of what it routes."""
    global native
    one_row = os.environ.get("TIERLM_GEMV_ROUTE") != "off"
    exact = os.environ.get("TIERLM_EXACT_ATTENTION") != "off"
    try:
        built = _build_route()
        lib = ctypes.CDLL(str(built), mode=ctypes.RTLD_LOCAL)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return {"gemv_route": f"off (could not build or load it: {e})"}
    if not lib.tierlm_route_open(blas_path.encode(), int(one_row), int(exact)):
        return {"gemv_route": "off (the library lacks cblas_sgemm or cblas_sgemv)"}
    ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)  # now global, ahead of the real BLAS
    _declare(lib)
    native = lib
    return {"gemv_route": "on" if one_row else "off (TIERLM_GEMV_ROUTE=off)", "amx": _amx_status(lib),
            "attention": _attention_status(lib, exact)}


def _attention_status(lib: ctypes.CDLL, exact: bool) -> str:
    if not lib.tierlm_avx512_available():
        return "off (no AVX-512 on this CPU)"
    return "avx512" if exact else "avx512, products through the BLAS (TIERLM_EXACT_ATTENTION=off)"


def _amx_status(lib: ctypes.CDLL) -> str:
    if not lib.tierlm_amx_compiled():
        return "off (the C compiler has no AMX intrinsics)"
    return "available" if lib.tierlm_amx_available() else "off (no AMX-BF16 on this CPU)"


def _declare(lib: ctypes.CDLL) -> None:
    """The argument types of what amx.py and kernels.py call in the native library."""
    lib.tierlm_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tierlm_amx_unpack.argtypes = [ctypes.c_void_p]
    lib.tierlm_softmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.tierlm_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.tierlm_logsumexp_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]


def _build_route() -> Path:
    """The compiled native library, built once per source version into the user's cache."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in NATIVE_SOURCES + NATIVE_HEADERS)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm" / "native"
    built = cache / f"tierlm_native-{digest}.so"
    if built.exists():
        return built
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # then a rename: safe when two start at once
        tmp = Path(scratch) / built.name
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(tmp), *map(str, NATIVE_SOURCES), "-ldl", "-lpthread", "-lm"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError:  # a compiler too old for AMX: build the rest
            subprocess.run([*command, "-DTIERLM_NO_AMX"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, built)
    return built
