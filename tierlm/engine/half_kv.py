"""The running batch's attention KV kept at float16 on MLX's CPU backend
(`batch_kv_bits` 16 there).

On the CPU a model computes in float32, and its KV is kept as computed: 4
bytes a value. A decode step over a long context reads all of it once, and
that read is most of the step (Qwen2.5-Coder-0.5B over 16k tokens: ~30 of
~64 ms). Kept at float16, as llama.cpp keeps its KV by default, a step reads
half the bytes, the batch holds twice the tokens in the same memory, and so
does every cached block. Each value is rounded once, when it is written; the
attention reads it back as float32 exactly (tierlm.backends.cpu.graph_ops),
so answers move by that rounding only, and a sequence gets the same bits
alone or in any batch, and from a cache hit as from its prompt computed
(the blocks keep float16 values under keys of their own: engine.core).

The classes cast what a layer writes and are otherwise mlx-lm's (and
ragged_kv's): a sequence enters the batch with a HalfSlot per attention
layer, and mlx-lm's batching merges it into a HalfBatchKVCache, which
speculation makes a RaggedHalfBatchKVCache (speculative_batch.ragged). The
buffers they grow take the dtype of what is written, so casting the writes
is all it takes. Sliding-window and recurrent layers keep their own caches
as computed.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from tierlm.cache.codecs import plain_kv
from tierlm.engine.quantized_kv import after_one_token, quantized_slots
from tierlm.engine.ragged_kv import RaggedBatchKVCache

DTYPE = mx.float16


class HalfWrites:
    """A KV cache class's writes cast to float16 (put first among the bases)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return super().update_and_fetch(keys.astype(DTYPE), values.astype(DTYPE))


class HalfSlot(HalfWrites, KVCache):
    """One sequence's KV of one layer, kept at float16."""

    @classmethod
    def of(cls, cache: KVCache | None) -> HalfSlot:
        """A slot holding `cache`'s KV (none: empty), at float16."""
        slot = cls()
        if cache is not None and cache.keys is not None and cache.offset:
            slot.keys = cache.keys[..., : cache.offset, :].astype(DTYPE)
            slot.values = cache.values[..., : cache.offset, :].astype(DTYPE)
            slot.offset = cache.offset
        return slot

    @classmethod
    def merge(cls, caches: list[HalfSlot]) -> HalfBatchKVCache:
        return HalfBatchKVCache.merge(caches)


class HalfBatchKVCache(HalfWrites, BatchKVCache):
    @classmethod
    def merge(cls, caches: list) -> HalfBatchKVCache:
        """BatchKVCache.merge as this class (its own makes a plain BatchKVCache when every cache is empty)."""
        if all(c.size() == 0 for c in caches):
            return cls([0] * len(caches))
        return super().merge(caches)


class RaggedHalfBatchKVCache(HalfWrites, RaggedBatchKVCache):
    pass


def half_slots(caches: list) -> list:
    """A sequence's per-layer caches for a batch kept at float16: attention KV
    layers as HalfSlots, the others (windows, recurrent state) as they are."""
    return [HalfSlot.of(c) if plain_kv(c) else c for c in caches]


def batch_slots(caches: list, kv_bits: int, kv_half: bool, key_scales: list | None = None,
                tail_capacity: int = 0) -> list:
    """A sequence's per-layer caches as the batch keeps them: quantized at
    `kv_bits` (engine.quantized_kv), at float16 where `kv_half`, else as they are."""
    if kv_bits != 16:
        return quantized_slots(caches, kv_bits, key_scales, tail_capacity)
    return half_slots(caches) if kv_half else caches


def why_not_half(model) -> str | None:
    """Why the batch on MLX's CPU backend cannot keep `model`'s KV at float16
    (None: it can): the KV must be float32 as computed, with a plain attention
    layer, read by tierlm's attention (the native kernels)."""
    from tierlm.backends.cpu import kernels

    if not kernels.native_kernels():
        return "tierlm's native attention kernels are off on this CPU"
    layers = after_one_token(model)
    if layers is None:
        return "it has no plain attention layer"
    if any(c.keys.dtype != mx.float32 for c in layers if plain_kv(c)):
        return "its KV is not float32 as computed"
    return None
