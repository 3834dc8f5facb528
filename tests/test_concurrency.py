"""Continuous batching through the real server: concurrent streams, batch
invariance, aborts and disconnects."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

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


def greedy(client, prompt, max_tokens=16, **extra):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=max_tokens, extra_body=extra or None)
    return r.choices[0].message.content


def piece(chunk) -> str:
    return (chunk.choices[0].delta.content or "") if chunk.choices else ""


@pytest.fixture(scope="module")
def alone(client):
    """Each prompt's first 16 greedy tokens with nothing else running."""
    return [greedy(client, p, ignore_eos=True) for p in PROMPTS]


@pytest.mark.slow  # eight long streams; batching is also in test_python_api and test_engine
def test_eight_concurrent_streams_are_batched_and_match_alone(server, client, alone):
    """Eight long streams; once each has its first token, all eight are running
    (none can have finished), and the stats say so. Each stream then reads on
    until it has as much text as its prompt's answer alone: the same text."""
    running = []  # what /stats says once every stream has its first token
    all_started = threading.Barrier(len(PROMPTS), action=lambda: running.append(server.stats()["running"]),
                                    timeout=120)

    def stream(prompt, expected):
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, stream=True,
            max_tokens=4000, extra_body={"ignore_eos": True})
        text = ""
        try:
            for chunk in chunks:
                text += piece(chunk)
                if text:
                    break
            all_started.wait()
            for chunk in chunks:
                if len(text) >= len(expected):
                    break
                text += piece(chunk)
        finally:
            chunks.close()  # aborts the rest
        return text[: len(expected)]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(stream, PROMPTS, alone))
    assert running == [len(PROMPTS)], "the streams were not batched"
    # Greedy output is batch-invariant on the CPU backend: the same text alone and batched.
    assert together == alone
    wait_until(lambda: server.stats()["running"] == 0)


def test_non_streaming_concurrent_requests(client, alone):
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: greedy(client, p, ignore_eos=True), PROMPTS[:4]))
    assert together == alone[:4]


def test_abort_mid_stream_frees_the_slot(server, client):
    before = server.stats()["aborted_requests"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to one thousand."}],
        max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True},
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
    """The client hangs up while its request is running, far from its end."""
    before = server.stats()
    body = json.dumps({"model": MODEL, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Tell me a very long story."}]}).encode()
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        decoding = lambda s: s["running"] == 1 and s["generated_tokens_total"] > before["generated_tokens_total"]
        wait_until(lambda: decoding(server.stats()))
    wait_until(lambda: server.stats()["aborted_requests"] == before["aborted_requests"] + 1)
    wait_until(lambda: server.stats()["running"] == 0)


def test_more_requests_than_slots_wait_and_finish(server, client):
    """With 8 slots, 12 requests: the extra ones queue, then all complete."""
    prompts = [f"Say the number {i}." for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: greedy(client, p, max_tokens=4), prompts))
    assert all(results)
    assert server.stats()["running"] == 0
