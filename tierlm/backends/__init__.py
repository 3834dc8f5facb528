"""What a backend adds to a loaded model, and what the rest of tierlm reads of it.

MLX runs a model on Metal, CUDA or its CPU backend. The CPU backend gets most
from tierlm (`tierlm.backends.cpu`: a real BLAS behind a route, native kernels,
the weights' dtype, AMX tiles); on a GPU, attention of a few queries runs as
two products (`tierlm.backends.gpu`). The loader calls `prepare` once per
model; the engine reads the `Backend` that `describe` gives back for it: the
memory it holds outside MLX's allocator (the memory guard counts it), a tag for
the prefix cache's keys (other arithmetic, other KV), what to log and what to
show in /stats; and `prefill_step_for` gives the device's prefill chunk.

Importing this (or `tierlm`) compiles and loads nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_PREFILL_STEP = 2048
DEFAULT_CACHE_BLOCK = 256  # tokens per prefix-cache block (cache_block_for)
CPU_CACHE_BLOCK = 64


@dataclass(frozen=True)
class Backend:
    """What a backend set up for one loaded model."""

    name: str = "mlx"  # "mlx": nothing added; "cpu": tierlm.backends.cpu
    extra_bytes: int = 0  # memory held outside MLX's allocator while the model lives
    layout_tag: bytes = b""  # appended to the weights' layout in prefix-cache keys
    # whether a sequence's products have the same bits alone, batched or fed several
    # tokens at once (verifying drafts), so greedy answers never depend on the batch
    batch_invariant: bool = False
    log: tuple[str, ...] = ()  # start-up log lines, info
    warnings: tuple[str, ...] = ()  # start-up log lines, warnings (a part that failed its check)
    summary: dict = field(default_factory=dict)  # for /stats: what is in use, and why not
    counters: Callable[[], dict] | None = field(default=None, repr=False, compare=False)  # live, for /stats
    # decode steps a batch keeping KV at 8 or 4 bits may hold at 16 bits (engine.quantized_kv):
    # the model's attention reads them there (tierlm.backends.gpu)
    kv_tail: int = 0

    def stats(self) -> dict:
        """For /stats: the summary and, live, what ran so far."""
        live = self.counters() if self.counters else {}
        return {"name": self.name, "extra_bytes": self.extra_bytes, **self.summary, **live}


NONE = Backend()
_by_model: dict[int, Backend] = {}  # id(model) -> its description, while the model lives


def mlx_lm_generate():
    """mlx_lm.generate the module, where tierlm puts names in place of mlx-lm's
    (the package's `generate` attribute is the function of that name)."""
    import importlib

    return importlib.import_module("mlx_lm.generate")


def mlx_lm_modules(model) -> list:
    """The mlx-lm model modules whose classes `model` is built from (where the
    backends put their functions in place of mlx-lm's)."""
    import sys

    names = {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n.startswith("mlx_lm.models.")]


def keep_compiled_kernels(folder: str) -> None:
    """MLX's CUDA backend keeps the kernels it compiles under /tmp unless told
    otherwise, so a reboot compiles them all again (a second each); put them where
    they last. Before the first kernel compiles; MLX_PTX_CACHE_DIR, when set, wins."""
    import os
    from pathlib import Path

    if "MLX_PTX_CACHE_DIR" not in os.environ:
        os.environ["MLX_PTX_CACHE_DIR"] = str(Path(folder).expanduser())


def choose_cuda_graphs(on: bool) -> None:
    """Whether MLX's CUDA backend records its work as CUDA graphs (the
    `cuda_graphs` setting). It keys a recorded graph by its kinds of nodes and
    instantiates it again whenever an update fails (a kernel of another shape:
    every agent turn's new length), which cost an H100 ~17 ms of a 20k-token hot
    hit's ~40; launched one by one, the kernels served about as many tokens/s
    alone and 1.2-1.3x at 8-32 streams (docs/prefix-cache.md). MLX reads
    MLX_USE_CUDA_GRAPHS once, at its first kernel: call before; when set, it wins."""
    import os

    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "1" if on else "0")


def prepare(model, *, cpu_weights_dtype: str = "auto", memory_bytes: int, cpu_kernels: bool = True,
            cpu_amx: bool = True, probe_tokens: list[int] | None = None) -> Backend:
    """Sets up what the device's backend adds to `model` (in place) and records
    its description for `describe`. Call on the engine's thread. `probe_tokens`:
    a reference text's tokens, with which the CPU backend decides whether the
    model takes int8 activations (cpu.int8); None keeps float32 products."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        from tierlm.backends import cpu

        backend = cpu.prepare(model, weights_dtype=cpu_weights_dtype, memory_bytes=memory_bytes,
                              kernels=cpu_kernels, amx=cpu_amx, probe_tokens=probe_tokens)
    else:
        from tierlm.backends import gpu

        replaced = gpu.install(model)
        backend = Backend(log=(f"GPU: attention of 2-{gpu.MAX_QUERIES} queries as products (no cuDNN graph "
                               f"per shape): {', '.join(replaced) or 'no module'}",),
                          summary={"few_query_attention": replaced},
                          kv_tail=gpu.kv_tail_tokens()) if replaced else NONE
    key = id(model)
    _by_model[key] = backend
    weakref.finalize(model, _by_model.pop, key, None)
    return backend


def describe(model) -> Backend:
    """The description `prepare` recorded for `model` (NONE when it was not prepared)."""
    return _by_model.get(id(model), NONE)


def prepared_models() -> int:
    """How many live models `prepare` has recorded a description for: a model's
    goes when the model is garbage-collected."""
    return len(_by_model)


def prefill_step_for(device) -> int:
    """Prompt tokens per prefill chunk on `device`."""
    import mlx.core as mx

    if device == mx.cpu:
        from tierlm.backends import cpu

        return cpu.PREFILL_STEP
    return DEFAULT_PREFILL_STEP


def cache_block_for(device) -> int:
    """Tokens per prefix-cache block on `device`. A hit recomputes the tokens
    after its last whole block (the end of the previous turn's answer, in a
    chat): on a CPU that is the slowest part of a hot turn (the default model,
    2k tokens on 2 cores: 1.04 s with blocks of 256, 0.41 s with 64)."""
    import mlx.core as mx

    return CPU_CACHE_BLOCK if device == mx.cpu else DEFAULT_CACHE_BLOCK
