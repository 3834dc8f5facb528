"""TIERLM_MAX_CPU_ISA: a cap on the CPU features tierlm's native kernels use.

An AVX-512 machine runs other kernels than an AVX2-only one (16 lanes against 8
in the exact attention products, the native softmax and SwiGLU and the quantized
products; AMX; VBMI's unpacking), so a test can pass on one and fail on the
other. The cap makes the native library
choose every kernel as the smaller CPU would, as oneDNN's ONEDNN_MAX_CPU_ISA and
MKL's MKL_ENABLE_INSTRUCTIONS do for theirs:

- `avx2`: AVX2 and FMA; no AVX-VNNI, AVX-512 or AMX
- `avx-vnni`: that and AVX-VNNI
- `avx512`: that and AVX-512; no AMX
- `native` (or unset): whatever the CPU has

native/cpu_features.c reads it once and applies it: every kernel choice in the
library asks it, never the CPU. Here the cap goes into the reasons the log and
/stats give for a part being off. Another value turns off every part the cap
governs, naming the values it takes (as TIERLM_QUANT_KERNEL does with a name it
does not know). docs/testing.md says how to run the tests as an AVX2-only
machine would (numpy and OpenBLAS have caps of their own).
"""

from __future__ import annotations

import ctypes

VARIABLE = "TIERLM_MAX_CPU_ISA"
VALUES = ("native", "avx512", "avx-vnni", "avx2")  # cpu_features.c's names, widest first
# cpu_features.h's enum, in its order
FEATURES = ("avx2", "fma", "avx-vnni", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512bf16",
            "amx-bf16", "avx512vnni")


def cap(lib: ctypes.CDLL) -> str:
    """The cap the native library applies: one of VALUES, or the value it did not know."""
    return lib.tierlm_cpu_cap().decode(errors="replace")


def bad_value(lib: ctypes.CDLL) -> str | None:
    """What is wrong with the cap's value, when it is not one of VALUES."""
    value = cap(lib)
    return None if value in VALUES else f"{VARIABLE}={value} is not one of {', '.join(VALUES)}"


def under(lib: ctypes.CDLL) -> str:
    """' under TIERLM_MAX_CPU_ISA=...' when a cap is set (not native), else ''."""
    value = cap(lib)
    return f" under {VARIABLE}={value}" if value != "native" else ""


def hiding(lib: ctypes.CDLL, feature: str) -> str:
    """' (TIERLM_MAX_CPU_ISA=...)' when the CPU has `feature` (a FEATURES name)
    and the cap hides it, else ''."""
    return f" ({VARIABLE}={cap(lib)})" if lib.tierlm_cpu_hidden(FEATURES.index(feature)) else ""


def reported(lib: ctypes.CDLL, feature: str) -> bool:
    """Whether the CPU itself reports `feature` (a FEATURES name), whatever the cap."""
    number = FEATURES.index(feature)
    return bool(lib.tierlm_cpu_has(number) or lib.tierlm_cpu_hidden(number))


def lacks(lib: ctypes.CDLL, feature: str, name: str) -> str:
    """Why a part that needs `feature` is off, with the feature called `name`:
    the CPU lacks it, or the cap hides it, or the cap is a value it does not take."""
    return bad_value(lib) or f"no {name} on this CPU{hiding(lib, feature)}"
