"""The hot tier: computed blocks in memory, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import mlx.core as mx

from tierlm.cache import kv_quant


@dataclass
class Block:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    layers: list | None  # one codec payload per layer; None for a packed block
    nbytes: int
    users: int = 0  # running requests built on this block: never evicted meanwhile
    # plain attention KV of every layer in one array, (2 x layers, kv heads, tokens,
    # head dim): keys then values, layer by layer (PrefixCache packs when it can);
    # or that array quantized (a kv_quant payload, with `cache_kv_bits` 8 or 4)
    packed: mx.array | tuple | None = None

    def payload(self):
        """What an SSD file stores: the packed array, or the per-layer payloads."""
        return self.packed if self.packed is not None else self.layers


@dataclass
class HotTierStats:
    evictions: int = 0
    evicted_bytes: int = 0


class HotTier:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = defaultdict(set)
        self.stats = HotTierStats()
        self.on_evict = None  # callback(block): the SSD tier hooks in here

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def blocks(self) -> list[Block]:
        return list(self._blocks.values())

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def children(self, key: bytes) -> list[Block]:
        return [self._blocks[k] for k in self._children.get(key, ()) if k in self._blocks]

    def touch(self, blocks: list[Block]) -> None:
        """Mark a chain as just used. Deepest first, so that a parent is always
        fresher than its children and is evicted after them."""
        for block in reversed(blocks):
            self._blocks.move_to_end(block.key)

    def put(self, block: Block) -> None:
        if block.key in self._blocks:
            self._blocks.move_to_end(block.key)
            return
        self._blocks[block.key] = block
        self._children[block.parent].add(block.key)
        self.nbytes += block.nbytes
        self.evict_to(self.capacity)

    def evict_to(self, budget: int) -> None:
        """Drop least recently used blocks not in use until under `budget`."""
        if self.nbytes <= budget:
            return
        for key in [k for k, b in self._blocks.items() if b.users == 0]:
            if self.nbytes <= budget:
                break
            self._remove(self._blocks[key])

    def clear(self) -> int:
        """Drop every block not in use; returns how many were dropped."""
        before = len(self._blocks)
        self.evict_to(0)
        return before - len(self._blocks)

    def drop(self) -> None:
        """Forget every block, in use or not, without eviction callbacks: the tier's
        owner is going away (PrefixCache.close)."""
        self._blocks.clear()
        self._children.clear()
        self.nbytes = 0

    def _remove(self, block: Block) -> None:
        del self._blocks[block.key]
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block.key)
            if not siblings:
                del self._children[block.parent]
        self.nbytes -= block.nbytes
        self.stats.evictions += 1
        self.stats.evicted_bytes += block.nbytes
        if self.on_evict is not None:
            self.on_evict(block)


def payload_arrays(codecs: list, layers):
    """Every array of a block's payloads, layer by layer (a packed block: its array)."""
    if isinstance(layers, mx.array):
        return iter((layers,))
    if kv_quant.is_quantized(layers):
        return iter(kv_quant.arrays(layers))
    return (a for codec, payload in zip(codecs, layers) for a in codec.arrays(payload))


def payload_bytes(codecs: list, layers) -> int:
    return sum(a.nbytes for a in payload_arrays(codecs, layers))


def materialize(codecs: list, blocks) -> None:
    """Schedule the blocks' payloads now, in one evaluation, so a stored block never
    holds a lazy graph that keeps the whole source cache alive. Not waited for: a
    wait here would also wait for the decode step queued ahead of the copies, and
    leave the device idle while the next step is built. Readers (a rebuild on this
    stream, an SSD encode) wait for the copies themselves."""
    mx.async_eval([a for b in blocks for a in payload_arrays(codecs, b.payload())])

