"""A batch KV cache whose rows may end at different places, so that a row can
give back its last tokens without moving a byte.

mlx-lm's BatchKVCache keeps every row right-aligned: all rows end at one index
and shorter ones are padded on the left. Verifying draft tokens (speculative
decoding) feeds every row the same number of tokens and keeps a different
number per row; realigning them moved each row's whole KV every step (at four
2k-token sequences on a 2-core CPU, ~65 ms a step of ~90). Here each row
keeps its own end: giving back n tokens only moves the row's end back, new
tokens are written at each row's end, and the attention mask shows each query
its own row's keys up to itself. A row's keys stay one contiguous run ending
at its last token, as in a plain step, so the attention products (each summed
in an order fixed by the row's end: tierlm.backends.cpu) keep their bits.

A sliding-window layer (RaggedWindowKVCache) keeps its keys the same way, in
the order of their positions, rather than in mlx-lm's rotating buffer: a
rotating buffer overwrites the oldest key as it writes a new one, and a token
given back would have taken a key its row still needs. It keeps a few more
keys than its window (the most a draft can give back), and drops the oldest
ones, a chunk at a time, once no row can see them.

Every layer of a batch has its rows end at the same places, so the small
arrays a step derives from the ends (each row's position, where its new keys
go) are made once a step on the worker's thread and shared by the layers
(`_per_step`). On a GPU a small model's step costs its graph's nodes and
uploads, not its arithmetic: made a layer at a time, they gave a ragged plain
step of SmolLM2 at 8 rows 2270 nodes and 60 uploads, where BatchKVCache's has
1842 nodes and none; shared, 1794 nodes and 1 upload.

These subclasses reach into BatchKVCache's and BatchRotatingKVCache's fields;
tests/test_speculation.py fails loudly if they change.
"""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, dynamic_roll

from tierlm.engine.request import MAX_DRAFT_TOKENS

_step_arrays = threading.local()  # per worker thread: key -> an array this step's layers share


def _per_step(key: tuple, make) -> mx.array:
    """`make()`, once for every layer that asks with the same key on this
    thread: the layers of a step share their index arrays. The arrays are
    never written to, so equal keys may share one across batches too."""
    table = getattr(_step_arrays, "table", None)
    if table is None or len(table) > 32:  # a few steps' worth
        table = _step_arrays.table = {}
    found = table.get(key)
    if found is None:
        found = table[key] = make()
    return found


def _ends_array(ends: list[int]) -> mx.array:
    return _per_step(("ends", *ends), lambda: mx.array(ends))


def _write_positions(ends: list[int], width: int, shape: tuple) -> mx.array:
    """Where each row's `width` new keys go, broadcast to the keys' shape."""
    def make():
        where = mx.array([[e + j for j in range(width)] for e in ends])[:, None, :, None]
        return mx.broadcast_to(where, shape)
    return _per_step(("write", width, tuple(shape), *ends), make)


class RaggedBatchKVCache(BatchKVCache):
    """BatchKVCache with a per-row end (`ends`: the buffer index after each
    row's last token); `_idx` is the furthest end."""

    @classmethod
    def of(cls, cache: BatchKVCache) -> RaggedBatchKVCache:
        """The same rows and buffers, every row ending at the batch's end."""
        ragged = cls.__new__(cls)
        ragged.__dict__.update(cache.__dict__)
        ragged.ends = [cache._idx] * cache.left_padding.shape[0]
        return ragged

    def _set_ends(self, ends: list[int]) -> None:
        self.ends = ends
        self._idx = max(ends, default=0)
        self.offset = _ends_array(ends) - self.left_padding  # each row's position (RoPE)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if len(set(self.ends)) <= 1:  # rows aligned: BatchKVCache's own write
            out = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return out
        width = keys.shape[2]
        self._grow(max(self.ends) + width, keys, values)
        self.keys = mx.put_along_axis(self.keys, _write_positions(self.ends, width, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, _write_positions(self.ends, width, values.shape), values,
                                        axis=2)
        self._set_ends([e + width for e in self.ends])
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def _grow(self, end: int, keys: mx.array, values: mx.array) -> None:
        """Room in the buffers up to `end`, in BatchKVCache's steps."""
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        batch, heads, _, k_dim = keys.shape
        size = (end + self.step - 1) // self.step * self.step
        have = 0 if self.keys is None else self.keys.shape[2]
        more_k = mx.zeros((batch, heads, size - have, k_dim), keys.dtype)
        more_v = mx.zeros((batch, heads, size - have, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = more_k, more_v
        else:
            self.keys = mx.concatenate([self.keys, more_k], axis=2)
            self.values = mx.concatenate([self.values, more_v], axis=2)

    def drop(self, counts: list[int]) -> None:
        """Give back the last `counts[i]` tokens of row i."""
        self._set_ends([e - n for e, n in zip(self.ends, counts)])

    def trim(self, n: int) -> int:
        self.drop([n] * len(self.ends))
        return n

    def align(self) -> None:
        """Every row moved to end at the furthest end, its padding grown by as
        much (one gather a buffer): a step then writes as BatchKVCache does."""
        shifts = [self._idx - e for e in self.ends]
        if not any(shifts):
            return
        by = mx.array(shifts)
        if self.keys is not None:  # arrays, or quantized (values, scales, biases) triples (ragged_quantized_kv)
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, by[:, None], axis=2), (self.keys, self.values))
        self.left_padding = self.left_padding + by
        self._set_ends([self._idx] * len(self.ends))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        """Query q of row i (at its end + q) sees its row's keys from its start
        to itself."""
        keys = mx.arange(self._idx + N)[None, None, None, :]
        last = (_ends_array(self.ends)[:, None] + mx.arange(N)[None])[:, None, :, None]
        mask = (keys <= last) & (keys >= self.left_padding[:, None, None, None])
        if window_size is not None:
            mask = mask & (keys > last - window_size)
        return mask

    def filter(self, batch_indices) -> None:
        ends = [self.ends[i] for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array)
                                       else batch_indices)]
        if self.keys is not None:
            self.keys, self.values = self.keys[batch_indices], self.values[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist(), default=0)
        if shift > 0:  # the rows' common padding goes, as BatchKVCache.filter does
            if self.keys is not None:
                self.keys, self.values = self.keys[..., shift:, :], self.values[..., shift:, :]
            self.left_padding = self.left_padding - shift
            ends = [e - shift for e in ends]
        self._set_ends(ends)

    def extend(self, other: BatchKVCache) -> None:
        """Rows of `other` (ragged or aligned) after these, both right-justified
        to the later end as BatchKVCache.extend does."""
        other = other if isinstance(other, RaggedBatchKVCache) else RaggedBatchKVCache.of(other)
        top = max(self._idx, other._idx)
        ends = [e + top - self._idx for e in self.ends] + [e + top - other._idx for e in other.ends]
        super().extend(other)
        self._set_ends(ends)

    def extract(self, idx: int) -> KVCache:
        """Row idx alone, from its start to its end."""
        cache = KVCache()
        start = max(0, int(self.left_padding[idx].item()))  # below 0: its oldest keys were dropped
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self.ends[idx]])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start : self.ends[idx]])
        cache.offset = cache.keys.shape[2]
        return cache

    def size(self) -> int:
        return self._idx


