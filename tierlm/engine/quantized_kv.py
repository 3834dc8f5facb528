"""The running batch's KV kept at 8 or 4 bits (`batch_kv_bits`).

mlx-lm quantizes KV for one sequence only (QuantizedKVCache); its batch cache
(BatchKVCache) keeps every value as computed. `QuantizedBatchKVCache` is a
BatchKVCache whose keys and values are each kept as (values, scales, biases),
MLX's affine quantization in groups of 64 along a head's vector: 8.5 bits a
value at 8 bits with 16-bit scales (1.9x the tokens of 16-bit KV in the same
memory; 3.6x float32's on the CPU), 4.5 at 4 bits. Because it has `bits`,
mlx-lm's attention takes it to `quantized_scaled_dot_product_attention` (two
quantized products), and tierlm's own attention paths leave it to that.

A sequence enters the batch with a `QuantizedSlot` per attention layer (empty,
or holding a cache hit's KV, quantized as it is made), and mlx-lm's batching
merges, extends, filters and extracts them as it does its own caches: the
methods here mirror BatchKVCache's over three arrays instead of one.
Sliding-window and recurrent layers keep their own caches as computed.

Keys are kept divided by per-channel factors where the engine calibrated
them (`key_scales`, tierlm/engine/key_scaling.py): a few large channels no
longer size every group's step.

On a CUDA GPU a decode step's token waits in a 16-bit tail of up to
`tail_capacity` tokens (backends.gpu.KV_TAIL) that the attention kernel reads
after the quantized ones, and is quantized with the rest of the tail when it
fills or the batch changes (`flush`). A small model's decode step is bound by
the host's time per operation, not by the GPU's: quantizing each step's token
took two quantizations and six writes a layer, and 8-bit KV decoded at 0.57x
16-bit's tokens/s at batch 32 over 2k tokens (an H100). Every other reader of
the buffers flushes first.

The cache tiers keep blocks in their own layout (`cache_kv_bits`,
tierlm/cache/kv_quant.py): a sequence's KV leaves the batch dequantized
(`dequantized`, the keys multiplied back) and a hit enters it quantized again.

These classes reach into BatchKVCache's fields (`_idx`, `left_padding`,
`offset`, `_right_padding`); tests/test_quantized_kv.py fails loudly if they
change.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

from tierlm.cache.codecs import plain_kv
from tierlm.engine.key_scaling import KeyScales, scaled_keys

GROUP = 64  # values per scale and bias, along a head's vector


def supports(head_dim: int) -> bool:
    return head_dim % GROUP == 0


class QuantizedSlot(QuantizedKVCache):
    """One sequence's quantized KV of one layer, as mlx-lm's batching takes it."""

    key_scales: KeyScales | None = None  # what its keys are kept divided by
    tail_capacity: int = 0  # the batch it enters: decode steps kept at 16 bits

    @classmethod
    def of(cls, cache: KVCache | None, bits: int, key_scales: KeyScales | None = None,
           tail_capacity: int = 0) -> QuantizedSlot:
        """A slot holding `cache`'s KV (none: empty), quantized."""
        slot = cls(group_size=GROUP, bits=bits)
        slot.key_scales, slot.tail_capacity = key_scales, tail_capacity
        if cache is not None and cache.keys is not None and cache.offset:
            keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
            if key_scales is not None:
                keys = key_scales.divide(keys)
            slot.keys = mx.quantize(keys, group_size=GROUP, bits=bits)
            slot.values = mx.quantize(values, group_size=GROUP, bits=bits)
            slot.offset = cache.offset
        return slot

    def update_and_fetch(self, keys, values):
        """As mlx-lm's, the keys divided by `key_scales` (a slot used alone)."""
        if self.key_scales is not None:
            keys = self.key_scales.divide(keys)
        keys, values = super().update_and_fetch(keys, values)
        return scaled_keys(keys, self.key_scales), values

    @classmethod
    def merge(cls, caches: list[QuantizedSlot]) -> QuantizedBatchKVCache:
        return QuantizedBatchKVCache.merge(caches)

    def dequantized(self) -> KVCache:
        cache = KVCache()
        if self.keys is not None and self.offset:
            keys, values = self.keys_and_values()
            cache.keys = mx.dequantize(*keys, group_size=self.group_size, bits=self.bits)
            if self.key_scales is not None:
                cache.keys = self.key_scales.multiply(cache.keys)
            cache.values = mx.dequantize(*values, group_size=self.group_size, bits=self.bits)
            cache.offset = self.offset
        return cache


