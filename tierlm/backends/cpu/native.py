"""tierlm's native library: the C under native/, built once with the system C
compiler into the user's cache and loaded with RTLD_LOCAL (it exports nothing
to the process; MLX reaches its `cblas_sgemm` only through the slot route.py
writes).

What is in it: the sgemm route (sgemm_route.c), AMX weight tiles and their
products (amx_bf16.c), attention's fixed-order products (exact_gemm.c, shared
over the cores by threads.c), the row softmax (with or without a mask) and
log-sum-exp (softmax.c), SwiGLU and GELU (swiglu.c), MLX's quantized matmul
(qgemm.c, with qgemm_avx512.c and unpack.h); counters.h counts the
calls each of them serves, which the self-check and the tests read. Each asks
cpu_features.c what the CPU has, capped by TIERLM_MAX_CPU_ISA (isa.py).

Built the first time a model is loaded on MLX's CPU backend, never on import.
CC picks the compiler, XDG_CACHE_HOME the cache folder. The C++ libraries
built against MLX (graph_ops.cpp, qmm_hook.cpp) start building beside it
(`in_background`): one after the other after it, a fresh install's first load
waited ~7.6 s more for them on two cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent / "native"
SOURCES = [HERE / name for name in ("sgemm_route.c", "amx_bf16.c", "float_kernels.c", "float_avx512.c", "float_avx2.c",
                                        "qgemm.c", "qgemm_vnni512.c", "qgemm_int8_avx2.c", "threads.c", "cpu_features.c")]
# included, not compiled alone: the float kernels' sources are compiled once per width (float_avx*.c)
HEADERS = [HERE / name for name in ("simd.h", "exact_gemm.c", "softmax.c", "swiglu.c", "qgemm_float.c", "counters.h",
                                    "threads.h", "unpack.h", "cpu_features.h", "qgemm_int8.h")]

# The order of counters.h's enum: what each tierlm_counts slot counts.
COUNTERS = ("sgemm", "sgemm_amx", "sgemm_exact", "sgemm_gemv", "sgemm_blas", "softmax", "swiglu", "logsumexp", "gelu",
            "qmm")


class BuildError(RuntimeError):
    """The native library could not be built or loaded."""


def cache_folder() -> Path:
    """tierlm's folder in the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm"


_in_flight: dict[Path, Future] = {}  # libraries being built in this process, by path
_in_flight_lock = threading.Lock()


def build_once(stem: str, inputs: bytes, language: str, compiler_variable: str, default_compiler: str,
               compile_into) -> Path:
    """A library built once per version of `inputs` into the user's cache:
    `compile_into(compiler, path)` writes it (raising subprocess's errors). A
    call while another thread builds the same one waits for that build."""
    digest = hashlib.sha256(inputs).hexdigest()[:16]
    built = cache_folder() / "native" / f"{stem}-{digest}.so"
    if built.exists():
        return built
    with _in_flight_lock:
        building = _in_flight.get(built)
        ours = building is None
        if ours:
            building = _in_flight[built] = Future()
    if not ours:
        return building.result()  # raises the builder's BuildError too
    try:
        building.set_result(_build(built, language, compiler_variable, default_compiler, compile_into))
    except BaseException as e:
        building.set_exception(e)
    finally:
        with _in_flight_lock:
            del _in_flight[built]
    return building.result()


def in_background(*builders: Callable[[], Path]) -> None:
    """Start each build on a thread of its own; whoever needs the library later
    waits for it (build_once), and meets its error there."""
    for builder in builders:
        threading.Thread(target=_quietly, args=(builder,), name="tierlm-native-build", daemon=True).start()


def _quietly(builder: Callable[[], Path]) -> None:
    try:
        builder()
    except Exception:  # noqa: S110 - the caller that needs the library gets the same error, and says it
        pass


KEPT_VERSIONS = 8  # builds of one library kept in the cache: the newest, for a downgrade or a replica of another version
SCRATCH_HOURS = 1  # a build's scratch folder older than this was left by a process that exited mid-build


def _build(built: Path, language: str, compiler_variable: str, default_compiler: str, compile_into) -> Path:
    cache = built.parent
    compiler = shutil.which(os.environ.get(compiler_variable, default_compiler))
    if compiler is None:
        raise BuildError(f"no {language} compiler ({default_compiler}) found")
    cache.mkdir(parents=True, exist_ok=True)
    _tidy(cache, built.name.rsplit("-", 1)[0])
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as scratch:  # then a rename: safe when two start at once
        tmp = Path(scratch) / built.name
        try:
            compile_into(compiler, tmp)
        except subprocess.CalledProcessError as e:
            raise BuildError(f"the {language} compiler failed: {e.stderr.decode(errors='replace')[-400:]}") from e
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"the {language} compiler failed: {e}") from e
        os.replace(tmp, built)
    return built


