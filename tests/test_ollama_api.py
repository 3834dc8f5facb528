"""Ollama's API (/api/...) through Ollama's own Python client against a real
server on the default model: the model list, show and ps; chat and generate,
streamed and whole, answering token for token as the OpenAI routes answer the
same request; tool calls and their results in a conversation; a JSON schema
held; a model loaded by an empty request; errors in Ollama's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def local(server) -> ollama.Client:
    return ollama.Client(host=server.base_url)


def test_models_are_listed_shown_and_running(local, server):
    card = next(m for m in local.list().models if m.model == MODEL)
    assert card.size > 0 and card.details.family == "llama" and card.digest
    shown = local.show(MODEL)
    assert shown.modelinfo["llama.context_length"] == 8192 and "completion" in shown.capabilities
    assert "<|im_start|>" in shown.template  # the chat template, as clients show it
    assert MODEL in [m.model for m in local.ps().models]
    assert httpx.get(server.base_url + "/api/version").json()["version"]


def test_chat_answers_as_the_openai_route_streamed_or_not(local, client):
    whole = local.chat(model=MODEL, messages=ASK, options=GREEDY)
    same = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    assert whole.message.content == same.choices[0].message.content and whole.message.content
    assert (whole.prompt_eval_count, whole.eval_count) == (same.usage.prompt_tokens, same.usage.completion_tokens)
    assert whole.done and whole.done_reason == "length" and whole.total_duration >= whole.eval_duration > 0

    pieces = list(local.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].eval_count == whole.eval_count and pieces[-1].done_reason == "length"


def test_generate_through_the_template_raw_or_with_a_system_prompt(local, client):
    assert local.generate(model=MODEL, prompt=ASK[0]["content"], options=GREEDY).response == \
        local.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    system = "You answer in French."
    assert local.generate(model=MODEL, prompt=ASK[0]["content"], system=system, options=GREEDY).response == \
        local.chat(model=MODEL, messages=[{"role": "system", "content": system}, *ASK], options=GREEDY).message.content
    prompt = "The capital of France is"
    raw = local.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    assert raw.response == client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                     max_tokens=12).choices[0].text
    streamed = "".join(p.response for p in local.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY,
                                                          stream=True))
    assert streamed == raw.response


@pytest.mark.slow  # three constrained answers; the tool machinery's fast tests are in test_tools_api
def test_tool_calls_and_their_results(local, client, server):
    """A conversation with a call and its result (Ollama's: arguments as an object,
    no ids, the result named by its tool) is the prompt the OpenAI route makes of
    the same conversation; a call the model makes comes back as Ollama sends it."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ours = [*ask, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
    # the id tierlm gives a call that Ollama's message leaves without one: call_<message>_<call>
    theirs = [*ask, {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "call_1_0", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "content": "18 C and sunny", "tool_call_id": "call_1_0"}]
    answer = local.chat(model=MODEL, messages=ours, tools=[WEATHER], options=GREEDY)
    same = client.chat.completions.create(model=MODEL, messages=theirs, tools=[WEATHER], temperature=0,
                                          max_tokens=12)
    assert answer.prompt_eval_count == same.usage.prompt_tokens
    assert answer.message.content == (same.choices[0].message.content or "")

    # a call the model is held to (tool_choice, an extension: this small model does not call
    # of itself), whole or streamed: Ollama's shape of the call the OpenAI route makes
    options = {"temperature": 0, "num_predict": 60}
    same = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                          temperature=0, max_tokens=60)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in same.choices[0].message.tool_calls]
    assert expected and expected[0][0] == "get_weather"
    body = {"model": MODEL, "messages": ask, "tools": [WEATHER], "tool_choice": "required", "options": options}
    whole = httpx.post(server.base_url + "/api/chat", json={**body, "stream": False}, timeout=60).json()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == expected
    with httpx.stream("POST", server.base_url + "/api/chat", json=body, timeout=60) as r:
        pieces = [json.loads(line) for line in r.iter_lines() if line]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for piece in pieces for c in piece["message"].get("tool_calls", [])]
    assert calls == expected and pieces[-1]["done"]


def test_a_json_schema_is_held(local):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    reply = local.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_an_empty_request_loads_the_model(local):
    assert local.generate(model=MODEL).done_reason == "load"
    assert local.chat(model=MODEL, messages=[], keep_alive=0).done_reason == "load"  # pinned: it stays


def test_errors_in_ollamas_shape(local, server):
    with pytest.raises(ollama.ResponseError) as e:
        local.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    r = httpx.post(server.base_url + "/api/chat", json={"model": MODEL, "messages": ASK,
                                                         "options": {"temperature": "hot"}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]
    r = httpx.post(server.base_url + "/api/generate", json={"model": MODEL, "prompt": "hi", "images": ["aGk="]})
    assert r.status_code == 400 and "image" in r.json()["error"]



# bad in a chat's messages or tools; then bad in what chat and generate share
NASTY_CHAT = [
    {"messages": "hi"},
    {"messages": ["hi"]},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": 7}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
    {"messages": [{"role": "assistant", "tool_calls": "f"}]},
    {"messages": ASK, "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "hi \ud800"}]},  # a lone surrogate
    {"messages": [{"role": "assistant", "content": "", "thinking": 5}, *ASK]},
    {"messages": ASK, "tool_choice": "sometimes"},
]
NASTY_BOTH = [
    {"format": "xml"},
    {"format": {"type": "object", "properties": 5}},
    {"options": "hot"},
    {"options": {"num_predict": "many"}},
    {"options": {"top_p": 7}},
    {"options": {"temperature": float("nan")}},
    {"options": {"seed": 2**64}},
    {"options": {"num_predict": 10**400}},
    {"options": {"stop": [7]}},
    {"stream": "maybe"},
    {"keep_alive": "soon"},
    {"think": {"effort": 1}},
    {"model": ""},
    {"model": None},
]


@pytest.mark.parametrize("path,body", [("/api/chat", b) for b in NASTY_CHAT] +
                         [(p, b) for b in NASTY_BOTH for p in ("/api/chat", "/api/generate")],
                         ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:50])
def test_a_bad_body_is_a_400_in_ollamas_shape(server, path, body):
    good = {"model": MODEL, "messages": ASK, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    r = httpx.post(server.base_url + path, content=json.dumps({**good, **body}),
                   headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert isinstance(r.json().get("error"), str), r.text
    after = httpx.post(server.base_url + path, json=good, timeout=60)  # and the next request is answered
    assert after.status_code == 200 and after.json()["done"], after.text
