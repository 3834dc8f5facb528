"""Tool calls through the official `openai` client against a real server on
the default model (SmolLM2: its template knows no tools, so the generic format
is used, and `required` / named calls are enforced by the grammar)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_testing import ASK, TIME, WEATHER, schema_of

MODEL = "SmolLM2-135M-Instruct"


def chat(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def streamed(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))


def test_parallel_calls_in_one_turn(client):
    choice = chat(client, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120).choices[0]
    calls = choice.message.tool_calls
    assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls)
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut at length
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_required_tool_round_trip(client):
    first = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    assert "<tool_call>" not in (choice.message.content or "")
    call = choice.message.tool_calls[0]
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = chat(client, history, tools=[WEATHER, TIME], tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_named_tool_is_the_one_called(client):
    choice = chat(client, tools=[WEATHER, TIME], parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema_of("get_time"))
    assert choice.finish_reason == "tool_calls"


def test_streamed_tool_call_deltas_reassemble_into_the_call(client):
    whole = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0].message
    chunks = streamed(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    pieces = 0
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert call["id"] is None and call["arguments"] == "", "id and name come first, once"
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
            pieces += 1
        assert not (chunk.choices[0].delta.content or "").strip(), "no call text reaches content"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert pieces > 3, "the arguments stream in pieces, not as one block"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_never_calls(client):
    for messages in (ASK, [{"role": "user", "content": "Call get_weather for Rome now."}]):
        choice = chat(client, messages, tools=[WEATHER], tool_choice="none", max_tokens=24).choices[0]
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        chunks = streamed(client, messages, tools=[WEATHER], tool_choice="none", max_tokens=24)
        assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_auto_leaves_text_free(client):
    choice = chat(client, [{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=20).choices[0]
    if choice.message.tool_calls:  # a call it chose to make is well formed
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema_of("get_weather"))
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([], "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "(?<=x)"}}}],
     "required", "tools[0].function.parameters"),
])
def test_bad_tools_are_a_400_naming_the_field(client, tools, choice, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=tools or None, tool_choice=choice)
    assert e.value.body["param"] == param, e.value.body


def test_changing_tool_choice_keeps_the_conversations_cached_prefix(client):
    """An agent that sends tool_choice "none" or "required" on one turn: the tools
    are listed in the same words, so the long conversation after them is read
    from the cache. (Before, "none" left them out and "required" worded them
    otherwise: every token after the first ~200 was computed again.)"""
    long_question = "Here is my trip plan: " + "Paris, then Lyon, then Nice, then Marseille. " * 40
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": long_question}]
    first = chat(client, messages, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=1)
    assert first.usage.prompt_tokens >= 600
    for choice in ("none", "required"):
        again = chat(client, messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=1)
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= 512, choice
