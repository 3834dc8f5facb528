"""The prefix cache through the real server: hits are visible in usage, outputs do
not change, a shared system prompt is computed once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a meticulous assistant for a hardware store. Answer briefly, name the aisle "
          "where an item can be found, and never invent products. ") * 6  # ~170 tokens


def ask(client, messages, max_tokens=12):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)


def cache_stats(server) -> dict:
    return httpx.get(server.v1 + "/cache/stats").json()["prefix_cache"]


def clear(server) -> None:
    assert httpx.delete(server.v1 + "/cache").status_code == 200


@pytest.fixture(scope="module")
def cached_server(model_path, tmp_path_factory):
    srv = start_server(model_path, tmp_path_factory.mktemp("pc") / "server.log", "--cache-block-size", "32")
    yield srv
    stop_server(srv)


def test_hit_shows_in_usage_and_output_is_unchanged(cached_server, uncached_server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where are the hammers?"}]
    clear(cached_server)
    client = cached_server.client()
    cold = ask(client, messages)
    hot = ask(client, messages)
    off = ask(uncached_server.client(), messages)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = hot.usage.prompt_tokens_details.cached_tokens
    # every token but the last: the full blocks, then the first turn's part block
    assert cached == hot.usage.prompt_tokens - 1
    assert cold.choices[0].message.content == hot.choices[0].message.content == off.choices[0].message.content
    assert off.usage.prompt_tokens_details.cached_tokens == 0


def test_multi_turn_chat_hits_on_turns_two_and_three(cached_server):
    clear(cached_server)
    client = cached_server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where are the nails?"}]
    previous_prompt = 0
    for turn in range(3):
        reply = ask(client, messages, max_tokens=16)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            # at least the whole previous prompt: its blocks, then its part block (and more of the reply's)
            assert cached >= previous_prompt
        previous_prompt = reply.usage.prompt_tokens
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And what about item number {turn + 2}?"}]


def test_shared_system_prompt_is_computed_once(cached_server):
    clear(cached_server)
    stored_before = cache_stats(cached_server)["stored_blocks"]
    client = cached_server.client()
    questions = [f"Where would I find item {i}?" for i in range(8)]
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda m: ask(client, m, max_tokens=4), msgs))
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert cached[0] == 0  # the first computed the shared part ...
    assert min(cached[1:]) >= 160  # ... and the other seven took it from the cache
    # the shared blocks were stored once; beyond them each request stores only its own
    stored = cache_stats(cached_server)["stored_blocks"] - stored_before
    shared_blocks = cached[1] // 32
    own_blocks = sum((r.usage.total_tokens - 1) // 32 - shared_blocks for r in replies)
    assert stored <= shared_blocks + own_blocks


def test_stats_and_clear(cached_server):
    client = cached_server.client()
    ask(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], max_tokens=2)
    stats = cache_stats(cached_server)
    assert stats["blocks"] > 0 and stats["bytes"] > 0
    assert {"hits", "misses", "tokens_saved", "evictions", "block_size"} <= set(stats)
    clear(cached_server)
    assert cache_stats(cached_server)["blocks"] == 0


@pytest.mark.slow  # a server of its own
def test_eviction_under_a_small_budget(model_path, tmp_path):
    # one 32-token block of this model's KV is ~1.4 MiB; 6 MiB holds four
    srv = start_server(model_path, tmp_path / "server.log", "--cache-block-size", "32", "--hot-cache-size", "6MiB")
    try:
        client = srv.client()
        for i in range(4):
            ask(client, [{"role": "system", "content": f"Variant {i}. " + SYSTEM},
                         {"role": "user", "content": "Hello"}], max_tokens=2)
        stats = cache_stats(srv)
        assert stats["evictions"] > 0
        assert stats["bytes"] <= 6 * 2**20
    finally:
        stop_server(srv)
