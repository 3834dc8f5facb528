"""Matmuls by float32 weights, run in bfloat16 on Intel AMX tiles.

On a CPU with AMX (Sapphire Rapids and later) a bfloat16 copy of each weight,
packed into tiles once at load (native/amx_bf16.c), is read instead of the
float32 one: half the bytes per decode step, and the tile unit's throughput for
prefill and batched decode. The route in front of the BLAS (native/sgemm_route.c)
finds the copy by the float32 array's address, so the model itself is unchanged:
mlx-lm still sees float32 weights. Activations are rounded to bfloat16 per
product and products accumulate in float32, as bf16 inference does on GPUs.

The packed copies cost half the float32 weights' memory again; they are freed
when the model is (the backend reports them as memory it adds, which the memory
guard counts). Off with --no-cpu-amx (TIERLM_CPU_AMX=false).
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import mlx.core as mx
import numpy as np
from mlx import nn

from tierlm.backends.cpu import route

log = logging.getLogger(__name__)


def available() -> bool:
    """AMX products can run: the route is in MLX's slot and the CPU has AMX-BF16."""
    state = route.current()
    return mx.default_device() == mx.cpu and state is not None and state.route.on and state.amx.on


_packed_bytes: dict[int, int] = {}  # id(model) -> bytes of its packed copies, while it lives


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by the model's packed copies, outside MLX's allocator."""
    return _packed_bytes.get(id(model), 0)


def packed_models() -> int:
    """How many live models `pack` has run on: a model's entry (and its copies)
    goes when the model is garbage-collected."""
    return len(_packed_bytes)


def matmul_weights(model: nn.Module) -> list[mx.array]:
    """The weights `pack` copies to bfloat16 (the copies' bytes are counted
    from them): the float32 weights that multiply activations, every Linear's,
    and the embedding table when there is no separate output head (tied
    embeddings multiply through `as_linear`)."""
    linears = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    weights = [m.weight for m in linears]
    has_head = any(name.endswith("lm_head") for name, m in model.named_modules() if type(m) is nn.Linear)
    if not has_head:
        weights += [m.weight for _, m in model.named_modules() if type(m) is nn.Embedding]
    return [w for w in weights if w.dtype == mx.float32 and w.ndim == 2]


def _address(weight: mx.array) -> int:
    view = np.array(weight, copy=False)  # MLX's own buffer on CPU: the address MLX hands the BLAS
    if not view.flags.c_contiguous:
        return 0
    return view.ctypes.data


def pack(model: nn.Module) -> int:
    """Packs the model's float32 matmul weights; returns how many. Their copies
    are released when the model is garbage-collected."""
    if not available():
        return 0
    native = route.current().lib
    mx.eval(model.parameters())
    packed, copies = [], 0
    for weight in matmul_weights(model):
        address = _address(weight)
        if address and native.tierlm_amx_pack(address, *weight.shape):
            packed.append(address)
            copies += weight.size * 2  # bfloat16
    _packed_bytes[id(model)] = copies
    # Forget the copies before the float32 arrays can be freed and their addresses reused.
    weakref.finalize(model, _unpack, native, packed, id(model))
    return len(packed)


def _unpack(native: ctypes.CDLL, addresses: list[int], model_id: int) -> None:
    for address in addresses:
        native.tierlm_amx_unpack(address)
    _packed_bytes.pop(model_id, None)
