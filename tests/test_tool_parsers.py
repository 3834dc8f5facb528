"""Tool-call formats and the streaming tool-call parser, on recorded outputs of each family.

Every output is also fed split in two at each position and one character at a time: the gathered
turn must not depend on how the text arrived."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tierlm.structured.events import Gathered, TextDelta, ToolCallArgs, ToolCallStart
from tierlm.structured.tool_calls import ToolCallParser
from tierlm.structured.tool_formats import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolFormat,
    format_for,
    format_named,
)

FUNCTION_GEMMA = format_named("function_gemma")
PYTHONIC = format_named("pythonic")
QWEN3_CODER = format_named("qwen3_coder")

WEATHER = {"city": "Paris"}
# Arguments with braces, brackets, quotes, escapes, a marker and unicode inside strings.
TRICKY = {
    "path": "src/a.py",
    "content": 'def f():\n    return {"x": [1, 2]}  # </tool_call> ]} \\ done\n',
    "opts": {"mode": [1, {"deep": None}], "ok": True, "n": -2.5e3},
    "city": "Zürich 東京 🌧",
}
TRICKY_JSON = json.dumps(TRICKY, ensure_ascii=False)


def hermes(name: str, args_json: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_json}}}\n</tool_call>'


# (case id, format, model output, expected content, expected calls as (name, arguments))
CASES = [
    ("hermes", HERMES, hermes("get_weather", '{"city": "Paris"}'), "", [("get_weather", WEATHER)]),
    # Qwen2.5(-Coder) writes its calls in a ```json fence, or bare, as often as in <tool_call>
    ("hermes-fenced", HERMES, 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     "Sure.\n", [("get_weather", WEATHER)]),
    ("hermes-bare", HERMES, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [("get_weather", WEATHER)]),
    ("hermes-code-fences-stay-text", HERMES, 'Run:\n```python\nprint(1)\n```\nor ```json\n{"version": 1}\n```',
     'Run:\n```python\nprint(1)\n```\nor ```json\n{"version": 1}\n```', []),
    (
        "hermes-text-two-calls",
        HERMES,
        "I'll check both.\n"
        + hermes("get_weather", '{"city": "Paris"}')
        + "\n"
        + hermes("write", TRICKY_JSON),
        "I'll check both.\n",
        [("get_weather", WEATHER), ("write", TRICKY)],
    ),
    (
        "hermes-args-before-name",
        HERMES,
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes-args-as-string",
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes-no-end-marker",
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes-no-arguments",
        HERMES,
        '<tool_call>\n{"name": "now"}\n</tool_call>',
        "",
        [("now", {})],
    ),
    (
        "hermes-text-after",
        HERMES,
        hermes("get_weather", '{"city": "Paris"}') + "\nDone, waiting.",
        "\nDone, waiting.",
        [("get_weather", WEATHER)],
    ),
    (
        "generic",
        GENERIC,
        "Sure.\n" + hermes("write", TRICKY_JSON),
        "Sure.\n",
        [("write", TRICKY)],
    ),
    (
        "llama3-bare",
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3-python-tag-two",
        LLAMA3_JSON,
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            f'{{"name": "write", "parameters": {TRICKY_JSON}}}'
        ),
        "",
        [("get_weather", WEATHER), ("write", TRICKY)],
    ),
    ("llama3-plain-text", LLAMA3_JSON, "The weather is {mild}.", "The weather is {mild}.", []),
    (
        "mistral-list",
        MISTRAL,
        (
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}, '
            f'{{"name": "write", "arguments": {TRICKY_JSON}}}]'
        ),
        "",
        [("get_weather", WEATHER), ("write", TRICKY)],
    ),
    (
        "mistral-args-header",
        MISTRAL,
        f'[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]write[ARGS]{TRICKY_JSON}',
        "",
        [("get_weather", WEATHER), ("write", TRICKY)],
    ),
    (
        "mistral-call-id",
        MISTRAL,
        'Checking.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}',
        "Checking.",
        [("get_weather", WEATHER)],
    ),
    (
        "function-gemma",
        FUNCTION_GEMMA,
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "pythonic-two",
        PYTHONIC,
        (
            'Let me look.<|tool_call_start|>[get_weather(city="Paris"), '
            'search(q="a {b} \\"c\\"", tags=["x", "y"], n=3)]<|tool_call_end|>'
        ),
        "Let me look.",
        [("get_weather", WEATHER), ("search", {"q": 'a {b} "c"', "tags": ["x", "y"], "n": 3})],
    ),
    (
        "qwen3-coder",
        QWEN3_CODER,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", WEATHER)],
    ),
    # Malformed: the raw text comes back as content.
    ("marker-prefix", HERMES, "<tools are fun <tool", "<tools are fun <tool", []),
    (
        "hermes-not-json",
        HERMES,
        "<tool_call>\nget_weather(Paris)\n</tool_call> ok",
        "<tool_call>\nget_weather(Paris)\n</tool_call> ok",
        [],
    ),
    (
        "hermes-unterminated-before-args",
        HERMES,
        'x <tool_call>\n{"arguments": {"city": "Par',
        'x <tool_call>\n{"arguments": {"city": "Par',
        [],
    ),
    (
        "gemma-malformed",
        FUNCTION_GEMMA,
        "<start_function_call>get_weather Paris<end_function_call>",
        "<start_function_call>get_weather Paris<end_function_call>",
        [],
    ),
    (
        "pythonic-unterminated",
        PYTHONIC,
        '<|tool_call_start|>[get_weather(city="Par',
        '<|tool_call_start|>[get_weather(city="Par',
        [],
    ),
]


def splits(text: str):
    """The whole text, every split into two pieces, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def run(fmt: ToolFormat, pieces: list[str], **kwargs) -> list:
    parser = ToolCallParser(fmt, **kwargs)
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.finish()


