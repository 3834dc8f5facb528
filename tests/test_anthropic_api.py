"""The Anthropic Messages API through the official `anthropic` client against a
real server on the default model (SmolLM2: its template knows no tools, so the
generic tool format is used and `any` / named tools are enforced by grammar)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pydantic
import pytest
from conftest import MODEL_DIR, start_server, stop_server
from tool_testing import TIME, WEATHER

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
# a schema as Claude Code writes some: keywords the grammar engine does not implement
TAGGED = {"name": "tag", "description": "Tag the task.", "input_schema": {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
    "properties": {"tags": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}},
    "required": ["tags"], "additionalProperties": False}}
# a long system prompt: the second request reads most of it from the prefix cache
LONG_SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(120))


@pytest.fixture(scope="module")
def anthropic_server(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    (root / "models").mkdir()
    (root / "models" / "smol-copy").symlink_to(model_path)  # a second model, never loaded but by name
    config = root / "settings.toml"
    config.write_text(f'[models."{MODEL}"]\naliases = ["claude-*"]\n')
    srv = start_server(model_path, root / "server.log", "--model-dir", str(root / "models"),
                       "--config", str(config), "--api-key", KEY, "--sse-keepalive-s", "0.2")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def claude(anthropic_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=anthropic_server.base_url, api_key=KEY, max_retries=0)


def ask(claude, messages=ASK, **kw):
    """Greedy: the SDK no longer names the sampling fields, the API still takes them."""
    kw.setdefault("max_tokens", 40)
    return claude.messages.create(model=MODEL, messages=messages, extra_body={"temperature": 0}, **kw)


def raw_events(srv, body: dict, key: str = KEY) -> list[tuple[str, dict | None]]:
    """(event name, data) of a streamed message, pings and all, as sent."""
    events, name = [], None
    with httpx.stream("POST", srv.base_url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": key}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_a_message_in_anthropics_shape(claude):
    message = ask(claude)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0


def test_streaming_gives_the_same_message_event_by_event(claude, anthropic_server):
    whole = ask(claude, max_tokens=30)
    with claude.messages.stream(model=MODEL, messages=ASK, max_tokens=30, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason and streamed.usage.output_tokens == whole.usage.output_tokens

    events = [name for name, _ in raw_events(anthropic_server, {"model": MODEL, "messages": ASK,
                                                                 "max_tokens": 30, "temperature": 0})]
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_system_as_text_or_blocks_and_system_messages_give_one_prompt(claude):
    def count(**kw):
        return claude.messages.count_tokens(model=MODEL, **kw).input_tokens

    as_text = count(system="You are terse.", messages=ASK)
    assert count(system=[{"type": "text", "text": "You are terse."}], messages=ASK) == as_text
    assert count(messages=[{"role": "system", "content": "You are terse."}, *ASK]) == as_text
    assert count(system="You are terse, and kind.", messages=ASK) > as_text
    # a billing header that changes on every request is left out of the prompt
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.a1f; cc_entrypoint=cli;"}
    assert count(system=[header, {"type": "text", "text": "You are terse."}], messages=ASK) == as_text


def test_turns_of_one_role_in_a_row_are_joined(claude):
    """As an agent sends them after retrying a cut answer: one prompt, the same as
    the turns joined (some templates refuse roles that do not alternate)."""
    def count(messages):
        return claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    halves = [*ASK, {"role": "assistant", "content": "It is sunny"}, {"role": "assistant", "content": " and warm."},
              {"role": "user", "content": "Thanks."}, {"role": "user", "content": "Bye."}]
    whole = [*ASK, {"role": "assistant", "content": "It is sunny and warm."},
             {"role": "user", "content": "Thanks.\n\nBye."}]
    assert count(halves) == count(whole)


@pytest.mark.slow  # a long system prompt's prefill and a second model's folder (~6 s)
def test_count_tokens_is_the_true_count_and_loads_no_model(claude, anthropic_server):
    message = ask(claude, system=LONG_SYSTEM, tools=TOOLS, max_tokens=5)
    counted = claude.messages.count_tokens(model=MODEL, system=LONG_SYSTEM, messages=ASK, tools=TOOLS)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

    other = claude.messages.count_tokens(model="smol-copy", messages=ASK)
    assert other.input_tokens == claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    listed = httpx.get(anthropic_server.v1 + "/models", headers={"x-api-key": KEY}).json()["data"]
    assert next(m for m in listed if m["id"] == "smol-copy")["state"] == "available"  # still not loaded


@pytest.mark.slow  # two long turns; the cache is in test_prefix_cache_api
def test_the_second_turn_reads_the_first_from_the_cache(claude):
    first = ask(claude, system=LONG_SYSTEM, max_tokens=8)
    history = [*ASK, {"role": "assistant", "content": first.content[0].text},
               {"role": "user", "content": "And tomorrow?"}]
    second = ask(claude, system=LONG_SYSTEM, messages=history, max_tokens=8)
    assert second.usage.cache_read_input_tokens >= 256
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens


def test_any_tool_is_called_streamed_as_it_is_generated_and_answered(claude, anthropic_server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0, "tools": TOOLS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    events = [(n, d) for n, d in raw_events(anthropic_server, body) if n != "ping"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    pieces = [d["delta"]["partial_json"] for n, d in events
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert starts and starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    assert len(pieces) > 1, "the arguments arrive as they are generated, not whole"
    call_input = json.loads("".join(pieces))
    jsonschema.validate(call_input, next(t["input_schema"] for t in TOOLS if t["name"] == starts[-1]["name"]))
    assert next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"] == "tool_use"

    message = ask(claude, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  max_tokens=80)
    assert message.stop_reason == "tool_use"
    call = next(b for b in message.content if b.type == "tool_use")
    assert call.name == starts[-1]["name"] and call.input == call_input and call.id
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 degrees."}]}]}]
    answer = ask(claude, messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=30)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_a_tool_whose_schema_the_grammar_engine_half_knows_is_still_called(claude):
    """Keywords llguidance does not implement (propertyNames) are left out of the
    grammar, not a 400: agents' tool schemas use them."""
    message = ask(claude, tools=[TAGGED], tool_choice={"type": "tool", "name": "tag"}, max_tokens=40)
    call = next(b for b in message.content if b.type == "tool_use")  # (its open object may run to max_tokens)
    assert call.name == "tag" and message.stop_reason in ("tool_use", "max_tokens"), message