class QuantizedBatchKVCache(BatchKVCache):
    """BatchKVCache with `keys` and `values` each a (values, scales, biases)
    triple of arrays (batch, heads, tokens, ...), quantized at `bits`."""

    def __init__(self, left_padding: list[int], bits: int, group_size: int = GROUP,
                 key_scales: KeyScales | None = None, tail_capacity: int = 0):
        super().__init__(left_padding)
        self.bits, self.group_size, self.key_scales = bits, group_size, key_scales
        # decode steps kept at 16 bits after the quantized tokens (`flush` quantizes them)
        self.tail_capacity = tail_capacity
        self.tail_keys = self.tail_values = None  # (batch, heads, tail_capacity, head_dim), as computed
        self.tail_length = 0  # tokens _idx - tail_length .. _idx are in the tail
        self._tail_start: tuple[int, mx.array] | None = None  # where the tail starts, as the kernel reads it

    def update_and_fetch(self, keys, values):
        """Writes `keys` and `values` after the batch's end; returns the whole
        quantized buffers (attention reads them up to the mask's width, and a
        decode step's tokens from the tail: backends.gpu)."""
        n = keys.shape[2]
        if n == 1 and self.tail_capacity and self.keys is not None:
            self._to_tail(keys, values)
            return self.keys, self.values
        self.flush()
        prev = self._idx
        self.offset = self.offset + n
        self._idx += n
        self._store(keys, values, prev)
        keys, values = self.keys_and_values()
        return scaled_keys(keys, self.key_scales), values

    def _to_tail(self, keys, values) -> None:
        """A decode step's token into the tail: two writes, as a 16-bit batch
        makes (quantizing it here took eight more operations a layer, each a
        few microseconds of the host's time in a step that waits on them)."""
        if self.tail_length == self.tail_capacity:
            self.flush()
        if self.tail_keys is None:
            batch, heads = keys.shape[:2]
            self.tail_keys = mx.zeros((batch, heads, self.tail_capacity, keys.shape[3]), keys.dtype)
            self.tail_values = mx.zeros((batch, heads, self.tail_capacity, values.shape[3]), values.dtype)
        at = self.tail_length
        self.tail_keys[..., at : at + 1, :] = keys
        self.tail_values[..., at : at + 1, :] = values
        self.tail_length += 1
        self.offset = self.offset + 1
        self._idx += 1

    def flush(self) -> None:
        """Quantizes the tail's tokens into the buffers (the same values as had
        they been quantized one by one: each token's groups are its own)."""
        n = self.tail_length
        if n:
            self.tail_length = 0
            self._store(self.tail_keys[..., :n, :], self.tail_values[..., :n, :], self._idx - n)
        self.tail_keys = self.tail_values = None

    def unquantized_tail(self) -> tuple[mx.array, mx.array, mx.array] | None:
        """The tail's keys and values and, as a one-element int32 array, the
        position of its first token (None: no token in it)."""
        if not self.tail_length:
            return None
        start = self._idx - self.tail_length
        if self._tail_start is None or self._tail_start[0] != start:
            self._tail_start = (start, mx.array([start], dtype=mx.int32))
        return self.tail_keys, self.tail_values, self._tail_start[1]

    def _store(self, keys, values, at: int) -> None:
        """`keys` and `values` quantized into the buffers at positions at, at + 1, ..."""
        n = keys.shape[2]
        new_keys, new_values = self._quantized_from(keys, values, at)
        for part in range(3):
            self.keys[part][..., at : at + n, :] = new_keys[part]
            self.values[part][..., at : at + n, :] = new_values[part]

    def _quantized_from(self, keys, values, at: int) -> tuple:
        """`keys` (divided by `key_scales`) and `values` quantized, with room
        made in the buffers for them from position `at` on."""
        n = keys.shape[2]
        if self.keys is None or at + n > self.keys[0].shape[2]:
            self._grow(keys, values, at, n)
        if self.key_scales is not None:
            keys = self.key_scales.divide(keys)
        return (mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                mx.quantize(values, group_size=self.group_size, bits=self.bits))

    def trim(self, n):
        n = super().trim(n)
        self.tail_length = max(0, self.tail_length - n)
        return n

    def _grow(self, keys, values, prev: int, n: int) -> None:
        """Room for `n` more tokens, in steps of `step` (as BatchKVCache grows)."""
        batch, heads = keys.shape[:2]
        length = (self.step + n - 1) // self.step * self.step
        empty = (_empty(batch, heads, length, keys.shape[3], keys.dtype, self.bits, self.group_size),
                 _empty(batch, heads, length, values.shape[3], values.dtype, self.bits, self.group_size))
        if self.keys is None:
            self.keys, self.values = empty
            return
        if prev % self.step != 0:
            self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
        self.keys, self.values = tree_map(lambda x, e: mx.concatenate([x, e], axis=2),
                                          (self.keys, self.values), empty)

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        self.flush()
        if self._right_padding is not None:
            shifts = self._right_padding[:, None]
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, shifts, axis=2), (self.keys, self.values))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    @property
    def state(self):
        self.flush()
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self.tail_keys = self.tail_values = None
        self.tail_length = 0

    def filter(self, batch_indices):
        self.flush()
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # padding every row has: drop it
        if shift > 0:
            if self.keys is not None:  # contiguous: a GPU's quantized products take whole buffers (backends.gpu)
                self.keys, self.values = tree_map(lambda x: mx.contiguous(x[..., shift:, :]), (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other):
        self.flush()
        other.flush()
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def aligned(c):
            """c's arrays right-aligned at `end`, `size` long, and its padding."""
            if c.keys is None:
                rows = c.offset.shape[0]
                kv = tree_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype),
                              (like.keys, like.values))
            else:
                kv = (c.keys, c.values)
            left = end - c._idx
            right = size - kv[0][0].shape[2] - left
            if right < 0:
                kv, right = tree_map(lambda x: x[..., :right, :], kv), 0
            if left or right:
                kv = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), kv)
            return kv, c.offset, c.left_padding + left

        (kv_a, off_a, pad_a), (kv_b, off_b, pad_b) = aligned(self), aligned(other)
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b]), kv_a, kv_b)
        self.offset = mx.concatenate([off_a, off_b])
        self.left_padding = mx.concatenate([pad_a, pad_b])
        self._idx = end

    def extract(self, idx):
        self.flush()
        mx.eval(self.left_padding)
        start = self.left_padding.tolist()[idx]
        slot = QuantizedSlot(group_size=self.group_size, bits=self.bits)
        slot.key_scales = self.key_scales
        slot.keys, slot.values = tree_map(lambda x: mx.contiguous(x[idx : idx + 1, :, start : self._idx]),
                                          (self.keys, self.values))
        slot.offset = self._idx - start
        return slot

    @classmethod
    def merge(cls, caches: list[QuantizedSlot]) -> QuantizedBatchKVCache:
        """One batch of these sequences, right-aligned (shorter ones padded on the left)."""
        bits, group, scales, tail = caches[0].bits, caches[0].group_size, caches[0].key_scales, caches[0].tail_capacity
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), bits, group, scales, tail)
        padding = [longest - n for n in lengths]
        first = next(c for c in caches if c.offset)
        buffers = tree_map(lambda x: mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype),
                           (first.keys, first.values))
        for row, (pad, c) in enumerate(zip(padding, caches)):
            if not c.offset:
                continue
            for buffer, part in zip(buffers[0] + buffers[1], c.keys + c.values):
                buffer[row : row + 1, :, pad:] = part[..., : c.offset, :]
        batch = cls(padding, bits, group, scales, tail)
        batch.keys, batch.values = buffers
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self):
        tail = 0 if self.tail_keys is None else self.tail_keys.nbytes + self.tail_values.nbytes
        if self.keys is None:
            return tail
        return tail + sum(x.nbytes for x in self.keys + self.values)


