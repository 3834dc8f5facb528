"""Unloading returns the memory: `EngineCore.close()` frees the model (nothing of
tierlm keeps it alive), MLX's memory and the C heap go back, and the hot tier is
written to the SSD tier first, so a reload starts warm. Real models: SmolLM2-135M
and gemma-3-270m from ~/.tierlm/models, loaded as the server loads them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierlm.cache.block_hash import model_fingerprint
from tierlm.config import Settings
from tierlm.engine.allocator import glibc
from tierlm.engine.core import EngineCore
from tierlm.engine.request import Request, SamplingParams
from tierlm.models.loader import load_model

pytestmark = pytest.mark.slow  # load/unload cycles in a process of their own, RSS measured

MODELS = Path(os.environ.get("TIERLM_TEST_MODEL_DIR", Path.home() / ".tierlm" / "models"))
TWO_MODELS = ("SmolLM2-135M-Instruct", "gemma-3-270m")
BLOCK = 16
MiB = 2**20


def model_folder(name: str) -> Path:
    path = MODELS / name
    if not (path / "config.json").is_file():
        pytest.skip(f"{name} is not in {MODELS}")
    return path


def engine_for(path: Path, settings: Settings, tokenizer=None) -> EngineCore:
    """As the server builds one (serving/assembly.py): load_model on the worker
    thread, with the tokenizer the server keeps across loads when one is given."""
    def load():
        return load_model(path, settings.cpu_weights_dtype, use_cpu_kernels=settings.cpu_kernels,
                          use_amx=settings.cpu_amx, tokenizer=tokenizer)

    return EngineCore(path.name, load, settings, model_fingerprint(path, {}))


def greedy(engine: EngineCore, text: str, max_tokens: int = 2) -> Request:
    tokens = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return Request(engine.new_request_id(), tokens, SamplingParams(max_tokens=max_tokens, temperature=0))


def test_an_unloaded_models_hot_blocks_are_on_ssd_and_a_reload_starts_warm(tmp_path):
    """Write-back mode: while the engine runs, its blocks stay in memory (none on
    SSD); close() writes every one of them; a new engine on the same model and
    folder takes the prompt's whole blocks from the SSD tier (read back before
    it reports ready: `ssd_preload`)."""
    path = model_folder(TWO_MODELS[0])
    ssd = tmp_path / "ssd"
    settings = Settings(cache_block_size=BLOCK, ssd_cache_dir=str(ssd), ssd_write_through=False)
    text = "Tell me about the lighthouse keeper who counted the waves every night, one by one. " * 3

    async def run():
        first = engine_for(path, settings)
        await first.start()
        request = greedy(first, text, max_tokens=4)
        cold = await first.generate(request)
        stats = await first.cache_stats()
        on_ssd_while_running = len(list(ssd.rglob("*.safetensors")))
        await first.close()
        written = len(list(ssd.rglob("*.safetensors")))

        second = engine_for(path, settings)
        await second.start()
        try:
            warm = await second.generate(Request(second.new_request_id(), request.prompt_tokens, request.params))
            return request, cold, stats, on_ssd_while_running, written, warm, await second.cache_stats()
        finally:
            await second.close()

    request, cold, stats, on_ssd_while_running, written, warm, again = asyncio.run(run())
    n = len(request.prompt_tokens)
    assert n > 2 * BLOCK
    assert stats["write_policy"] == "write-back" and stats["blocks"] >= n // BLOCK
    assert on_ssd_while_running == 0  # nothing left memory before close: the write below is close's
    assert written == stats["blocks"]
    assert warm.cached_tokens == n - 1  # its blocks, then the part block of the prompt's end
    assert again["preloaded_blocks"] == written and again["ssd"]["errors"] == 0
    assert warm.token_ids == cold.token_ids


def test_a_stuck_ssd_writer_delays_close_only_up_to_its_timeout_and_says_so(tmp_path, monkeypatch, caplog):
    """Write-back at close is bounded: a writer that never finishes costs
    `timeout_s`, a warning says how much was left out, and the hot tier is
    dropped all the same."""
    import threading

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tierlm.cache import block_file
    from tierlm.cache.codecs import codecs_for
    from tierlm.cache.prefix_cache import PrefixCache
    from tierlm.models.random_model import tiny_model

    model = tiny_model("llama")
    stuck = threading.Event()  # the writer is stuck until the test lets it go, after close
    to_bytes = block_file.to_bytes
    monkeypatch.setattr(block_file, "to_bytes", lambda *a: stuck.wait() and to_bytes(*a))
    pc = PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, 2**30,
                     ssd_dir=tmp_path, ssd_bytes=2**30)
    tokens = list(range(4 * BLOCK))
    live = make_prompt_cache(model)
    model(mx.array([tokens]), cache=live)
    assert pc.store(tokens, [], live, 0) == 4
    closing = threading.Thread(target=pc.close, kwargs={"timeout_s": 0.5})
    try:
        with caplog.at_level("WARNING", logger="tierlm.cache.prefix_cache"):
            closing.start()
            closing.join(timeout=120)  # only a guard: close returns once its timeout is spent
            assert not closing.is_alive(), "close waited for the stuck writer"
    finally:
        stuck.set()
        closing.join(timeout=120)
    assert "SSD write-back at close: 4 of 4 hot blocks queued, writer still busy" in caplog.text
    assert len(pc.hot) == 0 and pc.hot.nbytes == 0


# The cycles run in a process of their own: its memory is what is measured, not
# what earlier tests in this one left behind.
CYCLES_SCRIPT = textwrap.dedent("""
    import asyncio, gc, json, os, sys, weakref
    from pathlib import Path

    import mlx.core as mx

    sys.path.insert(0, {tests!r})
    from test_unload_memory import engine_for, greedy
    from tierlm.config import Settings
    from tierlm.models.loader import load_tokenizer

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    async def main(paths, cycles):
        settings = Settings(ssd_cache=False, cache_block_size={block}, cpu_weights_dtype={dtype!r})
        report = {{"active_before": mx.get_active_memory(), "threads_before": len(os.listdir("/proc/self/task")),
                   "rss": [], "active": [], "cache": [], "alive": [], "threads": []}}
        tokenizers = {{}}  # kept across loads, as the server's TurnsCache keeps them
        for _ in range(cycles):
            for path in paths:
                if path not in tokenizers:
                    tokenizers[path] = await asyncio.to_thread(load_tokenizer, Path(path))
                engine = engine_for(Path(path), settings, tokenizers[path])
                await engine.start()
                model = weakref.ref(engine.model)
                await engine.generate(greedy(engine, "Write a haiku about the sea, please."))
                await engine.close()
                # the engine object is still held here: close() alone must free the model
                report["alive"].append([model() is not None, engine.tokenizer is not None])
                report["active"].append(mx.get_active_memory())
                report["cache"].append(mx.get_cache_memory())
            report["rss"].append(rss())
            report["threads"].append(len(os.listdir("/proc/self/task")))
            print(f"cycle {{len(report['rss'])}}: RSS {{rss() >> 20}} MiB", file=sys.stderr, flush=True)
        print(json.dumps(report))

    asyncio.run(main(sys.argv[1:-1], int(sys.argv[-1])))
