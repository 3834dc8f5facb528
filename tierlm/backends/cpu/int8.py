"""Int8 activations for the models they barely move, chosen at load by a probe.

The float32 products (qgemm_float.c) are bound by their instructions: each
weight is unpacked, turned into a float and scaled before its multiply-add.
With the activations quantized to int8 per 32 values, as llama.cpp quantizes
them, 4 values of 16 output columns are one AVX-512 VNNI dot product
(qgemm_vnni512.c; with AVX2 alone, of 8 columns, qgemm_int8_avx2.c): a step
of Qwen2.5-Coder-0.5B reads its weights at ~30 GB/s instead of ~16, and a
prompt's products run ~2x float32's speed with VNNI (~1.4x with AVX2).
The int8 activations move the model's answers, though, and how much depends on
the model: SmolLM2-135M, whose RMSNorm outputs have a few huge channels that
take a block's whole int8 range, stopped answering "Paris", while
Qwen2.5-Coder-0.5B's greedy answers stayed those of float32.

So each quantized model is probed once at load, where the CPU has AVX2 (every
x86-64 server): a reference text's tokens go through the model with the float32
products and again with the int8 ones, and the int8 activations are kept when
the log-probability of each next token moves by less than `THRESHOLD` on
average. They are kept per model, by registering the model's packed weights
with qgemm.c (`tierlm_qmm_int8_add`): their products take the int8 tiles, any
other model's keep the float path, and each weight always takes one path, so a
row keeps its bits alone or batched. The prefix cache's keys say so
(`LAYOUT_TAG`): KV computed one way is never read as the other's.

The probe's figure is kept on disk (`~/.cache/tierlm/int8-probe.json`), by a
fingerprint of the model's packed weights, the text's tokens and the native
library's build: a model loaded again (a restart, the next test's server)
skips the two passes (~0.7 s for SmolLM2, ~2 s for Qwen2.5-Coder-0.5B here).

TIERLM_INT8_ACTIVATIONS: auto (the probe; the default), on (every quantized
model, no probe), off (float32 products only).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from tierlm.backends.cpu import native, quantized, route
from tierlm.backends.cpu.route import Feature

VARIABLE = "TIERLM_INT8_ACTIVATIONS"
CHOICES = ("auto", "on", "off")
# Mean |change| of the reference text's next-token log-probabilities the
# probe accepts. Measured with this text (AMD EPYC, AVX-512 VNNI):
# Qwen2.5-Coder-0.5B Q4_K_M 0.018; SmolLM2-135M Q4_1 0.072, Gemma 3 270M Q4_K_M 0.043.
THRESHOLD = 0.03
LAYOUT_TAG = b" products: int8 activations"
# Code and prose, as an agent's context mixes them (~110 tokens).
REFERENCE_TEXT = (
    "def merge(intervals):\n    \"\"\"Merge overlapping [start, end] intervals.\"\"\"\n"
    "    intervals.sort(key=lambda pair: pair[0])\n    merged = []\n    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n            merged.append([start, end])\n    return merged\n\n"
    "The capital of France is Paris. Water boils at 100 degrees Celsius at sea level, and a server "
    "that keeps the work it has done answers the next question sooner.")


def probe_tokens(tokenizer) -> list[int]:
    """The reference text as `tokenizer` encodes it: what `choose` feeds the model."""
    return list(tokenizer.encode(REFERENCE_TEXT))


def choose(model: nn.Module, tokens: list[int] | None) -> tuple[Feature, bool]:
    """Whether `model`'s quantized products take int8 activations (registered
    with qgemm.c for the model's life), and why; the bool: they do."""
    setting = os.environ.get(VARIABLE, "auto")
    if setting not in CHOICES:
        return Feature(False, f"{VARIABLE}={setting} is not one of {', '.join(CHOICES)}"), False
    if setting == "off":
        return Feature(False, f"turned off by {VARIABLE}=off"), False
    lib = _lib()
    if lib is None or not quantized.float_products() or not lib.tierlm_qmm_available(quantized.PATHS["avx2-int8"]):
        return Feature(False, "needs AVX2 and the float kernels in use"), False
    layers = _layers(model)
    weights = [layer["weight"] for layer in layers]
    if not weights:
        return Feature(False, "no quantized layer the kernels take"), False
    if setting == "auto" and (tokens is None or len(tokens) < 8):
        return Feature(False, "no reference text to probe with"), False
    key = _fingerprint(weights, tokens, lib) if setting == "auto" else None
    change = _remembered(key)
    before = _log_probs(model, tokens) if setting == "auto" and change is None else None
    if change is not None and change >= THRESHOLD:
        return _declined(change), False
    addresses, _laid_bytes[id(model)] = _register(lib, layers)
    # before MLX can free the buffers and reuse them
    weakref.finalize(model, _unregister, lib, addresses, id(model))
    if setting == "on":
        return Feature(True, f"{len(addresses)} layers, {kernel(lib)}, {VARIABLE}=on"), True
    if change is None:
        change = float(np.abs(_log_probs(model, tokens) - before).mean())
        _remember(key, change)
    if change >= THRESHOLD:
        _unregister(lib, addresses, id(model))
        return _declined(change), False
    return Feature(True, f"{len(addresses)} layers, {kernel(lib)}; the probe moved log-probabilities by "
                         f"{change:.3f} (< {THRESHOLD}) over {len(tokens) - 1} tokens"), True


