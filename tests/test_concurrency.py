"""Continuous batching through the real server: concurrent streams, batch
invariance, aborts and disconnects."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import wait_until

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a tip for learning to cook.",
    "Describe a cat in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a pet fish.",
]
MODEL = "SmolLM2-135M-Instruct"


def greedy(client, prompt, max_tokens=16):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content


def greedy_stream(client, prompt, max_tokens=16):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=max_tokens, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


class PeakLoad:
    """Samples /stats in the background to see how many requests ran at once."""

    def __init__(self, server):
        self.server, self.peak, self._stop = server, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.stats()["running"])
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def alone(client):
    """Each prompt's greedy answer with nothing else running."""
    return [greedy(client, p) for p in PROMPTS]


def test_eight_concurrent_streams_are_batched_and_match_alone(server, client, alone):
    with PeakLoad(server) as load, ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy_stream(client, p), PROMPTS))
    assert load.peak >= 4, f"requests were not batched (peak running {load.peak})"
    # Greedy output is batch-invariant on the CPU backend: the same text alone and batched.
    assert together == alone


def test_non_streaming_concurrent_requests(client, alone):
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: greedy(client, p), PROMPTS[:4]))
    assert together == alone[:4]


def test_abort_mid_stream_frees_the_slot(server, client):
    before = server.stats()["aborted_requests"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to one thousand."}],
        max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += 1
        if received == 4:
            break
    stream.close()
    wait_until(lambda: server.stats()["aborted_requests"] == before + 1)
    wait_until(lambda: server.stats()["running"] == 0)
    assert greedy(client, PROMPTS[0]) == greedy(client, PROMPTS[0])  # still serving


def test_client_disconnect_on_non_streaming_request_aborts_it(server):
    before = server.stats()["aborted_requests"]
    body = {"model": MODEL, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/chat/completions", json=body, timeout=2.0)
    wait_until(lambda: server.stats()["aborted_requests"] == before + 1)
    wait_until(lambda: server.stats()["running"] == 0)


def test_more_requests_than_slots_wait_and_finish(server, client):
    """With 8 slots, 12 requests: the extra ones queue, then all complete."""
    prompts = [f"Say the number {i}." for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: greedy(client, p, max_tokens=4), prompts))
    assert all(results)
    assert server.stats()["running"] == 0
