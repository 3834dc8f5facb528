"""The prefix cache of one model: finds the longest cached run of blocks for a
prompt, rebuilds the model's cache objects from it, and stores newly computed
blocks. Runs on the engine's worker thread only.

Packed blocks: when every layer's cache is plain attention KV of one shape and
dtype (most decoder-only models), a block holds all of its KV in one array,
(2 x layers, kv heads, block tokens, head dim). On a GPU a hit is rebuilt with
one concatenation over the blocks, each layer's keys and values then being
views of the result: the cost of a hit grows with its bytes, not with blocks x
layers copy kernels (rebuild_packed). On the CPU each layer is concatenated on
its own, from views of the packed arrays, as for unpacked blocks (the CPU has
no launches to save, and one big fresh buffer costs page faults that the
allocator's reused per-layer buffers do not). Other layouts keep one payload
per layer (codecs.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from tierlm.cache import kv_quant
from tierlm.cache.block_hash import block_key, block_keys, part_keys
from tierlm.cache.codecs import KVCodec, kv_cache, signature, with_room
from tierlm.cache.hot_tier import Block, HotTier, materialize, payload_bytes
from tierlm.cache.ssd_tier import SSDTier

log = logging.getLogger(__name__)

WRITE_BACK_TIMEOUT_S = 30.0  # at close, for writing the hot tier to SSD
PRELOAD_FILES = 8  # block files a preload step reads: a request that comes meanwhile waits for one step at most
# a hit of a part block alone (no full block before it) takes at least this many
# of its tokens: a few shared ones (a chat template's start, which every prompt
# has) are no hit worth a rebuild and an entry in the statistics
MIN_PART_TOKENS = 16
PART = b"part"  # in a part block's key: never a full block's, whatever its tokens
PRELOAD_SCAN_WAIT_S = 0.1  # a preload step's wait for the SSD tier's index at start


@dataclass
class Lookup:
    keys: list[bytes]  # every full block of the prompt
    blocks: list[Block]  # the cached run from the start, verified token by token
    diverged_at: int | None = None  # on a partial hit: first token that differs
    # a cached block after the run (a part block a request ended in, or a sibling
    # that leaves the prompt inside) whose first `part_tokens` tokens continue it
    part: Block | None = None
    part_tokens: int = 0
    # where the last sequence's KV holds at least as much of the prompt: that
    # sequence (taken out of the cache for this request) and the tokens it serves
    # instead of these blocks (engine/last_sequence.py)
    kept: object | None = None
    kept_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks) + self.part_tokens

    @property
    def held(self) -> list[Block]:
        """The blocks a request built on this hit holds while it runs."""
        return self.blocks if self.part is None else [*self.blocks, self.part]

    def cut(self, tokens: int, block_size: int) -> None:
        """Keep at most `tokens` of the hit (the shortest of several ranks')."""
        if self.tokens <= tokens:
            return
        full = tokens // block_size
        if full < len(self.blocks):
            self.blocks, self.part, self.part_tokens = self.blocks[:full], None, 0
        else:
            self.part_tokens = tokens - full * block_size
            self.part = self.part if self.part_tokens else None


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    stored_blocks: int = 0
    stored_parts: int = 0  # blocks of the tokens after a sequence's last full one (Lookup.part)
    part_hit_tokens: int = 0  # of hit_tokens, those from such blocks
    collisions: int = 0
    ssd_hit_tokens: int = 0
    preloaded_blocks: int = 0  # read back from SSD before any prompt asked (preload_step)
    preloaded_bytes: int = 0
    kept_hits: int = 0  # hits served from the last sequence's KV as it was (no rebuild)
    kept_hit_tokens: int = 0


def kv_root(fingerprint: bytes, kv_bits: int, keys_tag: str = "") -> bytes:
    """The root of the block keys: the model's fingerprint, and the KV's bits
    where they are not 16 (16-bit blocks keep the keys they always had), and the
    key factors' digest where blocks are scaled (kv_quant.factors_tag)."""
    if kv_bits == 16:
        return fingerprint
    return hashlib.sha256(fingerprint + f"kv{kv_bits}".encode() + keys_tag.encode()).digest()


def _copied_on_device(packed):
    """A packed block read from a file, copied by the GPU now (not waited for):
    its first use by the GPU moves its pages there (unified memory), and done
    here it overlaps the reads of the blocks after it, not the prefill (a 20k
    token SSD hit's prefill on the H200: 188 -> 90-112 ms, as a hot hit's)."""
    quantized = kv_quant.is_quantized(packed)
    copies = [a + mx.zeros((), a.dtype) for a in (kv_quant.arrays(packed) if quantized else [packed])]
    mx.async_eval(copies)
    return kv_quant.with_arrays(packed, copies) if quantized else copies[0]


def _packed_layers(p: mx.array) -> list:
    """A packed block's per-layer payloads, as views of its array."""
    return [(p[2 * i : 2 * i + 1], p[2 * i + 1 : 2 * i + 2]) for i in range(p.shape[0] // 2)]


def rebuild_packed(packed: list, room: int = 0) -> list:
    """Per-layer KVCaches from packed blocks (2 x layers, heads, tokens, dim), for a
    GPU: one copy of every byte in one operation (a kernel a block, not one a block
    and layer); each layer's keys and values are views of it, `room` tokens
    longer than its tokens."""
    parts = packed + with_room(packed[0], room)
    kv = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    tokens = kv.shape[2] - room
    return [kv_cache(kv[r : r + 1], kv[r + 1 : r + 2], tokens) for r in range(0, kv.shape[0], 2)]


class PrefixCache:
    def __init__(self, fingerprint: bytes, codecs: list, block_size: int, hot_bytes: int,
                 ssd_dir=None, ssd_bytes: int = 0, write_through: bool = False, kv_bits: int = 16,
                 key_scales: list | None = None):
        """`kv_bits`: what packed blocks are kept at, 16 (as computed), 8 or 4
        (kv_quant.py); with 8 or 4 they have keys of their own (`fingerprint`
        is the caller's, `kv_root` makes it theirs), and their keys are divided
        by `key_scales` (per layer, engine.key_scaling) where given."""
        self.key_factors = kv_quant.packed_factors(key_scales) if kv_bits != 16 else None
        keys_tag = kv_quant.factors_tag(self.key_factors)
        self.root, self.codecs, self.block_size = kv_root(fingerprint, kv_bits, keys_tag), codecs, block_size
        self.kv_bits = kv_bits
        self.hot = HotTier(hot_bytes)
        self.stats = PrefixCacheStats()
        self.sliceable = all(c.sliceable for c in codecs)
        self.all_kv = all(isinstance(c, KVCodec) for c in codecs)
        self.signature = f"{signature(codecs)};block={block_size}" + (f";kv={kv_bits}" if kv_bits != 16 else "") \
            + (f";{keys_tag}" if keys_tag else "")
        self.ssd = SSDTier(ssd_dir, ssd_bytes, fingerprint, self.signature) if ssd_dir else None
        self.write_through = write_through
        # the last sequence's KV as the batch left it (engine/last_sequence.py), kept
        # by the engine for its next turn; dropped with the rest of the cache
        self.last = None
        self._preload_keys: deque[bytes] | None = None  # preload_step's files still to read, newest first
        if self.ssd is not None and not write_through:
            self.hot.on_evict = self.ssd.enqueue  # write-back: blocks leaving memory go to SSD

    # ---- lookup -----------------------------------------------------------

    def lookup(self, tokens: list[int], keys: list[bytes] | None = None) -> Lookup:
        """The longest verified run of cached blocks, leaving at least one token
        of the prompt to compute. `keys`: the prompt's block keys, if an earlier
        lookup computed them. Blocks on SSD are read ahead, in parallel, as one
        chain: the lookup knows every key it will want."""
        keys = keys if keys is not None else block_keys(self.root, tokens, self.block_size)
        usable = (len(tokens) - 1) // self.block_size
        wanted = [tuple(tokens[i * self.block_size : (i + 1) * self.block_size]) for i in range(usable)]
        blocks: list[Block] = []
        # the run of blocks in memory or on SSD (as far as its index knows) from the start
        hot = [self.hot.get(k) for k in keys[:usable]]
        run = 0
        while run < usable and (hot[run] is not None or (self.ssd is not None and self.ssd.contains(keys[run]))):
            run += 1
        pinned = [b for b in hot[:run] if b is not None]
        self.acquire(pinned)  # promoting blocks from SSD must not evict the chain's hot ones
        reads = self.ssd.read_chain([(keys[i], wanted[i]) for i in range(run) if hot[i] is None]) \
            if self.ssd is not None else None
        try:
            for i in range(run):
                block = hot[i] or self._promote(next(reads, None), keys[i])
                if block is None:
                    break
                if block.tokens != wanted[i]:
                    self.stats.collisions += 1  # a hash match alone is never trusted
                    log.warning("block key collision at block %d: token ids differ, not used", i)
                    break
                block.users += 1  # promoting later blocks must not evict these
                blocks.append(block)
        finally:
            if reads is not None:
                reads.close()  # cancels the reads no longer needed
            self.release(pinned)
        result = Lookup(keys, blocks)
        nearest, common = self._nearest(tokens, keys, len(blocks))
        if len(blocks) < usable:
            result.diverged_at = len(blocks) * self.block_size + common
        # the part of a block that continues the run, leaving one token to compute
        room = min(len(tokens) - 1 - len(blocks) * self.block_size, self.block_size)
        least = 1 if blocks else MIN_PART_TOKENS
        if min(common, room) >= least and nearest.packed is not None and self.sliceable:
            result.part, result.part_tokens = nearest, min(common, room)
        elif self.ssd is not None and self.sliceable and room >= least:
            self._part_from_ssd(result, tokens, min(room, self.block_size - 1), least)  # the run still held
        self.release(blocks)
        self.hot.touch(result.held)
        return result

    def _part_from_ssd(self, result: Lookup, tokens: list[int], room: int, least: int) -> None:
        """The longest part block in the SSD tier's index that the prompt continues
        its run with, whole (a part block's key names all of its tokens), read into
        the hot tier: after a restart, or one another replica wrote."""
        start = len(result.blocks) * self.block_size
        parent = result.keys[len(result.blocks) - 1] if result.blocks else self.root
        for n, key in part_keys(parent, tokens[start : start + room], least, PART):
            if self.ssd.indexed(key):
                reads = self.ssd.read_chain([(key, tuple(tokens[start : start + n]))])
                try:
                    block = self._promote(next(reads, None), key)
                finally:
                    reads.close()
                if block is not None and block.packed is not None:
                    result.part, result.part_tokens = block, n
                return

    def _promote(self, block: Block | None, key: bytes) -> Block | None:
        """A verified block read from SSD, into the hot tier."""
        if block is None or block.key != key:
            return None
        self._into_hot(block)
        self.stats.ssd_hit_tokens += len(block.tokens)
        return block

    def _into_hot(self, block: Block) -> None:
        if block.packed is not None and mx.default_device() == mx.gpu:
            block.packed = _copied_on_device(block.packed)
        block.nbytes = payload_bytes(self.codecs, block.payload())
        self.hot.put(block)

    def preload_step(self, budget_bytes: int, max_files: int = PRELOAD_FILES) -> bool:
        """Worker thread, while idle after a start: up to `max_files` of the SSD
        tier's most recently used block files of this model read back into the
        hot tier, while it holds less than `budget_bytes`; whether more is left.
        A restarted server then serves the prompts it served before from
        memory, not at the disk's speed. Files of other models (or layouts) in
        the folder are passed over; those that fail a check are deleted."""
        if self.ssd is None:
            return False
        if self._preload_keys is None:
            if not self.ssd.scanned.wait(PRELOAD_SCAN_WAIT_S):  # the index is still being built
                return True
            self._preload_keys = deque(self.ssd.newest_keys())
        for _ in range(max_files):
            if not self._preload_keys or self.hot.nbytes >= budget_bytes:
                self._preload_keys.clear()
                return False
            key = self._preload_keys.popleft()
            if key in self.hot:
                continue
            block = self.ssd.read_whole(key)
            if block is not None:
                self._into_hot(block)
                self.stats.preloaded_blocks += 1
                self.stats.preloaded_bytes += block.nbytes
        return bool(self._preload_keys)

    def _nearest(self, tokens: list[int], keys: list[bytes], i: int) -> tuple[Block | None, int]:
        """The cached block in memory after block i-1 of the prompt (a full block or
        a part one) whose tokens share the longest start with the prompt's from
        block i on, and how many they share."""
        parent = keys[i - 1] if i else self.root
        mine = tokens[i * self.block_size : (i + 1) * self.block_size]
        best, nearest = 0, None
        for sibling in self.hot.children(parent):
            common = next((j for j, (a, b) in enumerate(zip(mine, sibling.tokens)) if a != b),
                          min(len(mine), len(sibling.tokens)))
            if common > best:
                best, nearest = common, sibling
        return nearest, best

    def record(self, result: Lookup, prompt_len: int) -> None:
        """Count a lookup that a request was served with (not one it waited on)."""
        s = self.stats
        s.lookups += 1
        s.lookup_tokens += prompt_len
        s.hit_tokens += max(result.tokens, result.kept_tokens)
        s.kept_hits += bool(result.kept_tokens)
        s.kept_hit_tokens += result.kept_tokens
        s.part_hit_tokens += 0 if result.kept_tokens else result.part_tokens
        if result.tokens or result.kept_tokens:
            s.hits += 1
        else:
            s.misses += 1

    def acquire(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.users += 1

    def release(self, blocks: list[Block]) -> None:
        for b in blocks:
            b.users -= 1

    def rebuild(self, blocks: list[Block], part: Block | None = None, part_tokens: int = 0, room: int = 0) -> list:
        """The model's per-layer cache objects holding these blocks' tokens, then
        the first `part_tokens` of `part` (a packed block); attention KV with
        buffers `room` tokens longer (codecs.RebuiltKVCache)."""
        packed = [self._unpacked(b.packed) for b in blocks]
        if part is not None:
            packed.append(self._unpacked(part.packed)[:, :, :part_tokens])
        if mx.default_device() == mx.gpu and packed and all(p is not None for p in packed) \
                and len({(p.shape[:2], p.shape[3:], p.dtype) for p in packed}) == 1:
            return rebuild_packed(packed, room)
        layers = [b.layers if p is None else _packed_layers(p) for b, p in zip([*blocks, part], packed)]
        return [codec.rebuild([b[i] for b in layers], room) for i, codec in enumerate(self.codecs)]

    def _unpacked(self, packed):
        """A packed block's array, dequantized if it was kept quantized."""
        return kv_quant.dequantize(packed, self.key_factors) if kv_quant.is_quantized(packed) else packed

    # ---- store ------------------------------------------------------------

    def store(self, tokens: list[int], keys: list[bytes], layer_caches: list, first_block: int) -> int:
        """Store the full blocks of `tokens` (the tokens whose KV `layer_caches`
        holds) from block `first_block` on; returns the number of leading blocks
        now stored. Snapshot caches only describe their current position, so with
        them only the block that ends exactly there can be stored."""
        return self.store_many([(tokens, keys, layer_caches, first_block)])[0]

    def store_many(self, items: list[tuple[list[int], list[bytes], list, int]]) -> list[int]:
        """`store` for several (tokens, keys, layer_caches, first_block) at once:
        the new blocks of a step where 32 requests finish go to the device in one
        evaluation, not one per block."""
        counts, blocks = [], {}
        for tokens, keys, layer_caches, first_block in items:
            counts.append(self._new_blocks(tokens, keys, layer_caches, first_block, blocks))
        materialize(self.codecs, blocks.values())
        for block in blocks.values():
            self.hot.put(block)
            if len(block.tokens) < self.block_size:
                self.stats.stored_parts += 1
            else:
                self.stats.stored_blocks += 1
            if self.ssd is not None and self.write_through:
                self.ssd.enqueue(block)
        return counts

    def _new_blocks(self, tokens, keys, layer_caches, first_block: int, blocks: dict) -> int:
        """Adds the not yet cached blocks of one sequence to `blocks` (by key),
        payloads still lazy; returns the number of leading blocks stored after."""
        if not self._consistent(tokens, layer_caches):
            return first_block
        full = len(tokens) // self.block_size
        if len(keys) < full:
            keys = block_keys(self.root, tokens, self.block_size)
        if self.sliceable:
            wanted = range(first_block, full)
        elif len(tokens) % self.block_size == 0 and full > first_block:
            wanted = range(full - 1, full)
        else:
            return first_block
        for i in wanted:
            if keys[i] not in self.hot and keys[i] not in blocks:
                blocks[keys[i]] = self._block(keys[i], keys[i - 1] if i else self.root, tokens,
                                              i * self.block_size, (i + 1) * self.block_size, layer_caches)
        self._add_part(tokens, keys[:full], layer_caches, blocks)
        return full

    def _add_part(self, tokens, keys, layer_caches, blocks: dict) -> None:
        """The tokens after the last full block, as a part block: the next turn of a
        chat starts with them, and a hit then leaves only its new tokens to compute,
        not up to a block's worth more (`Lookup.part`)."""
        start = len(keys) * self.block_size
        if start == len(tokens) or not self.sliceable or not self._packable(layer_caches):
            return
        parent = keys[-1] if keys else self.root
        key = block_key(parent, tokens[start:], PART)
        if key not in self.hot and key not in blocks:
            blocks[key] = self._block(key, parent, tokens, start, len(tokens), layer_caches)

    def _consistent(self, tokens: list[int], layer_caches: list) -> bool:
        for codec, cache in zip(self.codecs, layer_caches):
            if codec.sliceable and cache.offset != len(tokens):
                log.warning("cache holds %d tokens, expected %d: not stored", cache.offset, len(tokens))
                return False
        return True

    def _block(self, key: bytes, parent: bytes, tokens: list[int], start: int, end: int,
               layer_caches: list) -> Block:
        if self._packable(layer_caches):
            packed = mx.concatenate([a[..., start:end, :] for c in layer_caches for a in (c.keys, c.values)])
            if self.kv_bits != 16 and (group := kv_quant.group_for(packed, self.kv_bits)):
                packed = kv_quant.quantize(packed, self.kv_bits, self.key_factors, group)
            return Block(key, parent, tuple(tokens[start:end]), None, payload_bytes(self.codecs, packed),
                         packed=packed)
        layers = [
            codec.slice(cache, start, end) if codec.sliceable else codec.snapshot(cache)
            for codec, cache in zip(self.codecs, layer_caches)
        ]
        return Block(key, parent, tuple(tokens[start:end]), layers, payload_bytes(self.codecs, layers))

    def _packable(self, layer_caches: list) -> bool:
        """Whether every layer is plain KV of one sequence, with keys and values of
        one shape (but for length) and dtype: then a block is one array."""
        if not self.all_kv:
            return False
        first = layer_caches[0].keys
        if first is None or first.ndim != 4 or first.shape[0] != 1:
            return False
        like = (first.shape[1], first.shape[3], first.dtype)
        return all(a is not None and a.ndim == 4 and a.shape[0] == 1 and (a.shape[1], a.shape[3], a.dtype) == like
                   for c in layer_caches for a in (c.keys, c.values))

    def clear(self, ssd: bool = False) -> int:
        """Drop the hot tier (without writing it back) and, if asked, every SSD file;
        what preloading had left to read back is not read (it would refill the tier)."""
        self._preload_keys = deque()
        self.last = None
        on_evict, self.hot.on_evict = self.hot.on_evict, None
        dropped = self.hot.clear()
        self.hot.on_evict = on_evict
        return dropped + (self.ssd.clear() if ssd and self.ssd else 0)

    def close(self, timeout_s: float = WRITE_BACK_TIMEOUT_S) -> None:
        """Graceful shutdown (an unload, a server stop): every hot block not yet on
        SSD is written there, so a reload starts warm, within `timeout_s` for
        encoding and writing together (a line in the log says what was left out);
        then the hot tier is dropped, which frees its arrays."""
        if self.ssd is not None:
            self._write_back(time.monotonic() + timeout_s)
        self.last = None
        self.hot.drop()

    def _write_back(self, deadline: float) -> None:
        tic = time.monotonic()
        # most recently used first: a parent is fresher than its children (HotTier.touch),
        # so if time runs out the blocks on SSD are the beginnings of chains, which a lookup needs
        blocks = [b for b in reversed(self.hot.blocks()) if not self.ssd.contains(b.key)]
        queued = 0
        for block in blocks:
            if not self.ssd.enqueue(block, wait=max(0.0, deadline - time.monotonic())):
                break
            queued += 1
        written = self.ssd.close(timeout=max(0.0, deadline - time.monotonic()))
        if queued < len(blocks) or not written:
            log.warning("SSD write-back at close: %d of %d hot blocks queued, writer %s after %.1f s; "
                        "the rest will be computed again", queued, len(blocks),
                        "done" if written else "still busy", time.monotonic() - tic)
        elif blocks:
            log.info("SSD write-back at close: %d hot blocks written in %.1f s", len(blocks), time.monotonic() - tic)

    def snapshot_stats(self) -> dict:
        s = self.stats
        return {
            "block_size": self.block_size,
            "cache_layout": self.signature,
            "blocks": len(self.hot),
            "bytes": self.hot.nbytes,
            "capacity_bytes": self.hot.capacity,
            "lookups": s.lookups,
            "hits": s.hits,
            "misses": s.misses,
            "hit_tokens": s.hit_tokens,
            "tokens_saved": s.hit_tokens,
            "hit_rate_tokens": s.hit_tokens / s.lookup_tokens if s.lookup_tokens else 0.0,
            "stored_blocks": s.stored_blocks,
            "stored_parts": s.stored_parts,
            "part_hit_tokens": s.part_hit_tokens,
            "kept_hits": s.kept_hits,
            "kept_hit_tokens": s.kept_hit_tokens,
            "kept_sequence_tokens": len(self.last.tokens) if self.last is not None else 0,
            "kept_sequence_bytes": self.last.nbytes if self.last is not None else 0,
            "evictions": self.hot.stats.evictions,
            "collisions": s.collisions,
            "hot_hit_tokens": s.hit_tokens - s.ssd_hit_tokens,
            "ssd_hit_tokens": s.ssd_hit_tokens,
            "preloaded_blocks": s.preloaded_blocks,
            "preloaded_bytes": s.preloaded_bytes,
            "ssd": self.ssd.snapshot_stats() if self.ssd else None,
            "write_policy": None if self.ssd is None else ("write-through" if self.write_through else "write-back"),
        }