def shape(events: list) -> tuple[str, list[tuple[str, str]]]:
    """A gathered turn without its random ids."""
    g = Gathered().add(events)
    return g.content, [(c.name, c.arguments) for c in g.tool_calls]


def check_events(events: list) -> None:
    """Indexes count from 0, ids are unique, args follow their call's start."""
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(starts)))
    assert len({s.id for s in starts}) == len(starts)
    seen = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            seen.add(e.index)
        elif isinstance(e, ToolCallArgs):
            assert e.index in seen


@pytest.mark.parametrize("fmt, text, content, calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_recorded_output(fmt, text, content, calls):
    events = run(fmt, [text])
    check_events(events)
    got_content, got_calls = shape(events)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


@pytest.mark.parametrize("fmt, text", [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_any_split_gives_the_same_turn(fmt, text):
    whole = shape(run(fmt, [text]))
    for pieces in splits(text):
        events = run(fmt, pieces)
        check_events(events)
        assert shape(events) == whole, pieces


def test_args_are_the_model_json_text_exactly():
    # Not re-serialized: the pieces joined are the arguments as the model wrote them.
    args = '{ "a" : [1,2] ,"b":"}\\"" }'
    for pieces in splits(hermes("f", args)):
        assert shape(run(HERMES, pieces))[1] == [("f", args)]


def test_text_streams_at_once_and_holds_only_a_marker_prefix():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello <to") == [TextDelta("Hello ")]
    assert parser.feed("ols") == [TextDelta("<tools")]
    assert parser.finish() == []
    assert not parser.called


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(HERMES)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgs]
    assert events[0].name == "get_weather" and events[1].text == '{"city": "Pa'
    assert parser.called
    rest = parser.feed('ris"}}\n</tool_call>') + parser.finish()
    assert rest == [ToolCallArgs(0, 'ris"}')]


def test_a_started_call_is_closed_at_finish():
    events = run(HERMES, ['<tool_call>{"name": "f", "arguments": {"a": [1, 2'])
    assert shape(events) == ("", [("f", '{"a": [1, 2')])


def test_unknown_tool_comes_back_as_content():
    text = hermes("rm_rf", '{"path": "/"}')
    for fmt, out in ((HERMES, text), (PYTHONIC, '<|tool_call_start|>[rm_rf(path="/")]<|tool_call_end|>')):
        for pieces in splits(out):
            assert shape(run(fmt, pieces, tool_names={"get_weather"})) == (out, [])


def test_known_tool_with_tool_names():
    assert shape(run(HERMES, [hermes("get_weather", "{}")], tool_names={"get_weather"})) == (
        "",
        [("get_weather", "{}")],
    )


def test_whitespace_only_output_without_calls_is_kept():
    assert shape(run(HERMES, ["\n\n"])) == ("\n\n", [])


def test_xml_values_typed_from_the_tools():
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}},
        }
    ]
    out = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    assert shape(run(QWEN3_CODER, [out], tools=tools)) == ("", [("f", '{"n": 3}')])


def test_ids_use_the_prefix():
    events = run(HERMES, [hermes("f", "{}")], id_prefix="toolu_")
    assert events[0].id.startswith("toolu_")


def test_format_named():
    assert format_named("json_tools") is HERMES
    assert format_named("Mistral") is MISTRAL
    assert format_named("generic") is GENERIC
    assert not QWEN3_CODER.json_body and QWEN3_CODER.start == "<tool_call>" and QWEN3_CODER.native
    with pytest.raises(ValueError):
        format_named("no_such_family")


def test_default_model_gets_generic(tokenizer):
    # SmolLM2's template renders no tools: tierlm puts them in the system prompt.
    assert format_for(tokenizer) is GENERIC
    assert not GENERIC.native


TEMPLATES = {
    "hermes": (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}{% for tool_call in m.tool_calls or [] %}"
        "{{ '<tool_call>\\n{\"name\": \"' }}{{ tool_call.name }}{{ '\"}\\n</tool_call>' }}"
        "{% endfor %}{{ m.content }}{% endfor %}"
    ),
    "llama3_json": (
        '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of '
        "argument name and its value}.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    ),
    "mistral": "{% for m in messages %}{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]{% endfor %}",
    "pythonic": "{% if tools %}<|tool_list_start|>{% endif %}{% for m in messages %}{% endfor %}",
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_template_that_knows_tools_gets_its_family(family, model_path, tmp_path):
    from mlx_lm.tokenizer_utils import load

    folder = make_tokenizer_dir(model_path, tmp_path, TEMPLATES[family])
    fmt = format_for(load(folder))
    assert fmt.name == family and fmt.native
    assert fmt.json_body == (family != "pythonic")


def make_tokenizer_dir(model_path: Path, tmp_path: Path, template: str) -> Path:
    """SmolLM2's tokenizer with another chat template."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(model_path / name, tmp_path / name)
    config = json.loads((model_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path