def test_a_named_tool_is_the_one_called(claude):
    message = ask(claude, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}, max_tokens=60)
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls and all(c.name == "get_time" for c in calls)
    jsonschema.validate(calls[0].input, TIME["function"]["parameters"])


def test_stop_sequences_end_the_text_and_are_named(claude):
    text = ask(claude, max_tokens=30).content[0].text
    stop = text.split()[3]
    message = ask(claude, max_tokens=30, stop_sequences=["unseen-stop", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and text.startswith(message.content[0].text)


def test_output_config_format_gives_json_of_the_schema(claude):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        sunny: bool

    message = claude.messages.parse(model=MODEL, messages=ASK, max_tokens=60, output_format=City,
                                    extra_body={"temperature": 0})
    assert isinstance(message.parsed_output, City)


def test_max_tokens_is_a_ceiling_cut_to_the_context(claude):
    """Agents send max_tokens 32000 whatever the model: the answer may use what
    the context leaves (SmolLM2: 8192 tokens)."""
    with claude.messages.stream(model=MODEL, messages=ASK, max_tokens=32000, stop_sequences=["."],
                                extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().stop_reason in ("stop_sequence", "end_turn")


def test_thinking_settings_are_taken(claude):
    """SmolLM2 does not think: the settings are accepted and the answer is text
    (thinking blocks themselves: tests/test_reasoning_api.py)."""
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}):
        message = ask(claude, thinking=thinking, max_tokens=5)
        assert [b.type for b in message.content] == ["text"]


def test_agents_fields_and_blocks_from_the_future_are_ignored(anthropic_server):
    body = {"model": "claude-sonnet-9-9", "max_tokens": 5, "temperature": 0,
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "u1"}, "a_field_from_2030": [1],
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}, TAGGED],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "hologram", "data": "?"}]}]}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        response = httpx.post(anthropic_server.base_url + "/v1/messages?beta=true", json=body, headers=headers,
                              timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == MODEL  # claude-* is an alias of this model here


@pytest.mark.parametrize("body, status, kind, where", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"messages": ASK, "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope"),
    ({"messages": ASK, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": "lots"}}, 400,
     "invalid_request_error", "budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}],
      "max_tokens": 5}, 400, "invalid_request_error", "image"),
    ({"messages": ASK, "max_tokens": 5, "model": "gpt-nothing"}, 404, "not_found_error", MODEL),
    ({"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 5}, 400, "invalid_request_error",
     "prompt is too long"),
])
def test_errors_in_anthropics_shape(claude, body, status, kind, where):
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.post("/v1/messages", body={"model": MODEL, **body}, cast_to=object)
    error = caught.value
    assert error.status_code == status
    assert error.body["type"] == "error" and error.body["error"]["type"] == kind
    assert where in error.body["error"]["message"], error.body


def test_a_prompt_past_the_context_says_so_as_claude_code_reads_it(claude):
    """Claude Code takes the prompt's length and the limit out of this message
    (its own pattern, below) and compacts the conversation to fit."""
    messages = [{"role": "user", "content": "word " * 9000}]
    length = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, messages=messages, max_tokens=5)
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", caught.value.body["error"]["message"])
    assert found and (int(found[1]), int(found[2])) == (length, 8192 - 1)  # SmolLM2: 8192 tokens of context


def test_a_wrong_key_is_refused_in_anthropics_shape(anthropic_server):
    for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}):
        response = httpx.post(anthropic_server.base_url + "/v1/messages", headers=headers, timeout=30,
                              json={"model": MODEL, "messages": ASK, "max_tokens": 5})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.slow  # grammars of a large tool set
def test_claude_codes_whole_tool_set_compiles():
    """The 25 tools Claude Code 2.1.197 sends (recorded), through the same path as
    a request: read, then held to a grammar for auto, any and a named tool."""
    from mlx_lm.tokenizer_utils import load

    from tierlm.api.anthropic.turns import read_tool_choice, read_tools
    from tierlm.models.default_model import ensure_default_model
    from tierlm.structured.turn import ModelTurns, TurnSpec

    recorded = json.loads((Path(__file__).parent / "data" / "claude_code_tools.json").read_text())
    tools = read_tools(recorded["tools"])
    assert len(tools) == 25
    tokenizer = load(ensure_default_model(MODEL_DIR))
    turns = ModelTurns(tokenizer)
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "TaskCreate"}):
        run = turns.start(TurnSpec(tools=tools, tool_choice=read_tool_choice(choice, True)), tokenizer.encode("Hi"))
        assert run.constraint is not None