def _tidy(cache: Path, stem: str) -> None:
    """Before a new build of `stem`: all but its KEPT_VERSIONS newest builds go
    (each source version is a file of its own, so upgrades would pile them up),
    and so do scratch folders a process left when it exited mid-build (a
    background build's thread dies with the process, its cleanup unrun). A
    library another process has loaded stays mapped after its file goes."""
    now = time.time()
    versions = sorted(cache.glob(f"{stem}-*.so"), key=_modified, reverse=True)
    stale = versions[KEPT_VERSIONS - 1:] + [d for d in cache.glob("build-*")
                                           if now - _modified(d) > SCRATCH_HOURS * 3600]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process's tidying
        return 0.0


def build() -> Path:
    """The compiled library, built once per source version into the user's cache."""
    def compile_into(compiler: str, path: Path) -> None:
        try:
            _compile_and_link(compiler, path)
        except subprocess.CalledProcessError:  # a compiler too old for AMX: build the rest
            _compile_and_link(compiler, path, "-DTIERLM_NO_AMX")

    return build_once("tierlm_native", b"".join(p.read_bytes() for p in SOURCES + HEADERS), "C", "CC", "cc",
                      compile_into)


def _compile_and_link(compiler: str, path: Path, *flags: str) -> None:
    """Each source compiled on a core of its own (the wide kernels take 4-7 s each:
    one command took ~25 s on two cores, the first load after an install waiting
    on it), then linked into `path`."""
    objects = [path.with_name(f"{source.stem}.o") for source in SOURCES]

    def compile_one(source: Path, obj: Path) -> None:
        subprocess.run([compiler, "-O2", "-fPIC", *flags, "-c", "-o", str(obj), str(source)],
                       check=True, capture_output=True, timeout=120)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # each thread waits on a compiler
        for done in [pool.submit(compile_one, s, o) for s, o in zip(SOURCES, objects)]:
            done.result()
    # (the flags again: a define means nothing to the link, and the command says which build it ends)
    subprocess.run([compiler, "-shared", *flags, "-o", str(path), *map(str, objects), "-ldl", "-lpthread", "-lm"],
                   check=True, capture_output=True, timeout=120)


def build_against_mlx(stem: str, source: Path, *flags: str) -> Path:
    """A C++ source that uses MLX's C++ API (qmm_hook.cpp, graph_ops.cpp),
    compiled against the installed mlx package's headers and libmlx.so, once
    per source and mlx version."""
    import mlx.core as mx

    package = Path(mx.__file__).resolve().parent
    include, lib = package / "include", package / "lib"
    if not (include / "mlx" / "primitives.h").exists() or not (lib / "libmlx.so").exists():
        raise BuildError(f"the mlx package has no headers or libmlx.so under {package}")

    def compile_into(compiler: str, path: Path) -> None:
        subprocess.run([compiler, "-O2", "-std=c++20", *flags, "-shared", "-fPIC", f"-I{include}", "-o", str(path),
                        str(source), f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}"],
                       check=True, capture_output=True, timeout=300)

    inputs = source.read_bytes() + " ".join(flags).encode() + mx.__version__.encode()
    return build_once(stem, inputs, "C++", "CXX", "c++", compile_into)


def load() -> ctypes.CDLL:
    """Builds (when needed) and loads the library, its functions declared."""
    try:
        lib = ctypes.CDLL(str(build()), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        raise BuildError(f"could not load it: {e}") from e
    lib.tierlm_route_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.tierlm_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tierlm_amx_unpack.argtypes = [ctypes.c_void_p]
    lib.tierlm_softmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.tierlm_softmax_rows_masked.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                               ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.tierlm_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.tierlm_gelu_approx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.tierlm_gelu_erf.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.tierlm_logsumexp_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    lib.tierlm_qmm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.tierlm_qmm_half.argtypes = lib.tierlm_qmm.argtypes
    lib.tierlm_qmm_supports.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.tierlm_qmm_select.argtypes = [ctypes.c_int]
    lib.tierlm_qmm_available.argtypes = [ctypes.c_int]
    lib.tierlm_qmm_int8_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
                                        ctypes.c_long, ctypes.c_int]
    lib.tierlm_qmm_int8_laid_bytes.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    lib.tierlm_qmm_int8_laid_bytes.restype = ctypes.c_long
    lib.tierlm_qmm_int8_remove.argtypes = [ctypes.c_void_p]
    lib.tierlm_float_select.argtypes = [ctypes.c_int]
    lib.tierlm_cpu_has.argtypes = [ctypes.c_int]
    lib.tierlm_cpu_hidden.argtypes = [ctypes.c_int]
    lib.tierlm_cpu_cap.restype = ctypes.c_char_p
    return lib


def function_address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def counts(lib: ctypes.CDLL | None) -> dict[str, int]:
    """Calls served so far in this process, per counter (all 0 without the library)."""
    if lib is None:
        return dict.fromkeys(COUNTERS, 0)
    table = (ctypes.c_ulong * len(COUNTERS)).in_dll(lib, "tierlm_counts")
    return dict(zip(COUNTERS, table))
