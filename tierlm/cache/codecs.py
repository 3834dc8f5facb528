"""One codec per cache type: how a layer's cache becomes block payloads and back.

- Attention KV (`KVCache`) is sliced by block: a block holds its own tokens' keys
  and values, and a prefix is rebuilt by concatenating its blocks.
- Sliding-window (`RotatingKVCache`) and recurrent state (`ArraysCache`) cannot be
  sliced: a block holds a snapshot of the whole state after its last token, and a
  prefix is rebuilt from the last block's snapshot alone.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, RotatingKVCache


class KVCodec:
    sliceable = True
    name = "kv"

    def slice(self, cache: KVCache, start: int, end: int) -> tuple:
        return (mx.contiguous(cache.keys[..., start:end, :]), mx.contiguous(cache.values[..., start:end, :]))

    def rebuild(self, payloads: list[tuple], room: int = 0) -> KVCache:
        """The payloads' tokens in one cache, its buffers `room` tokens longer."""
        keys = mx.concatenate([p[0] for p in payloads] + with_room(payloads[0][0], room), axis=2)
        values = mx.concatenate([p[1] for p in payloads] + with_room(payloads[0][1], room), axis=2)
        return kv_cache(keys, values, keys.shape[2] - room)

    def arrays(self, payload: tuple) -> list[mx.array]:
        return list(payload)


def with_room(like: mx.array, room: int) -> list[mx.array]:
    """[] or zeros of `room` tokens shaped as `like` (batch, heads, tokens, dim),
    to concatenate after it."""
    return [mx.zeros((*like.shape[:2], room, *like.shape[3:]), dtype=like.dtype)] if room else []


def kv_cache(keys: mx.array, values: mx.array, tokens: int) -> KVCache:
    """A layer's cache holding the first `tokens` of these keys and values
    (batch, heads, tokens, dim); the rest is room to write into."""
    cache = RebuiltKVCache()
    cache.keys, cache.values, cache.offset = keys, values, tokens
    return cache


def plain_kv(cache) -> bool:
    """Whether a layer's cache is mlx-lm's plain KVCache, rebuilt here or not
    (not a subclass of its own, e.g. a chunked one)."""
    return type(cache) in (KVCache, RebuiltKVCache)


class RebuiltKVCache(KVCache):
    """A KVCache rebuilt from cached blocks, that enters mlx-lm's batch as it is
    when it enters alone. mlx-lm's prompt batch merges each sequence's layer
    cache into a BatchKVCache: new zeroed buffers and a copy of every row
    (BatchKVCache.merge), which the remainder's first chunk then grows (zeros
    and a concatenation): with the rebuild's own concatenation, three copies of
    a hit's whole KV and ~10 operations a layer before its first token. Rebuilt
    with room for its remainder, a lone hit's buffers become the batch's (taken
    out of this object: the batch's writes then go into them in place).
    tests/test_cache_speed.py fails loudly if mlx-lm's merge changes."""

    @classmethod
    def merge(cls, caches: list) -> BatchKVCache:
        if len(caches) != 1 or not isinstance(caches[0], RebuiltKVCache) or caches[0].keys is None:
            return BatchKVCache.merge(caches)
        (cache,) = caches
        batch = BatchKVCache([0])
        batch.keys, batch.values, cache.keys, cache.values = cache.keys, cache.values, None, None
        batch.offset = batch.offset + cache.offset
        batch._idx = cache.offset
        return batch


class SnapshotCodec:
    """Whole-state snapshots for caches whose state cannot be cut by position."""

    sliceable = False

    def __init__(self, cache_type: type, name: str):
        self.cache_type, self.name = cache_type, name

    def snapshot(self, cache) -> tuple:
        return _copy_state(cache.state)

    def rebuild(self, payloads: list[tuple], room: int = 0):  # a snapshot has no room to give
        return self.cache_type.from_state(_copy_state(payloads[-1]))

    def arrays(self, payload: tuple) -> list[mx.array]:
        return _arrays_in(payload)


def _copy_state(state):
    """Fresh array objects: mlx-lm updates cache arrays in place (`a[...] = x`
    rebinds the array object), so a snapshot must not share them."""
    if isinstance(state, mx.array):
        return mx.array(state)
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return state


def _arrays_in(state) -> list[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays_in(s)]
    return []


CODECS = {
    KVCache: KVCodec(),
    RotatingKVCache: SnapshotCodec(RotatingKVCache, "rotating"),
    ArraysCache: SnapshotCodec(ArraysCache, "arrays"),
}


def codecs_for(layer_caches: list) -> list | None:
    """The codec of each layer, or None if some layer's cache type has none."""
    found = [CODECS.get(type(c)) for c in layer_caches]
    return None if any(c is None for c in found) else found


def signature(codecs: list) -> str:
    """Names the cache layout, e.g. 'kv*30' or 'rotating*5,kv*1,...'."""
    runs: list[list] = []
    for c in codecs:
        if runs and runs[-1][0] == c.name:
            runs[-1][1] += 1
        else:
            runs.append([c.name, 1])
    return ",".join(f"{name}*{n}" for name, n in runs)
