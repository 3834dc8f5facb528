"""The running batch's KV kept at float16 on the CPU (`batch_kv_bits` 16,
engine.half_kv): half the bytes a token, answers beside float32 KV's, and
the same bits alone or in a batch, and from a hit as from the prompt
computed, over the hot tier and over the SSD tier after a restart."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from engine_testing import run
from test_kv_bits import DOCS, QUESTION, _agree, _answers, _engine

from tierlm.engine.request import Request, SamplingParams

HALF = {"batch_kv_bits": 16}
pytestmark = pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                                reason="float16 KV is the CPU's: a GPU keeps 16 bits as computed")


def _ask(engine, prompt: list[int], tokens: int = 8):
    return engine.generate(Request(engine.new_request_id(), prompt,
                                   SamplingParams(max_tokens=tokens, temperature=0, logprobs=0)))


def _same(a, b) -> bool:
    """The same tokens with the same log-probabilities, to the bit."""
    return a.token_ids == b.token_ids and [p[1] for p in a.logprobs or ()] == [p[1] for p in b.logprobs or ()]


@pytest.fixture(scope="module")
def float32_kv(loaded):
    """The answers and sizes of KV as computed (float32 on the CPU)."""
    return run(_answers(loaded))


@pytest.mark.slow  # ~9 s: two engines, six answers; half KV is a setting, off by default
def test_the_batch_keeps_half_the_bytes_and_answers_as_float32_kv(loaded, float32_kv):
    """The default model, three documents of ~420 tokens stored and hit: the
    batch's KV and the hot tier's blocks take half the bytes a token of
    float32's; the greedy answers equal float32 KV's on at least 2 of 3 (3
    here), the chosen tokens' log-probabilities moving by < 0.05 while they
    agree (0.002 here)."""
    half, sizes = run(_answers(loaded, **HALF))
    assert all(o.cached_tokens >= 384 for o in half)
    equal, moved = _agree(half, float32_kv[0])
    assert equal >= 2
    assert moved and max(moved) < 0.05, moved
    assert float32_kv[1]["batch"] / sizes["batch"] == 2
    assert float32_kv[1]["hot"] / sizes["hot"] == 2


@pytest.mark.slow  # an opt-in layout; its batch and bytes tests above stay in the fast run
def test_a_hit_and_a_batch_give_the_bits_of_the_prompt_computed_alone(loaded):
    """Over float16 KV as over float32: a document's question answered from
    its cached blocks equals the same prompt computed alone by an engine
    without a cache, and four prompts at once equal each alone, token and
    log-probability (the products read float16 exactly: graph_ops)."""
    tokenizer = loaded[1]
    prompts = [tokenizer.encode(doc) + tokenizer.encode(QUESTION) for doc in DOCS + [DOCS[0][:300]]]

    async def go():
        cold = await _engine(loaded, prefix_cache=False, **HALF)
        try:
            assert cold.get_stats()["kv"]["batch_float16"]
            alone = [await _ask(cold, p) for p in prompts]
            together = await asyncio.gather(*(_ask(cold, p) for p in prompts))
        finally:
            await cold.close()
        cached = await _engine(loaded, **HALF)
        try:
            for doc in DOCS:  # stored ...
                await _ask(cached, tokenizer.encode(doc), 1)
            hits = [await _ask(cached, p) for p in prompts[:3]]  # ... and hit
        finally:
            await cached.close()
        return alone, together, hits

    alone, together, hits = run(go())
    assert all(o.error is None for o in alone + together + hits)
    assert sum(len(o.token_ids) > 1 for o in alone) >= 2, [o.token_ids for o in alone]
    assert all(_same(a, b) for a, b in zip(alone, together))
    assert all(h.cached_tokens >= 384 for h in hits)
    assert all(_same(a, h) for a, h in zip(alone, hits))


@pytest.mark.slow  # three engines, one restart over the SSD tier
def test_float16_blocks_on_ssd_serve_a_restart_and_no_float32_engine(loaded, tmp_path):
    """Written at close, read after a restart: the same answers as before it;
    an engine keeping float32 KV on the same folder finds none of the blocks
    (another computation's KV: keys of their own) and computes its own."""
    ssd = {"ssd_cache": True, "ssd_cache_dir": str(tmp_path), "ssd_cache_size": "1GiB"}
    prompts = [loaded[1].encode(doc) + loaded[1].encode(QUESTION) for doc in DOCS[:2]]

    async def answers(**settings):
        engine = await _engine(loaded, **ssd, **settings)
        try:
            return [await _ask(engine, p) for p in prompts]
        finally:
            await engine.close()  # writes the hot tier to the folder

    first = run(answers(**HALF))
    restarted = run(answers(**HALF))
    assert all(o.cached_tokens >= 384 for o in restarted)
    assert all(_same(a, b) for a, b in zip(first, restarted))
    assert all(o.cached_tokens == 0 for o in run(answers()))


def test_a_model_whose_kv_is_not_float32_as_computed_keeps_it_and_says_why():
    """A float32 Llama's KV can be kept at float16; the same model in bfloat16
    already computes 16-bit KV (the engine logs the reason and keeps it as
    computed); a model whose layers hold no plain attention KV has nothing to keep."""
    from tierlm.backends.cpu import route
    from tierlm.engine.half_kv import why_not_half
    from tierlm.models.random_model import TINY, build_model, tiny_model

    if not route.prepare().native_kernels.on:
        pytest.skip("float16 KV is read by tierlm's native attention kernels")

    model = tiny_model("llama")
    assert why_not_half(model) is None
    model.set_dtype(mx.bfloat16)
    assert why_not_half(model) == "its KV is not float32 as computed"
    windows_only = build_model(dict(TINY["gemma3_text"], sliding_window_pattern=4))  # 3 layers, all windows
    mx.eval(windows_only.parameters())
    assert why_not_half(windows_only) == "it has no plain attention layer"


@pytest.mark.slow  # loads Qwen2.5-Coder-0.5B and answers 8 prompts twice
def test_qwen_coders_answers_over_float16_kv_stay_those_of_its_float32_kv(qwen_path, monkeypatch):
    """Qwen2.5-Coder-0.5B (its keys have channels 10-40x the median): 8 chat
    prompts in one batch, greedy, 24 tokens, the products in float32 (no int8
    activations, so that only the KV's rounding moves the answers): over
    float16 KV at least 6 of 8 equal those over float32 KV (8 here;
    bench_lab.kv_quality --bits 16: 15 of 16 prompts at 64 tokens)."""
    import sys

    from mlx_lm.models.cache import make_prompt_cache

    from bench_lab.kv_quality import PROMPTS
    from tierlm.engine.half_kv import half_slots
    from tierlm.models.loader import load_model

    monkeypatch.setenv("TIERLM_INT8_ACTIVATIONS", "off")
    model, tokenizer = load_model(qwen_path)[:2]
    batch_generate = sys.modules["mlx_lm.generate"].batch_generate  # the package's `generate` is a function
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[:8]]

    def answers(half: bool):
        caches = [half_slots(make_prompt_cache(model)) for _ in prompts] if half else None
        return batch_generate(model, tokenizer, prompts, prompt_caches=caches, max_tokens=24).texts

    full, half = answers(False), answers(True)
    assert sum(a == b for a, b in zip(half, full)) >= 6, list(zip(half, full))
