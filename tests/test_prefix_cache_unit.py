"""The prefix cache without a server: codec round trips for each cache type on
tiny random-weight models, token verification, eviction rules."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tierlm.cache.block_hash import block_key, block_keys, part_keys
from tierlm.cache.codecs import codecs_for
from tierlm.cache.hot_tier import Block
from tierlm.cache.prefix_cache import PrefixCache
from tierlm.models.random_model import tiny_model

BLOCK = 16


def test_block_keys_are_those_blocks_on_disk_were_stored_under():
    """The SSD tier outlives a process and a version: a key is SHA-256 of the
    parent's key, the ids as 4-byte little-endian integers and the extra bytes,
    however the ids come (list, tuple, numpy) and whichever function hashes them."""
    tokens = [0, 1, 70000, 2**32 - 1, 5, 6, 7, 8, 9]
    first = hashlib.sha256(b"root" + np.array(tokens[:4], dtype="<u4").tobytes() + b"x").digest()
    second = hashlib.sha256(first + np.array(tokens[4:8], dtype="<u4").tobytes() + b"x").digest()
    for ids in (tokens, tuple(tokens), np.array(tokens, dtype=np.int64)):
        assert block_keys(b"root", ids, 4, b"x") == [first, second]
    assert block_key(b"root", tokens[:4], b"x") == first
    assert part_keys(first, tokens[4:8], 3, b"x") == [(4, second), (3, block_key(first, tokens[4:7], b"x"))]


def new_cache(model, hot_bytes=2**30) -> PrefixCache:
    return PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, hot_bytes)


def run(model, tokens, cache):
    return model(mx.array([tokens]), cache=cache)


def computed(model, tokens) -> list:
    """The model's cache after a prefill of `tokens`."""
    live = make_prompt_cache(model)
    run(model, tokens, live)
    return live


def filled(model, tokens, hot_bytes=2**30) -> PrefixCache:
    """A prefix cache holding the blocks of `tokens`."""
    pc = new_cache(model, hot_bytes)
    pc.store(tokens, [], computed(model, tokens), 0)
    return pc


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_codec_round_trip_continues_exactly(name):
    """Store the blocks of a 48-token prefix, rebuild a cache from them, and the
    next tokens' logits equal those of the cache that computed the prefix."""
    model = tiny_model(name)
    tokens = [int(t) for t in mx.random.randint(0, 256, (60,)).tolist()]
    prefix, rest = tokens[:48], tokens[48:]
    live = make_prompt_cache(model)
    pc = new_cache(model)
    stored = 0
    for end in (16, 32, 48):  # prefill pauses at each block boundary, as the scheduler's segments do
        run(model, prefix[end - 16 : end], live)
        stored = pc.store(prefix[:end], [], live, stored)
    assert stored == 3  # 48 tokens: past gemma's 32-token window
    lookup = pc.lookup(tokens)
    assert lookup.tokens == 48
    assert all((b.packed is not None) == (name == "llama") for b in lookup.blocks)  # plain KV: packed
    rebuilt = pc.rebuild(lookup.blocks)
    expected = run(model, rest, live)
    got = run(model, rest, rebuilt)
    assert mx.allclose(expected, got, atol=1e-5).item()


def test_snapshot_caches_store_only_at_block_boundaries():
    model = tiny_model("gemma3_text")
    pc = new_cache(model)
    assert not pc.sliceable
    tokens = list(range(40))  # not a block boundary
    assert pc.store(tokens, [], computed(model, tokens), 0) == 0
    assert len(pc.hot) == 0


def test_kv_blocks_are_sliced_from_any_position():
    model = tiny_model("llama")
    tokens = list(range(40))
    assert new_cache(model).store(tokens, [], computed(model, tokens), 0) == 2  # two full blocks of 16
    assert filled(model, tokens).lookup(tokens + [1]).tokens == 40  # and the part block of the last 8


def test_store_many_stores_a_shared_prefix_once_and_every_tail():
    """Two sequences finishing in the same step, stored together: the block they
    share is stored once, each keeps its own, and both continue from the cache."""
    model = tiny_model("llama")
    shared = list(range(16))
    a, b = shared + list(range(100, 132)), shared + list(range(200, 216))
    pc = new_cache(model)
    assert pc.store_many([(a, [], computed(model, a), 0), (b, [], computed(model, b), 0)]) == [3, 2]
    assert pc.stats.stored_blocks == 4 and len(pc.hot) == 4
    assert pc.lookup(a + [1]).tokens == 48 and pc.lookup(b + [1]).tokens == 32
    expected = run(model, [7], computed(model, b))
    got = run(model, [7], pc.rebuild(pc.lookup(b + [1]).blocks))
    assert mx.allclose(expected, got, atol=1e-5).item()


