"""Tool calls on a model whose chat template knows tools: the default SmolLM2
weights with a Qwen2.5-style template. The tools reach the model through its
template (`ToolFormat.native`), its calls are read in the Hermes format, and the
tool results go back through the template too: the prompt token counts the
server reports equal the tokenizer's own rendering."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from conftest import start_server, stop_server
from tool_testing import ASK, TIME, WEATHER, schema_of

# Qwen2.5's template, in its own words (tools in the system block, calls as
# `<tool_call>` JSON blocks, results as `<tool_response>` blocks in a user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

MODEL = "qwen-template-smol"
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def native_model(model_path, tmp_path_factory) -> Path:
    """The default model's weights (linked, not copied) with the Qwen2.5-style template."""
    folder = tmp_path_factory.mktemp("models") / MODEL
    folder.mkdir()
    for item in model_path.iterdir():
        if item.name != "tokenizer_config.json":
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((model_path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN25_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def native_tokenizer(native_model):
    from mlx_lm.tokenizer_utils import load

    return load(native_model)


@pytest.fixture(scope="module")
def native_server(native_model, tmp_path_factory):
    srv = start_server(
        native_model, tmp_path_factory.mktemp("native-server") / "server.log", "--no-ssd-cache"
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def native_client(native_server):
    return native_server.client()


def chat(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def rendered(tokenizer, messages, tools=None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))


def check_calls(choice, names=None):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    if names is not None:
        assert [c.function.name for c in calls] == names
    assert "<tool_call>" not in (choice.message.content or "")
    assert "</tool_call>" not in (choice.message.content or "")
    return calls


# ---- the template and its format ---------------------------------------------


def test_mlx_lm_infers_json_tools_and_tierlm_reads_hermes(native_tokenizer):
    from tierlm.structured.tool_formats import HERMES, format_for

    assert native_tokenizer.init_kwargs.get("tool_parser_type") == "json_tools"
    assert native_tokenizer.has_tool_calling and native_tokenizer.tool_call_start == "<tool_call>"
    assert format_for(native_tokenizer) is HERMES and HERMES.native


def test_the_template_renders_tools_calls_and_results(native_tokenizer):
    history = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    text = native_tokenizer.apply_chat_template(
        history, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n'
        "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


# ---- served --------------------------------------------------------------------


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_the_prompt_is_the_templates_rendering_with_the_tools(native_client, native_tokenizer):
    with_tools = chat(native_client, tools=TOOLS, tool_choice="auto", max_tokens=1).usage.prompt_tokens
    without = chat(native_client, max_tokens=1).usage.prompt_tokens
    assert with_tools == len(rendered(native_tokenizer, ASK, TOOLS))
    assert without == len(rendered(native_tokenizer, ASK))
    assert with_tools > without + 50
    # no tierlm instructions are added on top of the template's own
    required = chat(native_client, tools=TOOLS, tool_choice="required", max_tokens=1).usage.prompt_tokens
    assert required == with_tools


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_required_calls_are_well_formed(native_client):
    check_calls(
        chat(native_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    )


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_a_named_tool_is_the_one_called(native_client):
    for name in ("get_time", "get_weather"):
        choice = chat(
            native_client,
            tools=TOOLS,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": name}},
        ).choices[0]
        check_calls(choice, [name])


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_round_trip_sends_the_result_back_through_the_template(native_client, native_tokenizer):
    first = chat(
        native_client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    call = check_calls(first.choices[0], ["get_weather"])[0]
    assert first.usage.prompt_tokens == len(rendered(native_tokenizer, ASK, TOOLS))
    result = json.dumps({"temperature": 21, "sky": "clear"})
    history = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    final = chat(native_client, history, tools=TOOLS, tool_choice="none", max_tokens=30)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content

    # what the template should have seen: the call's arguments as an object
    expected = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    # tool_choice "none" still gives the template the tools: the prompt is the one
    # "auto" makes of the same history, so the two share their cached prefix
    assert final.usage.prompt_tokens == len(rendered(native_tokenizer, expected, TOOLS))
    text = native_tokenizer.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert f"<tool_response>\n{result}\n</tool_response>" in text and "<tool_call>\n{" in text
    again = chat(native_client, history, tools=TOOLS, tool_choice="auto", max_tokens=1)
    assert again.usage.prompt_tokens == final.usage.prompt_tokens


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_streamed_deltas_reassemble_into_the_call(native_client):
    kw = {
        "tools": TOOLS,
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    whole = chat(native_client, **kw).choices[0].message
    chunks = list(
        native_client.chat.completions.create(
            model=MODEL, messages=ASK, stream=True, temperature=0, max_tokens=80, **kw
        )
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert "<tool_call>" not in (delta.content or "") and not (delta.content or "").strip()
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None and call["arguments"] == "", "id and name come first, once"
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow  # a server of its own; tool calls are in test_tools_api
def test_auto_answers_text_or_a_well_formed_call(native_client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        choice = chat(native_client, messages, tools=TOOLS, tool_choice="auto", max_tokens=60).choices[0]
        if choice.message.tool_calls:
            check_calls(choice)
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content
