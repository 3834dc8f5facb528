"""A real BLAS under MLX's Linux CPU backend.

The `mlx[cpu]` wheel links a reference BLAS dynamically and calls `cblas_sgemm`
through it; a faster library loaded first with RTLD_GLOBAL takes those calls
over. Measured here: a float32 matmul of SmolLM2's shapes goes from ~4 to
120-250 GFLOP/s. MLX sends only float32 matmuls to BLAS, which is why the CPU
fast path also runs the weights in float32 (see models/cpu_weights.py).

This must run before anything imports `mlx.core`; `tierlm/__init__.py` calls it.
TIERLM_BLAS=off turns it off, TIERLM_BLAS=/path/to/lib.so picks a library.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import os
import sys

# OpenBLAS's pthread build first: its OpenMP build collapsed when the CPU was shared.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian/Ubuntu libopenblas0-pthread
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL, pthread build
    "/usr/lib64/libopenblas.so.0",
)

status = {"library": None, "reason": "not attempted"}


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
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            ok = hasattr(lib, "cblas_sgemm")
            status.update(library=path if ok else None, reason="loaded" if ok else "no cblas_sgemm in it")
        except OSError as e:
            status.update(reason=f"could not load {path}: {e}")
    return status
