"""The SSD tier's fast read path without a server: a chain read ahead in
parallel gives back exactly the arrays stored; every check (checksum over
header and data, token ids, format version) still rejects and deletes a bad
file; the writer's queue counts what it drops; `tierlm bench cache` runs."""

from __future__ import annotations

import argparse
import asyncio
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from safetensors.numpy import load as st_load

from tierlm.cache import block_file, ssd_tier
from tierlm.cache.codecs import codecs_for
from tierlm.cache.prefix_cache import PrefixCache, rebuild_packed
from tierlm.models.random_model import tiny_model

BLOCK = 16
N = 8  # blocks of the prompt


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def cache_on(model, folder, **kw) -> PrefixCache:
    return PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, 2**30, ssd_dir=folder,
                       ssd_bytes=2**30, **kw)


@pytest.fixture
def written(model, tmp_path):
    """A folder holding the N blocks of one prompt, and the prompt and its live cache."""
    tokens = [int(t) for t in mx.random.randint(0, 256, (N * BLOCK + 3,)).tolist()]
    live = make_prompt_cache(model)
    model(mx.array([tokens[: N * BLOCK]]), cache=live)
    pc = cache_on(model, tmp_path, write_through=True)
    assert pc.store(tokens[: N * BLOCK], [], live, 0) == N
    assert pc.ssd.flush()
    pc.close()
    return tmp_path, tokens, live


def chain_files(folder, tokens) -> list:
    """The prompt's block files in chain order."""
    files = {}
    for f in folder.rglob("*.safetensors"):
        files[bytes(st_load(f.read_bytes())["tokens"].astype(np.uint32)).hex()] = f
    return [files[np.asarray(tokens[i * BLOCK : (i + 1) * BLOCK], np.uint32).tobytes().hex()] for i in range(N)]


def test_a_chain_read_in_parallel_gives_exactly_the_arrays_stored(model, written, monkeypatch):
    folder, tokens, live = written
    monkeypatch.setattr(ssd_tier, "READ_AHEAD_BYTES", 1)  # the read-ahead window slides block by block
    pc = cache_on(model, folder)
    lookup = pc.lookup(tokens)
    assert lookup.tokens == N * BLOCK and pc.stats.ssd_hit_tokens == N * BLOCK
    assert all(b.packed is not None for b in lookup.blocks)  # plain KV of one shape: one array a block
    rebuilt = pc.rebuild(lookup.blocks)
    for got, want in zip(rebuilt, live):
        assert got.offset == N * BLOCK
        assert mx.array_equal(got.keys, want.keys[..., : N * BLOCK, :]).item()
        assert mx.array_equal(got.values, want.values[..., : N * BLOCK, :]).item()
    s = pc.ssd.snapshot_stats()
    assert s["reads"] == N and s["errors"] == 0 and s["read_seconds"] > 0
    pc.close()


def test_a_chain_half_in_memory_half_on_ssd_is_read_from_both(model, written):
    folder, tokens, live = written
    pc = cache_on(model, folder)
    assert pc.lookup(tokens).tokens == N * BLOCK  # all promoted to the hot tier
    per_block = pc.hot.nbytes // N
    pc.hot.evict_to(per_block * N // 2)  # children go first: the chain's second half leaves memory
    assert len(pc.hot) == N // 2
    reads = pc.ssd.stats.reads
    lookup = pc.lookup(tokens)
    assert lookup.tokens == N * BLOCK and pc.ssd.stats.reads == reads + N // 2
    rebuilt = pc.rebuild(lookup.blocks)
    assert all(mx.array_equal(got.keys, want.keys[..., : N * BLOCK, :]).item() for got, want in zip(rebuilt, live))
    pc.close()


def _stored_prefix(model):
    """N blocks of random tokens stored in a prefix cache, five more after them:
    (tokens, the cache, the blocks a lookup finds, the five's logits over a live
    cache of the N blocks)."""
    tokens = [int(t) for t in mx.random.randint(0, 256, (N * BLOCK + 5,)).tolist()]
    live = make_prompt_cache(model)
    model(mx.array([tokens[: N * BLOCK]]), cache=live)
    pc = PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, 2**30)
    pc.store(tokens[: N * BLOCK], [], live, 0)
    blocks = pc.lookup(tokens).blocks
    expected = model(mx.array([tokens[N * BLOCK :]]), cache=live)
    return tokens, pc, blocks, expected


