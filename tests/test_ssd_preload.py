"""After a start, the SSD tier's most recently used blocks of the model are read
back into memory, before the engine reports ready and then while it is idle
(`ssd_preload`): a restarted server serves the prompts it served before as hot
hits."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_testing import run

from tierlm.cache.hot_tier import Block
from tierlm.cache.ssd_tier import SSDTier
from tierlm.config import Settings
from tierlm.engine import core
from tierlm.engine.core import EngineCore
from tierlm.engine.request import Request, SamplingParams

BLOCK = 16
DOC = "The history of the printing press and its effects on the spread of ideas in Europe. " * 6


async def _engine(loaded, folder, **settings) -> EngineCore:
    engine = EngineCore(f"preload-{id(settings)}", lambda: loaded,
                        Settings(ssd_cache_dir=str(folder), cache_block_size=BLOCK, **settings))
    await engine.start()
    return engine


async def _ask(engine, loaded, text: str):
    tokens = loaded[1].encode(text)
    return await engine.generate(Request(engine.new_request_id(), tokens, SamplingParams(max_tokens=8, temperature=0)))


async def _idle(engine, seconds: float = 30.0) -> None:
    """Until the engine has nothing left to read back."""
    for _ in range(int(seconds / 0.05)):
        if not engine.preloading:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("preloading did not end")


def _seed(loaded, folder) -> tuple:
    """The folder after a server answered DOC and stopped (its hot tier written
    back); the answer, and the cached tokens a repeat would get."""
    async def go():
        engine = await _engine(loaded, folder)
        first = await _ask(engine, loaded, DOC)
        await engine.close()
        return first

    first = run(go())
    return first, first.prompt_tokens - 1


@pytest.mark.parametrize("before_ready", [True, False], ids=["before-ready", "while-idle"])
def test_a_restart_serves_what_it_served_before_from_memory(loaded, tmp_path, monkeypatch, before_ready):
    """The blocks are read back before the engine reports ready (for up to
    PRELOAD_BEFORE_READY_S: all of these), or, past that time, while it is idle."""
    if not before_ready:
        monkeypatch.setattr(core, "PRELOAD_BEFORE_READY_S", 0.0)
    first, whole = _seed(loaded, tmp_path)

    async def restart(**settings):
        engine = await _engine(loaded, tmp_path, **settings)
        cache = engine.scheduler.cache
        at_ready = cache.stats.preloaded_blocks
        await _idle(engine)
        preloaded = cache.stats.preloaded_blocks
        again = await _ask(engine, loaded, DOC)
        stats = cache.snapshot_stats()
        await engine.close()
        return at_ready, preloaded, again, stats

    files = len(list(tmp_path.rglob("*.safetensors")))  # the prompt's blocks and the answer's
    at_ready, preloaded, again, stats = run(restart())
    assert files >= whole // BLOCK and preloaded == files and stats["preloaded_bytes"] > 0
    assert at_ready == (files if before_ready else 0)
    assert again.cached_tokens == whole and stats["ssd_hit_tokens"] == 0  # every block from memory
    assert again.token_ids == first.token_ids
    _, preloaded, again, stats = run(restart(ssd_preload=False))
    assert preloaded == 0 and again.cached_tokens == whole and stats["ssd_hit_tokens"] == whole
    assert again.token_ids == first.token_ids


def test_preloading_passes_over_other_models_files_and_deletes_a_damaged_one(loaded, tmp_path):
    """Another model's block file in the folder is neither read nor deleted; one
    of this model's that fails its checksum is deleted, and the rest load."""
    _seed(loaded, tmp_path)
    ours = sorted(tmp_path.rglob("*.safetensors"))
    damaged = ours[len(ours) // 2]
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    theirs = SSDTier(tmp_path, 2**30, b"another model", "its layout")
    block = Block(b"\x01" * 32, b"\x00" * 32, tuple(range(BLOCK)), None, 0, packed=mx.zeros((2, 1, BLOCK, 4)))
    assert theirs.enqueue(block) and theirs.close()
    foreign = theirs.path_for(block.key.hex())
    assert foreign.exists()

    async def restart():
        engine = await _engine(loaded, tmp_path)
        await _idle(engine)
        stats = engine.scheduler.cache.snapshot_stats()
        await engine.close()
        return stats

    stats = run(restart())
    assert stats["preloaded_blocks"] == len(ours) - 1
    assert foreign.exists() and not damaged.exists() and stats["ssd"]["errors"] == 1


def test_clearing_the_cache_ends_what_preloading_had_left(loaded, tmp_path):
    """A clear of the hot tier mid-preload is not undone by the rest of it."""
    _seed(loaded, tmp_path)

    async def go():
        engine = await _engine(loaded, tmp_path, ssd_preload=False)
        cache = engine.scheduler.cache
        more = await engine.on_worker(cache.preload_step, 2**40, 1)
        one = len(cache.hot)
        await engine.on_worker(cache.clear)
        after = await engine.on_worker(cache.preload_step, 2**40)
        left = len(cache.hot)
        await engine.close()
        return more, one, after, left

    more, one, after, left = run(go())
    assert more and one == 1 and not after and left == 0