def kernel(lib) -> str:
    """Which int8 products a registered weight takes on this CPU."""
    return "AVX-512 VNNI" if lib.tierlm_qmm_available(quantized.PATHS["avx512-vnni"]) else "AVX2"


def _declined(change: float) -> Feature:
    return Feature(False, f"the probe moved log-probabilities by {change:.3f} (>= {THRESHOLD}): float32 products")


def _layers(model: nn.Module) -> list[nn.Module]:
    """The model's quantized layers whose products the kernels take: its
    linear layers, and its embedding where there is no output head (tied
    embeddings multiply through `as_linear`; an untied one only gathers rows)."""
    named = list(model.named_modules())
    has_head = any(name.endswith("lm_head") for name, m in named if isinstance(m, nn.QuantizedLinear))
    kinds = nn.QuantizedLinear if has_head else (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return [m for _, m in named if isinstance(m, kinds) and m.mode == "affine"
            and m.bits in quantized.BITS and m.group_size in quantized.GROUP_SIZES]


def _address(array: mx.array) -> int:
    return np.array(array, copy=False).ctypes.data  # MLX's own buffer: the pointer the hook hands qgemm.c


_laid_bytes: dict[int, int] = {}  # id(model) -> bytes qgemm.c keeps for its registered weights, while it lives


def laid_bytes(model: nn.Module) -> int:
    """Bytes qgemm.c keeps for the model's registered weights (their scales and
    biases laid out as the int8 products read them), outside MLX's allocator."""
    return _laid_bytes.get(id(model), 0)


def _register(lib, layers: list[nn.Module]) -> tuple[list[int], int]:
    """Registers each layer's weight with its scales and biases: the addresses
    registered, and the bytes qgemm.c keeps for them."""
    addresses, kept = [], 0
    for layer in layers:
        weight, scales = layer["weight"], layer["scales"]
        half, (rows, groups) = int(scales.dtype == mx.float16), scales.shape
        k = groups * layer.group_size
        address = _address(weight)
        if lib.tierlm_qmm_int8_add(address, _address(scales), _address(layer["biases"]), half, rows, k,
                                   layer.group_size):
            addresses.append(address)
            kept += lib.tierlm_qmm_int8_laid_bytes(rows, k, layer.group_size, half)
    return addresses, kept


def _unregister(lib, addresses: list[int], model_id: int) -> None:
    for address in addresses:
        lib.tierlm_qmm_int8_remove(address)
    addresses.clear()
    _laid_bytes.pop(model_id, None)


def _log_probs(model: nn.Module, tokens: list[int]) -> np.ndarray:
    """Each next token's log-probability over the reference text, in one pass."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array([tokens[:-1]]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    chosen = mx.take_along_axis(logits, mx.array(tokens[1:])[:, None], axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1)
    return np.array(chosen)


def _fingerprint(weights: list[mx.array], tokens: list[int], lib) -> str:
    """What the probe's figure depends on: the weights (their shapes and the
    first and last 4 KB of each), the text's tokens, the native library and
    which of its int8 products this CPU takes."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tokens}|{getattr(lib, '_name', '')}|{kernel(lib)}".encode())
    for weight in weights:
        flat = np.array(weight, copy=False).reshape(-1).view(np.uint8)
        digest.update(f"{weight.shape}".encode() + flat[:4096].tobytes() + flat[-4096:].tobytes())
    return digest.hexdigest()


def _memo_file() -> Path:
    return native.cache_folder() / "int8-probe.json"


def _remembered(key: str | None) -> float | None:
    try:
        return float(json.loads(_memo_file().read_text())[key]) if key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(key: str, change: float) -> None:
    """Adds the figure to the memo, written whole and renamed into place (two
    loads at once: the last one's file wins, each a whole file)."""
    path = _memo_file()
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        memo = {}
    memo[key] = change
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(memo, f)
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only cache: the next load probes again


def registered() -> int:
    """Weights whose products take int8 activations now, over every model."""
    lib = _lib()
    return int(lib.tierlm_qmm_int8_weights()) if lib is not None else 0


def _lib():
    state = route.current()
    return state.lib if state is not None else None