def test_both_ways_of_rebuilding_packed_blocks_continue_exactly(model):
    """One concatenation and views (what a GPU runs) and one concatenation a layer
    (the CPU) give the same caches, and the next tokens' logits of a full prefill."""
    tokens, pc, blocks, expected = _stored_prefix(model)
    ways = {"one concatenation": rebuild_packed([b.packed for b in blocks]),
            "a concatenation a layer": pc.rebuild(blocks)}  # this is the CPU
    for way, rebuilt in ways.items():
        got = model(mx.array([tokens[N * BLOCK :]]), cache=rebuilt)
        assert mx.allclose(expected, got, atol=1e-5).item(), way


def test_a_hit_rebuilt_with_room_enters_a_lone_batch_as_it_is_and_continues_exactly(model):
    """Both ways of rebuilding give buffers `room` tokens longer; merged alone
    into mlx-lm's batch cache they are the batch's own (no copy, none grown by
    the next tokens, taken out of the rebuilt cache), and the next tokens'
    logits are a full prefill's. Merged with another sequence, mlx-lm's own
    merge copies the rows' tokens alone. (This fails loudly if mlx-lm's
    BatchKVCache changes the fields the lone merge sets.)"""
    tokens, pc, blocks, expected = _stored_prefix(model)
    room = 256
    for way, rebuilt in {"one concatenation": rebuild_packed([b.packed for b in blocks], room),
                         "a concatenation a layer": pc.rebuild(blocks, None, 0, room)}.items():
        assert all(c.offset == N * BLOCK and c.keys.shape[2] == N * BLOCK + room for c in rebuilt), way
        buffers = [c.keys for c in rebuilt]
        batch = [type(c).merge([c]) for c in rebuilt]
        assert all(type(b) is BatchKVCache and b.keys is buf and b._idx == N * BLOCK for b, buf in zip(batch, buffers))
        assert all(c.keys is None for c in rebuilt), way
        got = model(mx.array([tokens[N * BLOCK :]]), cache=batch)
        assert mx.allclose(expected, got, atol=1e-5).item(), way
        assert all(b.keys.shape[2] == N * BLOCK + room and b._idx == len(tokens) for b in batch), way
    pair = [type(c).merge([c, c2]) for c, c2 in zip(pc.rebuild(blocks, None, 0, room), pc.rebuild(blocks))]
    assert all(b.keys.shape[:3] == (2, b.keys.shape[1], N * BLOCK) for b in pair)


def test_a_file_gone_between_its_header_and_its_load_is_a_miss_not_raised(model, written, monkeypatch, caplog):
    """As when another process sharing the folder evicts it: the chain stops there, and
    it is no error (no bad file was found)."""
    folder, tokens, _ = written
    gone = chain_files(folder, tokens)[3]
    real = block_file.check_header

    def check_header_then_delete(head, size, key, *rest):
        header = real(head, size, key, *rest)
        if gone.stem == key.hex():
            gone.unlink()  # its header passed; now MLX cannot open it
        return header

    monkeypatch.setattr(block_file, "check_header", check_header_then_delete)
    pc = cache_on(model, folder)
    assert pc.lookup(tokens).tokens == 3 * BLOCK
    assert pc.ssd.snapshot_stats()["errors"] == 0 and "rejected" not in caplog.text
    pc.close()


@pytest.mark.parametrize("where", ["data", "header", "truncated"])
def test_a_damaged_file_mid_chain_is_deleted_and_the_chain_stops_before_it(model, written, where):
    folder, tokens, _ = written
    bad = chain_files(folder, tokens)[3]
    data = bytearray(bad.read_bytes())
    if where == "data":
        data[-40] ^= 0x01
    elif where == "truncated":  # MLX must never be asked to read past the end
        del data[-100:]
    else:  # a field no other check reads: only the checksum, which covers the header, sees it
        at = data.index(b'"parent":"') + len(b'"parent":"')
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    bad.write_bytes(bytes(data))
    pc = cache_on(model, folder)
    assert pc.lookup(tokens).tokens == 3 * BLOCK
    assert not bad.exists() and pc.ssd.snapshot_stats()["errors"] == 1
    pc.close()


