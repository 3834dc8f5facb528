"""The OpenAI chat and text completion routes, through the official client."""

from __future__ import annotations

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, **kw)


def stream_text(client, messages, **kw):
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                 stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_capital_of_france(client, tokenizer):
    response = chat(client, FRANCE, max_tokens=20)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    expected_prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(expected_prompt)
    completion = tokenizer.encode(choice.message.content)
    # the end-of-turn token is counted, never shown
    assert response.usage.completion_tokens == len(completion) + 1
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_stream_equals_non_stream(client):
    full = chat(client, STORY, max_tokens=24)
    text, chunks = stream_text(client, STORY, max_tokens=24, stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    assert len(text) > 40
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 24 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    _, chunks = stream_text(client, FRANCE, max_tokens=4)
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_max_tokens_stops_at_length(client):
    response = chat(client, STORY, max_tokens=5)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


def test_max_completion_tokens_is_honoured(client):
    response = chat(client, STORY, max_completion_tokens=3)
    assert response.usage.completion_tokens == 3


def test_stop_string_is_removed_and_ends_the_request(client):
    full = chat(client, STORY, max_tokens=30).choices[0].message.content
    words = full.split()
    stop = " ".join(words[3:5])  # a two-word stop string, likely spanning tokens
    expected = full[: full.index(stop)]
    response = chat(client, STORY, max_tokens=30, stop=[stop])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    text, _ = stream_text(client, STORY, max_tokens=30, stop=stop)
    assert text == expected


def test_seeded_sampling_is_reproducible(client):
    a = chat(client, STORY, max_tokens=12, temperature=0.9, seed=1234).choices[0].message.content
    b = chat(client, STORY, max_tokens=12, temperature=0.9, seed=1234).choices[0].message.content
    assert a == b


def test_text_completion(client):
    response = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                         max_tokens=6, temperature=0)
    assert response.object == "text_completion"
    assert response.choices[0].text.startswith(" Paris")  # the first token's space is kept
    assert response.usage.completion_tokens <= 6
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                       max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + response.choices[0].text


def test_text_completion_stream_and_token_prompt(client, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"


def test_default_alias_and_missing_model_field(server):
    import httpx

    body = {"messages": FRANCE, "max_tokens": 2, "temperature": 0}
    assert httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).status_code == 200
    body["model"] = "default"
    assert httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).status_code == 200
