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