def test_checks_of_identity_still_hold_with_the_fast_checksum(written):
    folder, tokens, _ = written
    files = chain_files(folder, tokens)
    data = files[0].read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    key, fp, sig = bytes.fromhex(meta["key"]), bytes.fromhex(meta["fingerprint"]), meta["signature"]
    block_file.verify(data, key, tuple(tokens[:BLOCK]), fp, sig)  # the file as written passes
    wrong = (tokens[0] + 1,) + tuple(tokens[1:BLOCK])
    with pytest.raises(block_file.BlockFileError, match="token ids differ"):
        block_file.verify(data, key, wrong, fp, sig)
    with pytest.raises(block_file.BlockFileError, match="key"):
        block_file.verify(data, bytes(32), tuple(tokens[:BLOCK]), fp, sig)
    with pytest.raises(block_file.BlockFileError, match="fingerprint"):
        block_file.verify(data, key, tuple(tokens[:BLOCK]), b"another model", sig)
    with pytest.raises(block_file.BlockFileError, match="unreadable"):
        block_file.verify(data[:5], key, tuple(tokens[:BLOCK]), fp, sig)
    # a file of format v1 (SHA-256 era) with a valid v2 checksum still fails: on format
    tensors = st_load(data)
    old = b"".join(bytes(p) for p in block_file.to_bytes(tensors, {**meta, "format": "tierlm-block-v1"}))
    with pytest.raises(block_file.BlockFileError, match="format"):
        block_file.verify(old, key, tuple(tokens[:BLOCK]), fp, sig)


def test_the_writer_counts_blocks_it_drops_and_its_queue_peak(model, tmp_path):
    tokens = list(range(N * BLOCK))
    live = make_prompt_cache(model)
    model(mx.array([tokens]), cache=live)
    pc = cache_on(model, tmp_path, write_through=True)
    pc.ssd.max_pending_bytes = 1  # nothing fits: every block but one the writer already took is dropped
    pc.store(tokens, [], live, 0)
    pc.ssd.flush()
    s = pc.ssd.snapshot_stats()
    assert s["write_drops"] == N - s["writes"] and s["write_drops"] > 0
    assert s["pending_peak_bytes"] == 0
    pc.ssd.max_pending_bytes = 2**30
    pc.clear(ssd=True)
    pc.store(tokens, [], live, 0)
    pc.ssd.flush()
    s = pc.ssd.snapshot_stats()
    assert s["writes"] >= N and 0 < s["pending_peak_bytes"] <= 2**30 and s["write_seconds"] > 0
    pc.close()


@pytest.mark.slow  # a benchmark run
def test_bench_cache_runs_on_a_tiny_model(model_path, tmp_path, monkeypatch):
    from tierlm.bench import cache_bench
    from tierlm.models.random_model import make_random_model

    monkeypatch.setattr(cache_bench, "drop_page_cache", lambda paths: "none (test)")  # other tests run
    folder = make_random_model("tiny", tmp_path / "model", model_path, "float32")
    args = argparse.Namespace(model=str(folder), prefix=[300, 520], ssd_dir=str(tmp_path / "ssd"),
                              hot_cache_size="1GiB", ssd_cache_size="1GiB", disk_bytes=2**20, write_turns=2,
                              write_turn_tokens=512)
    result = asyncio.run(cache_bench.run(args))
    assert [r["tokens"] for r in result["sizes"]] == [256, 512]
    for r in result["sizes"]:
        assert r["hot_cached_tokens"] == r["ssd_disk_cached_tokens"] == r["ssd_cached_cached_tokens"] == r["tokens"]
        assert r["preloaded_cached_tokens"] == r["tokens"] and r["preload_s"] > 0
        assert r["ssd_disk_restore_gbs"] > 0 and r["cold_s"] > 0
    assert result["writer"]["write_drops"] == 0 and result["writer"]["written_blocks"] == 4
    disk = result["disk"]
    assert disk["read_gbs"] > 0 and disk["page_cache_new_memory_gbs"] > 0 and disk["page_cache_touched_memory_gbs"] > 0
    table = cache_bench.table(result)
    assert "| 512 |" in table and "into new memory" in table and "into memory already touched" in table
