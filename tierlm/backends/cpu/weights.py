"""The weights' dtype on MLX's CPU backend.

A quantized model stays quantized ("quantized") when tierlm's kernels multiply
its format (quantized.py: affine 4, 5 or 8 bits) in float32 (AVX-512, or AVX2
with FMA): its scales and biases become float32, which the kernels read, and
any layer in another format is dequantized to float32; so it does under
avx512-vnni (int8.py). The int8 kernels chosen by name (avx-vnni, avx2-int8)
take a model only when its float32 weights do not fit. Otherwise, with a real
BLAS loaded, float32 weights
decode ~2-15x faster than the stored ones (MLX's own CPU quantized matmul does
not get faster with batch size), and 16-bit weights never win (MLX's CPU matmul
for them does not use BLAS): so a model is dequantized to float32 when that
(with the AMX copies, where the CPU has AMX) fits comfortably in memory, and
otherwise keeps its stored format. "float32" can be asked for (the exactness
tests do). A model over several ranks (loader.shard_model) has mlx's sharded
layers in place of its Linear ones; they are converted the same way. Nothing
changes on Metal or CUDA.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import (AllToShardedLinear, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear,
                                       ShardedToAllLinear)
from mlx.utils import tree_flatten

from tierlm.backends.cpu import amx, dequantize, quantized, route

CHOICES = ("auto", "quantized", "float32", "bfloat16", "float16", "stored")
SHARDS = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)  # mlx's tensor-parallel quantized Linears
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, *SHARDS)


def float32_bytes(model: nn.Module) -> int:
    """The model's size once every weight is a float32."""
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QUANTIZED)}
    total = 0
    for name, value in tree_flatten(model.parameters()):
        owner, _, leaf = name.rpartition(".")
        if owner not in quantized:
            total += value.size * 4
        elif leaf == "weight":
            total += value.size * (32 // quantized[owner].bits) * 4
        elif leaf == "bias":
            total += value.size * 4
    return total


def choose_dtype(setting: str, model: nn.Module, memory_bytes: int) -> str:
    """The dtype to run in, or 'stored' to leave the weights as they are."""
    if setting not in CHOICES:
        raise ValueError(f"cpu weights dtype must be one of {', '.join(CHOICES)}")
    if mx.default_device() != mx.cpu:
        return "stored"
    if setting != "auto":
        return setting
    kernels_take = quantized.on() and any(_kernels_take(m) for _, m in model.named_modules())
    if kernels_take and quantized.keeps_weights_quantized():
        return "quantized"
    # The int8 products (avx-vnni, avx2-int8) move a small model's answers:
    # SmolLM2's greedy answers changed under them, so they take only models
    # float32 does not fit.
    state = route.current()
    if state is not None and state.blas.on:
        # On AMX machines the float32 weights get bfloat16 copies too (amx.py).
        needed = float32_bytes(model) * (3 if amx.available() else 2) // 2
        if needed <= memory_bytes // 2:
            return "float32"
    # without BLAS float32 gains little and costs 8x the memory
    return "quantized" if kernels_take else "stored"


def _kernels_take(module: nn.Module) -> bool:
    """A layer whose format tierlm's quantized kernels multiply."""
    return (isinstance(module, QUANTIZED) and module.mode == "affine"
            and module.bits in quantized.BITS and module.group_size in quantized.GROUP_SIZES)


def convert(model: nn.Module, dtype_name: str) -> None:
    """Dequantize quantized layers (in "quantized": those the kernels do not
    take) and cast floating weights, in place."""
    keep = dtype_name == "quantized"
    dtype = mx.float32 if keep else getattr(mx, dtype_name)
    _swap_quantized(model, dtype, keep=_kernels_take if keep else lambda _: False)
    as_stored = _half_scales(model) if keep else set()
    params = tree_flatten(model.parameters())
    model.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and k not in as_stored else v)
                        for k, v in params])
    mx.eval(model.parameters())


def settle_half_scales(model: nn.Module, read_as_stored: bool) -> int:
    """After `convert(model, "quantized")`, the layers whose float16 scales it
    kept: switched to read them as they are (graph_ops.HalfScalesQuantizedLinear)
    where `read_as_stored` (quantized.reads_half_scales), the others widened to
    float32 now; returns how many read them as stored."""
    from tierlm.backends.cpu import graph_ops

    switched = graph_ops.install_half_scales(model, _kernels_take) if read_as_stored else 0
    still = _half_scales(model, leave=graph_ops.HalfScalesQuantizedLinear)
    wide = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters()) if k in still]
    if wide:
        model.load_weights(wide, strict=False)
        mx.eval(model.parameters())
    return switched


def _half_scales(model: nn.Module, leave: type | None = None) -> set[str]:
    """The names of the float16 scales and biases of quantized linear layers
    (not of class `leave`): the kernels read them as they are (a decode step
    streams every one of them, ~15% of a 4-bit layer's bytes as float32); an
    embedding's gather makes its rows in its scales' dtype, so those become
    float32."""
    return {f"{name}.{leaf}" if name else leaf for name, m in model.named_modules()
            if isinstance(m, QUANTIZED) and not isinstance(m, nn.QuantizedEmbedding) and type(m) is not leave
            for leaf in ("scales", "biases") if leaf in m and m[leaf].dtype == mx.float16}


def apply(setting: str, model: nn.Module, memory_bytes: int) -> str:
    """Converts the model to the dtype chosen; returns it ('stored': unchanged)."""
    choice = choose_dtype(setting, model, memory_bytes)
    if choice != "stored":
        convert(model, choice)
    return choice


def _swap_quantized(module: nn.Module, dtype, keep) -> None:
    for name, child in module.children().items():
        if isinstance(child, list):
            for i, item in enumerate(child):
                if isinstance(item, nn.Module):
                    replacement = _dequantized(item, dtype, keep)
                    if replacement is not None:
                        child[i] = replacement
                    else:
                        _swap_quantized(item, dtype, keep)
        elif isinstance(child, nn.Module):
            replacement = _dequantized(child, dtype, keep)
            if replacement is not None:
                setattr(module, name, replacement)
            else:
                _swap_quantized(child, dtype, keep)


def _dequantized(module: nn.Module, dtype, keep) -> nn.Module | None:
    if not isinstance(module, QUANTIZED) or keep(module):
        return None
    if dequantize.takes(module):
        weight = dequantize.float32(module.weight, module.scales, module.biases, module.group_size, module.bits)
    else:
        weight = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size,
                               module.bits, mode=module.mode)
    weight = weight.astype(dtype)
    if isinstance(module, nn.QuantizedEmbedding):
        new = nn.Embedding(*weight.shape)
    else:
        rows, columns = weight.shape
        new = (_float_shard(module, rows, columns) if isinstance(module, SHARDS)
               else nn.Linear(columns, rows, bias="bias" in module))
        if "bias" in module:
            new.bias = module.bias.astype(dtype)
    new.weight = weight
    return new


def _float_shard(module: nn.Module, rows: int, columns: int) -> nn.Module:
    """The float twin of a quantized shard whose dequantized weight (this rank's
    part) is rows x columns; the caller puts the weight in."""
    ranks = module.group.size()
    if isinstance(module, QuantizedAllToShardedLinear):  # the outputs are split over the ranks
        return AllToShardedLinear(columns, rows * ranks, bias="bias" in module, group=module.group)
    return ShardedToAllLinear(columns * ranks, rows, bias="bias" in module, group=module.group)  # the inputs
