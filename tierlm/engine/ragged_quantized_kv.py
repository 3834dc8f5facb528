"""The running batch's quantized KV (quantized_kv) with rows that end apart
(ragged_kv), so that a batch keeping KV at 8 or 4 bits verifies drafts.

A verification feeds every row the same number of tokens and keeps a
different number per row: each row keeps its own end, new tokens are
quantized and written at each row's end, a row gives tokens back by moving
its end, and the mask shows each query its row's keys up to itself. A
token's groups (64 values along a head's vector) are its own, so its codes
are the same whichever step wrote it: a row's KV is what a plain batch's
would be, and attention that reads a row's keys as one run ending at its
last token (tierlm.backends.cpu) gives the same bits drafting or not.

Decode steps are not kept in a 16-bit tail here (the GPU's kernel reads one
tail position for every row): the tail is quantized when rows become ragged.

This class reaches into BatchKVCache's and QuantizedBatchKVCache's fields, as
those modules do; tests/test_ragged_quantized_kv.py fails loudly if they change.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from tierlm.engine.key_scaling import scaled_keys
from tierlm.engine.quantized_kv import QuantizedBatchKVCache, QuantizedSlot
from tierlm.engine.ragged_kv import RaggedBatchKVCache, _write_positions


class RaggedQuantizedBatchKVCache(QuantizedBatchKVCache):
    """QuantizedBatchKVCache with a per-row end (`ends`: the buffer index after
    each row's last token); `_idx` is the furthest end."""

    # what a row's end means is ragged_kv's: the same offsets, mask, giving back and moving rows
    _set_ends = RaggedBatchKVCache._set_ends
    make_mask = RaggedBatchKVCache.make_mask
    drop = RaggedBatchKVCache.drop
    trim = RaggedBatchKVCache.trim
    align = RaggedBatchKVCache.align
    size = RaggedBatchKVCache.size

    @classmethod
    def of(cls, cache: QuantizedBatchKVCache) -> RaggedQuantizedBatchKVCache:
        """The same rows and buffers (the tail quantized), every row ending at
        the batch's end."""
        cache.flush()
        ragged = cls.__new__(cls)
        ragged.__dict__.update(cache.__dict__)
        ragged.tail_capacity = 0
        ragged.ends = [cache._idx] * cache.left_padding.shape[0]
        return ragged

    def update_and_fetch(self, keys, values):
        if len(set(self.ends)) <= 1:  # rows aligned: the batch's own write
            out = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return out
        width = keys.shape[2]
        new = self._quantized_from(keys, values, max(self.ends))
        self.keys, self.values = (self._written(buffers, parts) for buffers, parts in zip((self.keys, self.values), new))
        self._set_ends([e + width for e in self.ends])
        keys, values = self.keys_and_values()
        return scaled_keys(keys, self.key_scales), values

    def _written(self, buffers: tuple, parts: tuple) -> tuple:
        """`buffers` with the quantized `parts` of new tokens written at each row's end."""
        return tuple(mx.put_along_axis(buffer, _write_positions(self.ends, part.shape[2], part.shape), part, axis=2)
                     for buffer, part in zip(buffers, parts))

    def filter(self, batch_indices) -> None:
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        ends, before = [self.ends[i] for i in rows], self._idx
        super().filter(batch_indices)  # drops the padding every row has, moving _idx back by as much
        self._set_ends([e - (before - self._idx) for e in ends])

    def extend(self, other) -> None:
        """Rows of `other` (ragged or aligned) after these, both right-justified
        to the later end as QuantizedBatchKVCache.extend does."""
        other_ends = getattr(other, "ends", [other._idx] * other.left_padding.shape[0])
        top = max(self._idx, other._idx)
        ends = [e + top - self._idx for e in self.ends] + [e + top - other._idx for e in other_ends]
        super().extend(other)
        self._set_ends(ends)

    def extract(self, idx: int) -> QuantizedSlot:
        """Row idx alone, from its start to its end."""
        start = int(self.left_padding[idx].item())
        slot = QuantizedSlot(group_size=self.group_size, bits=self.bits)
        slot.key_scales = self.key_scales
        slot.keys, slot.values = tree_map(lambda x: mx.contiguous(x[idx : idx + 1, :, start : self.ends[idx]]),
                                          (self.keys, self.values))
        slot.offset = self.ends[idx] - start
        return slot
