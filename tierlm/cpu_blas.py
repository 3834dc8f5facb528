"""A real BLAS under MLX's Linux CPU backend.

The `mlx[cpu]` wheel links a reference BLAS dynamically and calls `cblas_sgemm`
through it; a faster library loaded first with RTLD_GLOBAL takes those calls
over. Measured here: a float32 matmul of SmolLM2's shapes goes from ~4 to
120-250 GFLOP/s. MLX sends only float32 matmuls to BLAS, which is why the CPU
fast path also runs the weights in float32 (see models/cpu_weights.py).

MLX also calls `cblas_sgemm` for the one-row products of decoding a single
sequence, a shape OpenBLAS's sgemm reads at a third of the memory bandwidth its
sgemv reaches; native/gemv_route.c, built here with the system C compiler,
sends those to `cblas_sgemv` (SmolLM2 decode at batch 1: 86 -> 50 ms a step).

This must run before anything imports `mlx.core`; `tierlm/__init__.py` calls it.
TIERLM_BLAS=off turns it off, TIERLM_BLAS=/path/to/lib.so picks a library,
TIERLM_GEMV_ROUTE=off loads the library without the one-row route.
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

status = {"library": None, "reason": "not attempted", "gemv_route": "off"}

ROUTE_SOURCE = Path(__file__).parent / "native" / "gemv_route.c"


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
    """Loads the BLAS at `path` globally, behind the one-row route when it builds."""
    route = _route_for(path)  # says why when it is off; never raises
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # after the route: MLX finds its sgemm first
    except OSError as e:
        return {"reason": f"could not load {path}: {e}"}
    if not hasattr(lib, "cblas_sgemm"):
        return {"reason": "no cblas_sgemm in it"}
    return {"library": path, "reason": "loaded", "gemv_route": route}


def _route_for(blas_path: str) -> str:
    """Puts the one-row route in front of `blas_path`; says whether it did."""
    if os.environ.get("TIERLM_GEMV_ROUTE") == "off":
        return "off (TIERLM_GEMV_ROUTE=off)"
    try:
        built = _build_route()
        route = ctypes.CDLL(str(built), mode=ctypes.RTLD_LOCAL)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"off (could not build or load it: {e})"
    if not route.tierlm_route_open(blas_path.encode()):
        return "off (the library lacks cblas_sgemm or cblas_sgemv)"
    ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)  # now global, ahead of the real BLAS
    return "on"


def _build_route() -> Path:
    """The compiled route, built once per source version into the user's cache."""
    digest = hashlib.sha256(ROUTE_SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm" / "native"
    built = cache / f"gemv_route-{digest}.so"
    if built.exists():
        return built
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # then a rename: safe when two start at once
        tmp = Path(scratch) / built.name
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(ROUTE_SOURCE), "-ldl"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, built)
    return built
