"""One codec per cache type: how a layer's cache becomes block payloads and back.

- Attention KV (`KVCache`) is sliced by block: a block holds its own tokens' keys
  and values, and a prefix is rebuilt by concatenating its blocks.
- Sliding-window (`RotatingKVCache`) and recurrent state (`ArraysCache`) cannot be
  sliced: a block holds a snapshot of the whole state after its last token, and a
  prefix is rebuilt from the last block's snapshot alone.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


class KVCodec:
    sliceable = True
    name = "kv"

    def slice(self, cache: KVCache, start: int, end: int) -> tuple:
        return (mx.contiguous(cache.keys[..., start:end, :]), mx.contiguous(cache.values[..., start:end, :]))

    def rebuild(self, payloads: list[tuple]) -> KVCache:
        keys = mx.concatenate([p[0] for p in payloads], axis=2)
        values = mx.concatenate([p[1] for p in payloads], axis=2)
        return kv_cache(keys, values)

    def arrays(self, payload: tuple) -> list[mx.array]:
        return list(payload)


def kv_cache(keys: mx.array, values: mx.array) -> KVCache:
    """A layer's KVCache holding these keys and values (batch, heads, tokens, dim)."""
    cache = KVCache()
    cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
    return cache


class SnapshotCodec:
    """Whole-state snapshots for caches whose state cannot be cut by position."""

    sliceable = False

    def __init__(self, cache_type: type, name: str):
        self.cache_type, self.name = cache_type, name

    def snapshot(self, cache) -> tuple:
        return _copy_state(cache.state)

    def rebuild(self, payloads: list[tuple]):
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