""")


def cycles_report(paths: list[Path], cycles: int, dtype: str) -> dict:
    script = CYCLES_SCRIPT.format(tests=str(Path(__file__).parent), block=BLOCK, dtype=dtype)
    done = subprocess.run([sys.executable, "-c", script, *map(str, paths), str(cycles)],
                          check=False, capture_output=True, text=True, timeout=120 + 60 * cycles)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The issue asks for 20: TIERLM_UNLOAD_CYCLES=20 runs them on SmolLM2 and Gemma
# 3 270M (about 3 minutes on the 2-core Xeon when it is otherwise idle; Gemma's
# 262k-token tokenizer alone takes ~4 s to load). The suite runs 2, beside a tiny
# random model: enough to see the model freed every time, the worker thread
# reused, and a clean exit (RSS is compared from 10 cycles up).
CYCLES = int(os.environ.get("TIERLM_UNLOAD_CYCLES", "2"))


@pytest.mark.skipif(glibc() is None, reason="RSS comes back through glibc's malloc_trim")
def test_repeated_load_unload_cycles_of_two_models_give_the_memory_back(tmp_path):
    """CYCLES cycles, each loading, generating with and unloading SmolLM2 and then
    gemma-3-270m with TIERLM_UNLOAD_CYCLES set, a tiny random model otherwise
    (weights as stored: the float32 conversion and AMX packing triple a load's
    time on this machine). What is compared:
    - after every close(), with the engine object still referenced, the model has
      been collected (a weak reference is dead) and the engine holds no tokenizer
      (the tokenizer is loaded once per model and kept, as the server keeps it:
      serving/assembly.TurnsCache);
    - after every close(), MLX's active memory is back to its level before the
      first load, within 1 MiB, and its buffer cache holds at most 1 MiB;
    - the process has as many threads after the last cycle as after the first:
      engines borrow the worker thread and MLX stream of the one before
      (tierlm.engine.workers), as MLX never ends a stream's thread;
    - with 10 cycles or more, RSS (VmRSS) after the last cycle's unloads is within
      5 % of RSS after the first cycle's unloads (not the cold start before any model was loaded:
      the first load leaves libraries, compiled kernels and the heap's resident
      structures behind for good);
    - the process exits with 0 and without "terminate called" (MLX's thread-local
      state outliving the interpreter)."""
    paths = [model_folder(TWO_MODELS[0])]
    if "TIERLM_UNLOAD_CYCLES" in os.environ:  # the run: the two real models
        paths.append(model_folder(TWO_MODELS[1]))
    else:  # the suite's: a tiny random model beside SmolLM2 (Gemma's loads took 40 s of CI)
        from tierlm.models.random_model import make_random_model

        paths.append(make_random_model("tiny", tmp_path / "tiny", paths[0], "float32"))
    report = cycles_report(paths, CYCLES, "stored")
    assert report["alive"] == [[False, False]] * (CYCLES * len(paths))
    assert max(report["active"]) <= report["active_before"] + MiB
    assert max(report["cache"]) <= MiB  # a scalar or two may be freed after close() emptied it
    assert report["threads"] == [report["threads"][0]] * CYCLES, report["threads"]
    if CYCLES < 10:
        # a cycle's RSS moves by up to ~25 MiB with where the heap's top lands (SmolLM2
        # alone: 143, 170, 170, 170 MiB); a leak of a few MiB per cycle shows over many
        return
    first, last = report["rss"][0], report["rss"][-1]
    assert last <= first * 1.05, (f"RSS after the first cycle {first / MiB:.0f} MiB, after {CYCLES}: "
                                  f"{last / MiB:.0f} MiB; per cycle: {[round(r / MiB) for r in report['rss']]}")
