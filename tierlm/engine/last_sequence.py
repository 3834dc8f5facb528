"""The last sequence's KV, kept as it is for its conversation's next turn.

An agent sends its whole context again every turn: the sequence that just
finished, its answer, and a new message. The prefix cache serves that turn
from blocks, which costs a rebuild (every byte of the prefix copied into new
buffers) and, on a GPU, new allocations of the whole KV (~3-5 ms of a 20k-token
hit of a 1B model on an H100, before its first token). A lone sequence's batch
buffers, though, already hold exactly that KV, with room after it: when the
last row leaves the generation batch they are kept here (no copy; its blocks
are still stored from them as usual), and a request whose prompt continues
them takes them into the batch as they are (`codecs.RebuiltKVCache`), its new
tokens then written in place. llama.cpp's server keeps a slot's context the
same way.

One sequence is kept, only while nothing else needs its memory: the next
admission that does not continue it drops it, as does a shortfall of memory
or the cache being cleared. Only a plain 16-bit KV batch of one unpadded row
qualifies (what the rebuild's hand-over takes too).

This reaches inside mlx-lm's batch caches (`keys`, `values`, `_idx`,
`left_padding`); tests/test_last_sequence.py fails loudly if they change.
"""

from __future__ import annotations

from mlx_lm.models.cache import BatchKVCache

from tierlm.cache.codecs import kv_cache
from tierlm.engine.ragged_kv import RaggedBatchKVCache


class LeavesLastRow:
    """A generation batch (mixin) that keeps the layer caches of the last row
    to leave it (`left_behind`: its uid and caches), which mlx-lm's filter
    would drop."""

    left_behind: tuple | None = None

    def filter(self, keep) -> None:
        if not keep and len(self.uids) == 1:
            self.left_behind = (self.uids[0], list(self.prompt_cache))
        super().filter(keep)

    def take_left_behind(self, uid: int) -> list | None:
        """The caches row `uid` left behind, if it was the last to leave; taken
        out of the batch either way (they hold the row's whole KV)."""
        behind, self.left_behind = self.left_behind, None
        return behind[1] if behind is not None and behind[0] == uid else None


def whole_kv(layer_caches: list, tokens: int) -> list | None:
    """Each layer's cache of a one-row batch holding `tokens` tokens, its
    buffers as they are (room included); None unless every layer is plain
    attention KV of one unpadded row ending there."""
    out = []
    for c in layer_caches:
        if type(c) not in (BatchKVCache, RaggedBatchKVCache) or c.keys is None or c.keys.shape[0] != 1:
            return None
        if c._idx != tokens or getattr(c, "ends", [tokens])[0] != tokens:
            return None
        out.append(c)
    if not out or int(out[0].left_padding.item()) != 0:  # one row: every layer's padding is the same
        return None
    return [kv_cache(c.keys, c.values, tokens) for c in out]


class LastSequence:
    """A finished sequence's tokens and its KV's buffers (one cache a layer)."""

    def __init__(self, tokens: list[int], caches: list) -> None:
        self.tokens, self.caches = tokens, caches
        self.nbytes = sum(c.keys.nbytes + c.values.nbytes for c in caches)

    def reach(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` this holds the KV of, leaving at
        least one of it to compute."""
        most = min(len(self.tokens), len(prompt) - 1)
        if most <= 0:
            return 0
        if self.tokens[:most] == prompt[:most]:  # the common case, compared in C
            return most
        lo, hi = 0, most  # the longest equal start: equal at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.tokens[:mid] == prompt[:mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def take(self, tokens: int) -> list:
        """The caches for a sequence continuing the first `tokens` of these (the
        buffers go with them: this object gives them up)."""
        caches, self.caches = self.caches, []
        return [kv_cache(c.keys, c.values, tokens) for c in caches]
