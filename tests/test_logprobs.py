"""logprobs / top_logprobs on chat and text completions, streamed and not, in
OpenAI's shape, through the official client; the values are the model's own
log-softmax (checked against mlx-lm running the same weights in this process)."""

from __future__ import annotations

import threading

import httpx
import mlx.core as mx
import openai
import pytest

from tierlm.engine.detokenizer import byte_level_table

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
PROMPT = "The capital of France is"
# The served values come from one token at a time, in a batch, with a KV cache; the
# references from one float32 forward pass over the whole sequence.
# - Against the model as tierlm loads it (the same weights, the same backend's
#   arithmetic), only the order of the sums differs:
SAME_ARITHMETIC = 2e-3
# - Against plain mlx-lm (4-bit products in float) the backend's arithmetic differs
#   too: on MLX's CPU backend tierlm multiplies SmolLM2's 4-bit weights with int8
#   activations, as llama.cpp does (tierlm/backends/cpu/quantized.py), which moves
#   logprobs by up to ~0.17 on this prompt (0.054 on average, 0.36 at most over a
#   longer text: test_quantized_kernels.py; this small model feels it most); on
#   Metal/CUDA by the float16 rounding, ~1e-2. The exact check is the one above.
PLAIN_MLX_LM = 0.4


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def chat_stream(client, messages, **kw):
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content or []]
    return text, entries, chunks


def complete(client, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=PROMPT, **kw)


def entries_hidden_stop(response) -> int:
    """The stop token that ends a request unseen (EOS) has no entry."""
    return 1 if response.choices[0].finish_reason == "stop" else 0


def assert_same_entries(a, b, tol=1e-3):
    assert [e.token for e in a] == [e.token for e in b]
    assert [e.bytes for e in a] == [e.bytes for e in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=tol)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]


@pytest.fixture(scope="module")
def reference(model_path, loaded):
    """The weights through plain mlx-lm, the model as tierlm loads it (the `loaded`
    fixture), the tokenizer, and token bytes -> id."""
    import mlx_lm

    plain, tokenizer = mlx_lm.load(str(model_path))
    ids = {}
    for i, data in enumerate(byte_level_table(tokenizer.detokenizer)):
        ids.setdefault(data, i)
    return plain, loaded[0], tokenizer, ids


def reference_logprobs(model, tokens: list[int]) -> mx.array:
    """log-softmax over the vocabulary after each position, float32."""
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# ---- chat ---------------------------------------------------------------


def test_chat_shape_counts_and_order(client):
    response = chat(client, FRANCE, max_tokens=20, logprobs=True, top_logprobs=5)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason == "stop"  # at the end-of-turn token, which is counted, not shown
    assert len(content) == response.usage.completion_tokens - 1
    assert len(content) >= 3
    text = b"".join(bytes(e.bytes) for e in content).decode()
    assert text.removeprefix(" ") == choice.message.content
    for e in content:
        assert e.bytes == list(e.token.encode())  # SmolLM2's answer here is whole characters
        assert len(e.top_logprobs) == 5
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[0].bytes == e.bytes


def test_chat_logprobs_without_top_logprobs(client):
    response = chat(client, FRANCE, max_tokens=6, logprobs=True)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens - entries_hidden_stop(response)
    assert all(e.top_logprobs == [] for e in content)


def test_chat_without_logprobs_has_none(client):
    assert chat(client, FRANCE, max_tokens=4).choices[0].logprobs is None
    _, entries, chunks = chat_stream(client, FRANCE, max_tokens=4)
    assert entries == [] and all(c.choices[0].logprobs is None for c in chunks if c.choices)


