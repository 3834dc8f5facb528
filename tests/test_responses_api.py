"""The OpenAI Responses API (POST /v1/responses, what Codex CLI speaks) through
the official `openai` client against the suite's real server on SmolLM2: text,
the stream's events, function calls and their round trip, previous_response_id
and its prefix-cache hit, text.format, lenience towards fields and items it does
not know, a request Codex CLI sent, and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from tool_testing import TIME, WEATHER, schema_of

from tierlm.api.responses.routes import Answer
from tierlm.api.responses.schemas import ResponsesRequest
from tierlm.api.responses.store import ResponseStore
from tierlm.api.responses.stream import StreamWriter
from tierlm.api.responses.turns import chat_messages, output_items, read_tools
from tierlm.structured.events import Gathered, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart

MODEL = "SmolLM2-135M-Instruct"
ASK_WEATHER = "What is the weather like in Paris today?"
# a request Codex CLI 0.171 sent (model renamed below): developer messages of
# input_text parts, namespace and web_search tools, store false, include, ...
CODEX = json.loads((Path(__file__).parent / "data" / "codex_request.json").read_text())


def flat(tool: dict) -> dict:
    """A chat-shaped tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"], "strict": True}


def respond(client, input=ASK_WEATHER, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    return client.responses.create(model=MODEL, input=input, **kw)


def events_of(client, input=ASK_WEATHER, **kw) -> list:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    return list(client.responses.create(model=MODEL, input=input, stream=True, **kw))


def raw_events(server, body: dict) -> tuple[list[dict], list[str]]:
    """(events, SSE comment lines) of a streamed request sent as it is."""
    events, comments = [], []
    with httpx.stream("POST", server.v1 + "/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            elif line.startswith(":"):
                comments.append(line)
    return events, comments


# ---- text -------------------------------------------------------------------------


def test_plain_text(client):
    r = respond(client, "What is the capital of France?", instructions="Answer in one short sentence.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == MODEL and r.instructions == "Answer in one short sentence."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert "Paris" in r.output_text
    u = r.usage
    assert u.input_tokens > 10 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0


def test_stream_events_in_order_and_numbered(client):
    whole = respond(client, "Write a short story about a robot.", max_output_tokens=12)
    events = events_of(client, "Write a short story about a robot.", max_output_tokens=12)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0
               for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.status == whole.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 12
    assert final.output[0].id == item_id and final.id == events[0].response.id


def test_the_sdk_stream_helper_gets_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts) != ""


# ---- function calls ---------------------------------------------------------------


def test_required_function_call_round_trip(client):
    tools = [flat(WEATHER), flat(TIME)]
    # room for the call as the model lays it out (indented, one key a line)
    first = respond(client, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    history = [{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = respond(client, history, tools=tools, tool_choice="none", max_output_tokens=24)
    assert final.output_text and not any(item.type == "function_call" for item in final.output)


def test_a_named_function_streams_its_arguments(client):
    whole = respond(client, tools=[flat(WEATHER), flat(TIME)], parallel_tool_calls=False,
                    tool_choice={"type": "function", "name": "get_time"})
    events = events_of(client, tools=[flat(WEATHER), flat(TIME)], parallel_tool_calls=False,
                       tool_choice={"type": "function", "name": "get_time"})
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_time" and added.item.arguments == ""
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 2 and "".join(pieces) == done.arguments
    [call] = events[-1].response.output
    assert call.arguments == done.arguments == whole.output[0].arguments
    jsonschema.validate(json.loads(call.arguments), schema_of("get_time"))
    assert [e.type for e in events][-3:] == ["response.function_call_arguments.done",
                                             "response.output_item.done", "response.completed"]


# ---- previous_response_id and the store --------------------------------------------

FACTS = " ".join(f"Fact {i}: the island of Vell{i} exports {i * 3} tons of salt each year." for i in range(40))


def test_previous_response_id_continues_the_conversation_from_the_cache(client, server):
    first = respond(client, FACTS + "\n\nWhich island exports the most salt?", max_output_tokens=8)
    assert first.usage.input_tokens > 600
    second = respond(client, "And the least?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the earlier turns come from the store, and their blocks from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 256
    # kept: GET answers it, DELETE forgets it
    assert httpx.get(f"{server.v1}/responses/{first.id}").json()["output"] == \
        [item.model_dump(exclude_none=True) for item in first.output]
    assert httpx.delete(f"{server.v1}/responses/{first.id}").json()["deleted"] is True
    assert httpx.get(f"{server.v1}/responses/{first.id}").status_code == 404


def test_store_false_keeps_nothing(client):
    first = respond(client, "Hello!", store=False, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, "Again", previous_response_id=first.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and first.id in e.value.body["message"]


# ---- text.format ---------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_format_gives_valid_json(client, stream):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    if stream:
        text = events_of(client, "Describe Paris.", text=fmt, max_output_tokens=60)[-1].response.output_text
    else:
        text = respond(client, "Describe Paris.", text=fmt, max_output_tokens=60).output_text
    jsonschema.validate(json.loads(text), SCHEMA)


# ---- lenience ----------------------------------------------------------------------


def test_unknown_fields_items_parts_and_tools_are_ignored(client):
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "item_reference", "id": "msg_old"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What is the capital of France?"}, {"type": "sparkle"}]},
    ]
    r = respond(client, items, tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}],
                reasoning={"effort": "minimal", "summary": "auto"}, metadata={"k": "v"}, max_output_tokens=16,
                extra_body={"prompt_cache_key": "x", "client_metadata": {"a": 1}, "brand_new_field": [1, 2]},
                include=["reasoning.encrypted_content"])
    assert "Paris" in r.output_text and r.metadata == {"k": "v"}


def trimmed_codex(**changes) -> dict:
    """The Codex request cut to fit SmolLM2's context and the suite's time: its
    texts shortened, one tool of each kind kept (a function, a namespace of one,
    a hosted one)."""
    body = json.loads(json.dumps(CODEX))
    for item in body["input"]:
        for part in item["content"]:
            part["text"] = part["text"][:1200]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    namespace["tools"] = namespace["tools"][:1]
    body["tools"] = [body["tools"][0], namespace, next(t for t in body["tools"] if t["type"] == "web_search")]
    return {**body, "model": MODEL, "max_output_tokens": 8, **changes}


def test_the_codex_request_longer_than_the_context_is_a_clean_400(server):
    r = httpx.post(server.v1 + "/responses", json={**CODEX, "model": MODEL}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    numbers = [int(n) for n in re.findall(r"\d+", error["message"])]
    assert numbers[0] == 8192 and numbers[1] > 8192, error  # the context, then the prompt


def test_the_codex_request_is_answered_as_codex_reads_it(server):
    events, _ = raw_events(server, trimmed_codex())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert final["store"] is False and final["output"] and final["usage"]["input_tokens"] > 1000
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]


def test_a_namespaced_function_is_called_by_its_own_name(server):
    """Codex groups tools in namespaces: their functions are offered by their own
    names, and a call names its namespace again, as OpenAI's do."""
    body = trimmed_codex(stream=False, max_output_tokens=40, temperature=0, parallel_tool_calls=False,
                         tool_choice={"type": "function", "name": "close_agent"})
    body["input"][-1]["content"][0]["text"] = "Close agent 7."
    r = httpx.post(server.v1 + "/responses", json=body, timeout=60).json()
    [call] = r["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
    assert "target" in json.loads(call["arguments"])
    assert r["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the Codex prompt's head, as above


# ---- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "sometimes", "tools": [flat(WEATHER)]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [flat(WEATHER)]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tools": [flat(WEATHER), flat(WEATHER)]}, "tools[1].name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1]"),
    ({"input": [{"type": "function_call_output", "output": "21"}]}, "input[0].call_id"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"previous_response_id": "resp_never"}, "previous_response_id"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 9000}, "max_output_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.status_code == 400


def test_an_unknown_model_is_a_404_naming_the_models(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5-codex", input="hi")
    assert e.value.body["param"] == "model" and MODEL in e.value.body["message"]


# ---- without a server: the stream's shape, a failure mid-stream, the store ----------------
# (the model's side replaced only where a real one cannot be made to do it: SmolLM2
# has no thinking markers, and a generation failure cannot be caused from outside)


def sse_payloads(chunks: list[str]) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks if "data: " in c]


def answer_of(**body) -> Answer:
    return Answer("resp_1", MODEL, ResponsesRequest(**body), read_tools(body.get("tools")), 0)


def test_streamed_events_are_the_sdks_own_and_agree_with_the_whole_answer():
    def function(name):
        return {"type": "function", "name": name, "parameters": {"type": "object"}, "strict": False}

    namespace = {"type": "namespace", "name": "ns", "description": "More tools.", "tools": [function("g")]}
    answer = answer_of(input="hi", tools=[function("f"), namespace])
    turn = [ReasoningDelta("Let me"), ReasoningDelta(" think."), TextDelta("Calling"), TextDelta(" now."),
            ToolCallStart(0, "call_1", "f"), ToolCallArgs(0, '{"a":'), ToolCallArgs(0, " 1}"),
            ToolCallStart(1, "call_2", "g"), ToolCallArgs(1, "{}")]
    writer = StreamWriter(answer.tools)
    chunks = [writer.event("response.created", response=answer.response("in_progress", []))]
    chunks += writer.feed(turn) + writer.finish("completed")
    chunks.append(writer.event("response.completed", response=answer.response("completed", writer.items)))
    state = ResponseStreamState(input_tools=openai.NOT_GIVEN, text_format=openai.NOT_GIVEN)
    seen = [state.handle_event(TypeAdapter(ResponseStreamEvent).validate_python(payload))  # the SDK's types
            for payload in sse_payloads(chunks)]
    assert seen[-1][0].response.output_text == "Calling now."
    kinds = [p["type"] for p in sse_payloads(chunks)]
    assert kinds.count("response.reasoning_text.delta") == 2 and kinds.count("response.output_item.done") == 4

    def shape(items):
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    whole = output_items(Gathered().add(turn), answer.tools, "completed")
    assert shape(writer.items) == shape(whole)
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert "namespace" not in whole[2] and whole[3]["namespace"] == "ns"


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for n in (1, 2):
        store.put({"id": f"r{n}", "output": [{"n": n}]}, [{"in": n}])
    assert store.get("r1").items == [{"in": 1}, {"n": 1}]  # r1 used: r2 is the oldest now
    store.put({"id": "r3", "output": []}, [])
    assert store.get("r2") is None and store.get("r1") and store.get("r3") and len(store) == 2
    empty = ResponseStore(0)
    empty.put({"id": "r1", "output": []}, [])
    assert empty.get("r1") is None


def test_turns_are_joined_as_strict_templates_want_them():
    """Gemma's template wants user and assistant to alternate; Codex sends two
    developer messages, then two user messages, and developer messages later on."""
    later = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox changed."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now?"}]},
    ]
    messages = chat_messages("Be brief.", [], CODEX["input"] + later)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou are a coding agent")
    assert messages[1]["content"].endswith("</environment_context>\n\nSay hello")
    assert messages[2]["content"] == "Looking." and messages[2]["tool_calls"][0]["function"]["name"] == "exec_command"
    assert messages[4]["content"] == "Sandbox changed.\n\nNow?"