class RaggedWindowKVCache(RaggedBatchKVCache):
    """A sliding-window layer's batch cache as ragged rows in the order of their
    positions. A row's `left_padding` is the buffer index of its first key
    (negative once keys before the buffer's start are dropped), and `hidden`
    counts its tokens that were never in the buffer (a window restored from
    the prefix cache holds only its last keys): its position is its end, less
    its padding, plus those."""

    keep_extra = MAX_DRAFT_TOKENS + 1  # keys beyond the window: what one step can give back
    drop_chunk = 256  # the oldest keys go this many at a time (each time copies the buffer)

    @classmethod
    def of(cls, cache: BatchRotatingKVCache) -> RaggedWindowKVCache:
        """The same rows, their keys put in the order of their positions."""
        cache._temporal_order()
        ragged = cls.__new__(cls)
        ragged.window = cache.max_size
        ragged._right_padding = None
        ragged.left_padding = cache.left_padding
        ragged.keys = None if cache.keys is None else cache.keys[..., : cache._idx, :]
        ragged.values = None if cache.values is None else cache.values[..., : cache._idx, :]
        ragged.hidden = (cache.offset - cache._idx + cache.left_padding).tolist()
        ragged._set_ends([cache._idx] * cache.left_padding.shape[0])
        return ragged

    def _set_ends(self, ends: list[int]) -> None:
        super()._set_ends(ends)
        hidden = self.hidden
        self.offset = self.offset + _per_step(("hidden", *hidden), lambda: mx.array(hidden, dtype=mx.int32))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        out = super().update_and_fetch(keys, values)
        self._drop_unseen()  # after the write: this step's mask was made for the buffer as it was
        return out

    def _drop_unseen(self) -> None:
        """Drop the oldest keys once every row is past them by its window and
        what a step can give back, a chunk at a time."""
        unseen = min(self.ends, default=0) - self.window - self.keep_extra
        if unseen < self.drop_chunk or self.keys is None:
            return
        self.keys, self.values = self.keys[..., unseen:, :], self.values[..., unseen:, :]
        self.left_padding = self.left_padding - unseen
        self._set_ends([e - unseen for e in self.ends])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        return super().make_mask(N, return_array, window_size=window_size or self.window)

    def filter(self, batch_indices) -> None:
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        self.hidden = [self.hidden[i] for i in rows]
        super().filter(batch_indices)

    def extend(self, other) -> None:
        if isinstance(other, BatchRotatingKVCache):
            other = RaggedWindowKVCache.of(other)
        self.hidden = self.hidden + other.hidden
        super().extend(other)

    def extract(self, idx: int) -> RotatingKVCache:
        """Row idx alone as mlx-lm's single-sequence cache holds it: its last
        `window` keys, in order."""
        row = super().extract(idx)
        cache = RotatingKVCache(self.window)
        cache.keys = mx.contiguous(row.keys[..., -self.window :, :])
        cache.values = mx.contiguous(row.values[..., -self.window :, :])
        cache.offset = int(self.offset[idx].item())
        cache._idx = cache.keys.shape[2]
        return cache
