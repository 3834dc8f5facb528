"""A prefill that would not fit the memory limit is refused with a 400, not a crash."""

from __future__ import annotations

import openai
import pytest
from conftest import start_server, stop_server


@pytest.fixture(scope="module")
def small_server(model_path, tmp_path_factory):
    # weights are ~94 MiB; 200 MB leaves room for short prompts only
    srv = start_server(model_path, tmp_path_factory.mktemp("guard") / "server.log", "--memory-limit", "200MB")
    yield srv
    stop_server(srv)


@pytest.mark.slow  # a server of its own
def test_long_prompt_is_refused_short_prompt_served(small_server):
    client = small_server.client()
    long_text = "The quick brown fox jumps over the lazy dog. " * 250  # ~2500 tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                       messages=[{"role": "user", "content": long_text}], max_tokens=4)
    body = e.value.body
    assert body["code"] == "memory_limit"
    assert "MiB" in body["message"] and "memory limit of 191 MiB" in body["message"]
    ok = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert ok.usage.completion_tokens >= 1
    assert small_server.process.poll() is None



@pytest.fixture(scope="module")
def kv_heavy_server(model_path, tmp_path_factory):
    """A random model with small weights (~18 MB) and a lot of KV per token (8
    layers x 8 KV heads x 64 x float32 = 32 KiB), so a few hundred tokens fill a
    100 MB limit fast, without hours of CPU."""
    from tierlm.models.random_model import PRESETS, make_random_model

    kv_heavy = {**PRESETS["tiny"], "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
                "head_dim": 64}
    folder = make_random_model(kv_heavy, tmp_path_factory.mktemp("kv-heavy") / "model", model_path, "float32")
    srv = start_server(folder, folder.parent / "server.log", "--memory-limit", "100MB", "--no-ssd-cache")
    yield srv
    stop_server(srv)


@pytest.mark.slow  # a server of its own, twelve long requests
def test_requests_needing_twice_the_limit_together_wait_their_turn(kv_heavy_server):
    """Twelve requests of 560 prompt tokens and 40 generated ones: each fits alone;
    together their KV is more than twice the limit. They wait their turn, all are
    served in full, and MLX's peak memory never passes the limit. (Most of each
    request's tokens are prompt, prefilled in a few steps, not decoded one at a time.)"""
    from concurrent.futures import ThreadPoolExecutor

    client = kv_heavy_server.client()

    def ask(i):
        return client.completions.create(model="model", prompt=[100 + i] * 560, max_tokens=40,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(ask, range(12)))
    assert [r.usage.completion_tokens for r in replies] == [40] * 12
    stats = kv_heavy_server.stats()
    kv_bytes = 12 * 600 * 8 * 2 * 8 * 64 * 4  # requests x tokens x layers x (K, V) x heads x head_dim x fp32
    assert kv_bytes > 2 * stats["memory_limit_bytes"]
    assert stats["memory_peak_bytes"] <= stats["memory_limit_bytes"]
    assert kv_heavy_server.process.poll() is None


@pytest.mark.slow  # a server of its own
def test_a_request_whose_generation_cannot_fit_is_refused_up_front(kv_heavy_server):
    with pytest.raises(openai.BadRequestError) as e:
        kv_heavy_server.client().completions.create(model="model", prompt=[5] * 10, max_tokens=5000)
    assert e.value.body["code"] == "memory_limit" and "generating up to 5000 tokens" in e.value.body["message"]


def test_a_request_still_prefilling_keeps_what_it_was_promised():
    """Admission counts what running requests may still take. A prefill runs over
    several steps: until its first token a request may take all it was promised at
    admission but the KV it has prefilled; after, only the KV of the tokens it may
    still generate. (Counting only the latter let a slow CPU admit requests between
    one's prefill chunks, three prefills at once, MLX's peak past the limit.)"""
    from types import SimpleNamespace

    from tierlm.engine.memory_guard import MemoryGuard, ModelProfile
    from tierlm.engine.request import Request, SamplingParams
    from tierlm.engine.scheduler import Scheduler, _Running

    profile = ModelProfile(weight_bytes=10**7, kv_bytes_per_token=32 * 1024, fixed_cache_bytes=0, num_heads=8,
                           hidden_size=64, intermediate_size=128)
    guard = MemoryGuard(profile, 10**8, prefill_step=256, stores_blocks=True)
    request = Request("a", [5] * 600, SamplingParams(max_tokens=40))
    state = _Running(request, text=None, prefilled_tokens=256)
    scheduler = SimpleNamespace(guard=guard)
    prefilling = Scheduler.may_still_take(scheduler, state)
    assert prefilling == guard.request_bytes(600, 40) - 256 * 32 * 1024
    state.first_token_time, state.prefilled_tokens, state.completion_tokens = 1.0, 600, 10
    assert Scheduler.may_still_take(scheduler, state) == guard.decode_bytes(30) < prefilling