def test_a_hit_always_leaves_one_token_to_compute():
    tokens = list(range(32))
    pc = filled(tiny_model("llama"), tokens)
    assert pc.lookup(tokens).tokens == 31  # both blocks cached: the first, then 15 of the second
    assert pc.lookup(tokens + [7]).tokens == 32


def test_forged_hash_collision_is_caught_by_token_comparison():
    honest = list(range(16))
    pc = filled(tiny_model("llama"), honest)
    victim = list(range(100, 116)) + [1, 2]
    forged_key = block_keys(pc.root, victim, BLOCK)[0]
    real = pc.hot.get(block_keys(pc.root, honest, BLOCK)[0])
    # a block claiming the victim's key but holding other tokens' KV
    pc.hot.put(Block(forged_key, pc.root, real.tokens, real.layers, real.nbytes, packed=real.packed))
    lookup = pc.lookup(victim)
    assert lookup.tokens == 0
    assert pc.stats.collisions == 1


def test_lru_eviction_spares_blocks_in_use():
    model = tiny_model("llama")
    block_bytes = filled(model, list(range(16))).hot.nbytes
    pc = new_cache(model, hot_bytes=3 * block_bytes)
    prompts = [[p] * 16 for p in range(1, 7)]
    held = None
    for i, p in enumerate(prompts):
        pc.store(p, [], computed(model, p), 0)
        if i == 0:
            held = pc.lookup(p + [0]).blocks
            pc.acquire(held)  # a running request built on this block
    assert pc.hot.nbytes <= 3 * block_bytes
    assert pc.hot.stats.evictions == 3
    assert held[0].key in pc.hot  # oldest, but in use: survived
    pc.release(held)
    pc.hot.evict_to(0)
    assert len(pc.hot) == 0


def test_parents_outlive_children_in_lru_order():
    model = tiny_model("llama")
    tokens = list(range(48))
    three_blocks = filled(model, tokens).hot.nbytes
    pc = filled(model, tokens, hot_bytes=three_blocks)
    pc.lookup(tokens + [1])
    pc.hot.capacity = three_blocks * 2 // 3
    pc.hot.evict_to(pc.hot.capacity)  # room for two of three blocks
    assert pc.lookup(tokens + [1]).tokens == 32  # the leaf went, the chain stays usable


def test_divergence_point_is_reported():
    tokens = list(range(40))
    pc = filled(tiny_model("llama"), tokens)
    other = tokens[:21] + [200] * 19
    lookup = pc.lookup(other)
    assert lookup.diverged_at == 21 and lookup.tokens == 21  # the second block's first 5 tokens too


def test_ssd_clear_also_drops_blocks_still_queued_for_the_writer(tmp_path, monkeypatch):
    """Blocks waiting for the SSD writer, or in its hands, when the cache is cleared
    must never land afterwards. The writer is held in its encoding step (a slow
    disk, which cannot be had for real here) while the clear runs."""
    import threading

    from tierlm.cache import block_file

    model = tiny_model("llama")
    disk = threading.Event()
    to_bytes = block_file.to_bytes

    def slow_to_bytes(*args):
        disk.wait(timeout=30)
        return to_bytes(*args)

    monkeypatch.setattr(block_file, "to_bytes", slow_to_bytes)
    pc = PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, 2**30,
                     ssd_dir=tmp_path, ssd_bytes=2**30, write_through=True)
    tokens = list(range(8 * BLOCK))
    assert pc.store(tokens, [], computed(model, tokens), 0) == 8
    assert pc.ssd.snapshot_stats()["pending_bytes"] > 0  # the writer holds the first, 7 wait
    pc.clear(ssd=True)
    disk.set()
    pc.ssd.flush()
    assert list(tmp_path.rglob("*.safetensors")) == [] and list(tmp_path.rglob("*.tmp")) == []
    assert pc.ssd.snapshot_stats()["files"] == 0
    pc.store(tokens, [], computed(model, tokens), 0)  # after the clear, blocks land again
    pc.ssd.flush()
    assert len(list(tmp_path.rglob("*.safetensors"))) == 8
    pc.close()