def _empty(batch: int, heads: int, length: int, dim: int, dtype, bits: int, group: int) -> tuple:
    """Zeroed (values, scales, biases) for `length` tokens of `dim`-wide vectors."""
    shape = (batch, heads, length)
    return (mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // group), dtype=dtype),
            mx.zeros((*shape, dim // group), dtype=dtype))


def quantized_slots(caches: list, bits: int, key_scales: list[KeyScales | None] | None = None,
                    tail_capacity: int = 0) -> list:
    """A sequence's per-layer caches for a batch kept at `bits`: attention KV
    layers as QuantizedSlots (keys divided by the layer's `key_scales`, where
    given; decode steps kept at 16 bits up to `tail_capacity`, where the
    model's attention reads them: backends.Backend.kv_tail), the others
    (windows, recurrent state) as they are."""
    scales = key_scales or [None] * len(caches)
    return [QuantizedSlot.of(c, bits, s, tail_capacity) if plain_kv(c) else c for c, s in zip(caches, scales)]


def dequantized(caches: list) -> list:
    """A sequence's per-layer caches with quantized layers as plain KVCaches
    (what the prefix cache stores)."""
    return [c.dequantized() if isinstance(c, QuantizedSlot) else c for c in caches]


def after_one_token(model) -> list | None:
    """The model's fresh per-layer caches after one token (what its layers
    keep, at what widths and dtype); None where no layer keeps plain
    attention KV (a KVCache), without running it."""
    layers = make_prompt_cache(model)
    if not any(plain_kv(c) for c in layers):
        return None
    model(mx.array([[0]]), cache=layers)
    mx.eval([c.state for c in layers])
    return layers


def why_not_quantized(model) -> str | None:
    """Why `model`'s KV cannot be kept quantized in the batch (None: it can):
    one token through a fresh cache shows its layers and head widths."""
    layers = after_one_token(model)
    if layers is None:
        return "it has no plain attention layer"
    widths = {a.shape[-1] for c in layers if plain_kv(c) for a in (c.keys, c.values)}
    if not all(supports(w) for w in widths):
        return f"a head's vector ({min(widths)} values) is not a multiple of {GROUP}"
    return None
