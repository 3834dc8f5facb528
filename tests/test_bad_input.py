"""Bad input gets a 400/404/413 in OpenAI's error shape, never a 5xx, and the
server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def post(server, path, body, **kw):
    return httpx.post(server.v1 + path, timeout=60, **kw, **({"json": body} if body is not None else {}))


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        ({"messages": MSG, "n": 2}, "n"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "top_p": 1.5}, "top_p"),
        ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"5": 500}}, "logit_bias"),
        ({"messages": MSG, "stream": "yes please"}, "stream"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        # values that passed validation and then broke the engine or the handler
        ({"messages": MSG, "temperature": 1, "top_k": 49153}, "top_k"),
        ({"messages": MSG, "top_k": -2}, "top_k"),
        ({"messages": MSG, "temperature": 1, "seed": 2**64}, "seed"),
        ({"messages": MSG, "seed": -(2**63) - 1}, "seed"),
        ({"messages": MSG, "logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"\u2460": 1}}, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"49152": 1}}, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"messages": MSG, "stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"messages": MSG, "stop": ["x"] * 17}, "stop"),
        ({"messages": MSG, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"messages": MSG, "chat_template_kwargs": {"return_tensors": "np"}}, "chat_template_kwargs"),
        ({"messages": MSG, "chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
        ({"messages": MSG, "chat_template": "{{ messages }}"}, "chat_template"),
    ],
)
def test_invalid_chat_bodies(server, body, param):
    assert_openai_error(post(server, "/chat/completions", body), 400, param)


@pytest.mark.parametrize(
    "raw, param",
    [
        ('{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ('{"messages": [{"role": "user", "content": [{"type": "\\udfff", "text": "x"}]}]}',
         "messages.0.content.0.type"),
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        ('{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
        ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    ],
)
def test_text_that_is_not_unicode_and_numbers_that_are_not_finite(server, raw, param):
    """Raw JSON: lone surrogates and NaN/Infinity literals, which Python's parser accepts."""
    r = httpx.post(server.v1 + "/chat/completions", content=raw.encode(),
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param)


def test_a_top_k_of_the_vocabulary_size_means_all_tokens(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, max_tokens=3,
                                       temperature=1, seed=1, extra_body={"top_k": 49152})
    assert r.usage.completion_tokens >= 1


def test_a_negative_seed_is_a_seed(client):
    def ask(seed):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, max_tokens=8,
                                              temperature=1, seed=seed).choices[0].message.content
    assert ask(-1) == ask(-1) == ask(2**64 - 1)  # read as its uint64


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": ["one", "two"]},
        {"prompt": [1, 2, 10**9]},
        {"prompt": "hi", "best_of": 3},
        {"prompt": 42},
        {"prompt": [-1, 5]},
        {"prompt": [2**64, 5]},
        {"prompt": [-1], "echo": True},
        {"prompt": "hi", "seed": -(2**64)},
    ],
)
def test_invalid_completion_bodies(server, body):
    assert_openai_error(post(server, "/completions", body), 400)


def test_malformed_json(server):
    r = httpx.post(server.v1 + "/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    r = httpx.post(server.v1 + "/chat/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_unknown_route_is_404_in_openai_shape(server):
    assert_openai_error(httpx.get(server.v1 + "/nothing-here"), 404)


def test_prompt_longer_than_context(client):
    long_text = "word " * 9000  # ~9000 tokens, context is 8192
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                       messages=[{"role": "user", "content": long_text}])
    message = e.value.body["message"]
    assert "8192" in message
    prompt_tokens = int(message.split("prompt has ")[1].split()[0])
    assert prompt_tokens > 8192


def test_prompt_plus_max_tokens_over_context(client):
    text = "word " * 8000
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=1000,
                                       messages=[{"role": "user", "content": text}])
    assert "8192" in e.value.body["message"] and "1000" in e.value.body["message"]


def test_body_too_large_is_413(server):
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * (33 * 2**20) + b'"}]}'
    r = httpx.post(server.v1 + "/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(r, 413)


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(server.v1 + "/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413)


def test_a_chunked_body_under_the_limit_is_served(server):
    def chunks():
        yield b'{"prompt": "Hello, my name is", '
        yield b'"max_tokens": 3, "temperature": 0}'

    r = httpx.post(server.v1 + "/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_server_still_serves_after_bad_input(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


# ---- a model folder whose tokenizer knows more tokens than its embedding has rows


@pytest.fixture(scope="module")
def small_vocab_server(model_path, tmp_path_factory):
    """A random tiny llama with the default tokenizer (49,152 tokens) and only
    1,000 embedding rows: ids past 999 would read outside the table."""
    import json

    import mlx.core as mx
    from conftest import start_server, stop_server

    from tierlm.models.random_model import make_random_model

    folder = make_random_model("tiny", tmp_path_factory.mktemp("small-vocab") / "model", model_path, "float32")
    weights = mx.load(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:1000]
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    srv = start_server(folder, folder.parent / "server.log", "--no-ssd-cache")
    yield srv
    stop_server(srv)


def test_ids_past_the_embedding_are_refused_not_read(small_vocab_server):
    srv = small_vocab_server
    error = assert_openai_error(post(srv, "/completions", {"prompt": [5, 30000], "max_tokens": 2}), 400, "prompt")
    assert "30000" in error["message"] and "[0, 1000)" in error["message"]
    # text whose tokens fall past the table: the same refusal, for chat too
    assert_openai_error(post(srv, "/chat/completions", {"messages": MSG, "max_tokens": 2}), 400, "messages")
    ok = srv.client().completions.create(model="model", prompt=[5, 6, 999], max_tokens=2, temperature=0)
    assert ok.usage.prompt_tokens == 3
    assert "embedding has 1000 rows" in srv.log()