@pytest.mark.slow  # one more streamed-vs-whole comparison
def test_chat_stream_equals_non_stream(client):
    full = chat(client, STORY, max_tokens=24, logprobs=True, top_logprobs=3)
    text, entries, chunks = chat_stream(client, STORY, max_tokens=24, logprobs=True, top_logprobs=3,
                                        stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    assert len(entries) == chunks[-1].usage.completion_tokens == 24
    assert_same_entries(entries, full.choices[0].logprobs.content)
    for c in chunks:  # every chunk with text carries the entries of its tokens
        if c.choices and c.choices[0].delta.content:
            pieces = c.choices[0].logprobs.content
            assert pieces
            assert b"".join(bytes(e.bytes) for e in pieces).decode().strip() == \
                c.choices[0].delta.content.strip()


@pytest.mark.slow  # one more streamed-vs-whole comparison
def test_stop_string_stream_equals_non_stream(client):
    """Tokens held back as a possible stop string still get their entries (in the
    final chunk when no text follows them), as in the whole response."""
    words = chat(client, STORY, max_tokens=30).choices[0].message.content.split()
    stop = " ".join(words[3:5])
    full = chat(client, STORY, max_tokens=30, stop=[stop], logprobs=True, top_logprobs=2)
    text, entries, _ = chat_stream(client, STORY, max_tokens=30, stop=[stop], logprobs=True, top_logprobs=2)
    assert text == full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    content = full.choices[0].logprobs.content
    # the stop string's tokens are generated, counted and scored; only their text is cut
    assert len(content) == full.usage.completion_tokens
    assert stop in b"".join(bytes(e.bytes) for e in content).decode()
    assert_same_entries(entries, content)


def test_chat_logprobs_match_the_model(client, reference):
    plain, same, tokenizer, ids = reference
    response = chat(client, STORY, max_tokens=16, logprobs=True, top_logprobs=4)
    content = response.choices[0].logprobs.content
    prompt = tokenizer.apply_chat_template(STORY, add_generation_prompt=True)
    generated = [ids[bytes(e.bytes)] for e in content]
    assert len(generated) == 16
    for model, tolerance in ((same, SAME_ARITHMETIC), (plain, PLAIN_MLX_LM)):
        expected = reference_logprobs(model, prompt + generated)
        for i, (token, e) in enumerate(zip(generated, content)):
            row = expected[len(prompt) - 1 + i]
            assert e.logprob == pytest.approx(row[token].item(), abs=tolerance)
            if model is same:  # greedy: near ties may order differently in other arithmetic
                assert int(mx.argmax(row).item()) == token
                top = sorted(row.tolist(), reverse=True)[:4]
                assert [t.logprob for t in e.top_logprobs] == pytest.approx(top, abs=tolerance)


def test_logprobs_are_after_logit_bias(client, reference):
    """Documented choice: the distribution after logit_bias (and penalties, grammar
    masks), before temperature and top_p/top_k, as vLLM's processed logprobs."""
    ids = reference[-1]
    forced = ids[b" banana"]
    response = chat(client, FRANCE, max_tokens=2, logprobs=True, top_logprobs=2,
                    logit_bias={str(forced): 100}, temperature=0.7, seed=1)
    first = response.choices[0].logprobs.content[0]
    assert first.token == " banana"
    assert first.logprob == pytest.approx(0.0, abs=1e-3)


# ---- text completions -----------------------------------------------------


def test_completion_shape_and_offsets(client):
    response = complete(client, max_tokens=8, logprobs=3)
    choice = response.choices[0]
    lp = choice.logprobs
    n = response.usage.completion_tokens - entries_hidden_stop(response)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text  # text keeps its leading space
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == logprob
        assert len(top) in (3, 4)  # the 3 most likely, and the chosen one if it is not among them
        assert max(top.values()) == logprob  # greedy
        assert logprob <= 0


def test_completion_stream_equals_non_stream(client):
    full = complete(client, max_tokens=12, logprobs=2).choices[0].logprobs
    chunks = list(complete(client, max_tokens=12, logprobs=2, stream=True))
    tokens, values, offsets, tops = [], [], [], []
    for c in chunks:
        lp = c.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
            offsets += lp.text_offset
            tops += lp.top_logprobs
    assert tokens == full.tokens
    assert offsets == full.text_offset
    assert values == pytest.approx(full.token_logprobs, abs=1e-3)
    assert [sorted(t) for t in tops] == [sorted(t) for t in full.top_logprobs]


def test_completion_logprobs_match_the_model(client, reference):
    plain, same, tokenizer, ids = reference
    lp = complete(client, max_tokens=10, logprobs=1).choices[0].logprobs
    prompt = tokenizer.encode(PROMPT)
    generated = [ids[t.encode()] for t in lp.tokens]
    for model, tolerance in ((same, SAME_ARITHMETIC), (plain, PLAIN_MLX_LM)):
        expected = reference_logprobs(model, prompt + generated)
        for i, (token, value) in enumerate(zip(generated, lp.token_logprobs)):
            assert value == pytest.approx(expected[len(prompt) - 1 + i, token].item(), abs=tolerance)


def test_completion_without_logprobs_has_none(client):
    assert complete(client, max_tokens=3).choices[0].logprobs is None


# ---- a batch of requests that ask for different things ------------------------


@pytest.mark.slow  # concurrent requests
def test_concurrent_requests_each_get_their_own(client):
    alone = chat(client, STORY, max_tokens=12, logprobs=True, top_logprobs=7).choices[0].logprobs.content
    results = {}

    def ask(name, **kw):
        results[name] = chat(client, STORY, max_tokens=12, **kw)

    threads = [threading.Thread(target=ask, args=(name,), kwargs=kw) for name, kw in [
        ("seven", {"logprobs": True, "top_logprobs": 7}),
        ("one", {"logprobs": True, "top_logprobs": 1}),
        ("none", {}),
        ("zero", {"logprobs": True}),
    ]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["none"].choices[0].logprobs is None
    assert_same_entries(results["seven"].choices[0].logprobs.content, alone, tol=SAME_ARITHMETIC)
    one = results["one"].choices[0].logprobs.content
    assert [len(e.top_logprobs) for e in one] == [1] * 12
    assert [e.token for e in one] == [e.token for e in alone]
    assert all(e.top_logprobs == [] for e in results["zero"].choices[0].logprobs.content)


# ---- bad values -----------------------------------------------------------------


def error_of(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("n", [21, -1, 10**6])
def test_top_logprobs_out_of_range(client, n):
    error = error_of(lambda: chat(client, FRANCE, max_tokens=2, logprobs=True, top_logprobs=n))
    assert error["param"] == "top_logprobs"
    assert "20" in error["message"]


@pytest.mark.parametrize("kw", [{}, {"logprobs": False}])
def test_top_logprobs_needs_logprobs(client, kw):
    error = error_of(lambda: chat(client, FRANCE, max_tokens=2, top_logprobs=2, **kw))
    assert error["param"] == "top_logprobs"


@pytest.mark.parametrize("n", [21, -1])
def test_completion_logprobs_out_of_range(client, n):
    error = error_of(lambda: complete(client, max_tokens=2, logprobs=n))
    assert error["param"] == "logprobs"


def test_completion_logprobs_up_to_20(client):
    """OpenAI caps the legacy API at 5; tierlm allows 20, as vLLM does."""
    lp = complete(client, max_tokens=2, logprobs=20).choices[0].logprobs
    assert all(len(top) in (20, 21) for top in lp.top_logprobs)


def test_echo_with_logprobs_is_refused(client):
    error = error_of(lambda: complete(client, max_tokens=2, logprobs=1, echo=True))
    assert error["param"] == "echo"


def test_server_still_serves_after_bad_logprobs(server):
    r = httpx.post(server.v1 + "/completions", json={"prompt": PROMPT, "logprobs": 99}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(server.v1 + "/chat/completions", timeout=60,
                   json={"messages": FRANCE, "max_tokens": 2, "logprobs": True, "top_logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"]) >= 1
