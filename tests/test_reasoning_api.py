"""Reasoning sections on /v1/chat/completions, through the official `openai`
client against real servers: a tiny random-weight llama whose tokenizer is
SmolLM2's with `<think>` and `</think>` added as special tokens and a Qwen3-like
chat template (the generation prompt opens `<think>\\n` unless enable_thinking
is false). What is between the markers is `reasoning_content`, the rest is
`content`, streamed or not; a thinking budget closes the section; `--reasoning
off` leaves the text as it is.

A random model thinks until max_tokens: grammars and budgets make it do what
each test needs. Sampling is seeded, so a request gives the same tokens each time.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
from conftest import start_server, stop_server

NAME = "thinker"  # the model folder's name, which the server serves it as
HI = [{"role": "user", "content": "hi"}]
SAMPLING = {"temperature": 1.0, "seed": 7}
WORD = "/[a-z]{3,8}/"

# Qwen3's shape: ChatML turns; the generation prompt opens a thinking section,
# or holds an empty one when enable_thinking is false. `open_thinking` (ours)
# false leaves it to the output to open one. An answer sent back with its
# reasoning_content has it rendered, as Qwen3's does for the steps of a
# tool-calling turn.
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_thinking is not defined or open_thinking %}{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
OUTPUT_OPENS = {"chat_template_kwargs": {"open_thinking": False}}

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model_path):
    """The tokenizer folder (SmolLM2's, markers added, the template above), then
    a tiny random llama on it."""
    from transformers import AutoTokenizer

    from tierlm.models.random_model import make_random_model

    root = tmp_path_factory.mktemp("reasoning")
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(root / "tokenizer")
    shutil.copy(model_path / "config.json", root / "tokenizer" / "config.json")
    # in tokenizer_config.json, not chat_template.jinja: make_random_model copies the former only
    config_path = root / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (root / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return make_random_model("tiny", root / NAME, root / "tokenizer", "float32")


@pytest.fixture(scope="module")
def tok(model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(model_dir)


@pytest.fixture(scope="module")
def ids(tok):
    """The markers' token ids."""
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert tok.decode([start, end]) == "<think></think>"
    return start, end


def _server(model_dir, name, *args):
    return start_server(model_dir, model_dir.parent / f"{name}.log", "--no-ssd-cache", *args)


@pytest.fixture(scope="module")
def thinking(model_dir):
    srv = _server(model_dir, "thinking")
    yield srv.client()
    stop_server(srv)


@pytest.fixture(scope="module")
def reasoning_off(model_dir):
    srv = _server(model_dir, "off", "--reasoning", "off")
    yield srv.client()
    stop_server(srv)


@pytest.fixture(scope="module")
def budgeted(model_dir):
    srv = _server(model_dir, "budget", "--max-thinking-tokens", "5")
    yield srv.client()
    stop_server(srv)


# ---- helpers ------------------------------------------------------------------


def ask(client, max_tokens=12, stream=False, **extra):
    """(reasoning, content, response) of one chat completion; reasoning None when
    the message has none. Streamed: the deltas joined, after checking that every
    reasoning piece comes before the first content piece."""
    fields = {k: extra.pop(k) for k in ("response_format", "logprobs") if k in extra}
    kwargs = dict(model=NAME, messages=HI, max_tokens=max_tokens, extra_body=extra, **SAMPLING, **fields)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        message = response.choices[0].message
        return getattr(message, "reasoning_content", None), message.content, response
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            for kind, text in (("reasoning", getattr(delta, "reasoning_content", None)), ("content", delta.content)):
                if text:
                    pieces.append((kind, text))
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), pieces  # reasoning, then content
    reasoning = "".join(t for k, t in pieces if k == "reasoning") or None
    return reasoning, "".join(t for k, t in pieces if k == "content"), None


def both(client, **kwargs):
    """ask() non-streamed and streamed: they must agree. (reasoning, content)."""
    reasoning, content, _ = ask(client, **kwargs)
    assert ask(client, stream=True, **kwargs)[:2] == (reasoning, content or "")
    return reasoning, content


def no_markers(*texts):
    for text in texts:
        assert "<think>" not in (text or "") and "</think>" not in (text or ""), texts


def thinking_tokens(response, end_id, tok):
    """How many tokens came before the end marker (logprobs' tokens), or None."""
    tokens = [t.token for t in response.choices[0].logprobs.content]
    return tokens.index(tok.decode([end_id])) if tok.decode([end_id]) in tokens else None


# ---- the detokenizer shows the markers ---------------------------------------------


def test_detokenizer_shows_added_special_tokens(tok, ids):
    """The splitter reads the engine's text: special tokens must be in it, as
    mlx-lm's detokenizers show them (both of tierlm's streams, byte-table and not)."""
    from tierlm.engine.detokenizer import IncrementalText, byte_level_table

    start, end = ids
    tokens = [start, *tok.encode("\nhmm, é?", add_special_tokens=False), end,
              *tok.encode("\n\nYes.", add_special_tokens=False)]
    want = "<think>\nhmm, é?</think>\n\nYes."
    table = byte_level_table(tok.detokenizer)
    assert table is not None  # SmolLM2's is byte-level BPE: the fast path is the one the server runs
    for bytes_table in (table, None):
        text = IncrementalText(tok.detokenizer, [], bytes_table)
        assert "".join(text.add(t) for t in tokens) + text.finish() == want
    mlx = tok.detokenizer
    mlx.reset()
    for t in tokens:
        mlx.add_token(t)
    mlx.finalize()
    assert mlx.text == want


# ---- grammars through a thinking section -------------------------------------------


@pytest.mark.slow  # a server of its own
@pytest.mark.parametrize("stream", [False, True])
def test_grammar_through_a_section_the_output_opens(thinking, reasoning_off, ids, stream):
    start, end = ids
    grammar = f"start: <[{start}]> {WORD} <[{end}]> {WORD}"
    reasoning, content, _ = ask(thinking, grammar=grammar, stream=stream, **OUTPUT_OPENS)
    assert re.fullmatch("[a-z]{3,8}", reasoning) and re.fullmatch("[a-z]{3,8}", content), (reasoning, content)
    # the same tokens, not split: the markers are there, verbatim
    raw_reasoning, raw, _ = ask(reasoning_off, grammar=grammar, stream=stream, **OUTPUT_OPENS)
    assert raw_reasoning is None and raw == f"<think>{reasoning}</think>{content}"


def test_streamed_and_not_agree_through_the_output_opened_section(thinking, ids):
    start, end = ids
    reasoning, content = both(thinking, grammar=f"start: <[{start}]> \"\\n\" {WORD} <[{end}]> \"\\n\\n\" {WORD}",
                              **OUTPUT_OPENS)
    assert reasoning and content
    no_markers(reasoning, content)
    assert not reasoning.startswith("\n") and not content.startswith("\n")  # the whitespace after a marker goes


def test_grammar_after_a_section_the_prompt_opens(thinking, tok, ids):
    """The prompt opened the section: the grammar is the answer's, after a free
    thinking section (which the budget closes: the random model would not)."""
    reasoning, content = both(thinking, grammar=f"start: {WORD}", max_thinking_tokens=4, max_tokens=20)
    assert reasoning and re.fullmatch("[a-z]{3,8}", content), (reasoning, content)
    no_markers(reasoning, content)


def test_a_quoted_marker_in_a_grammar_is_no_server_error(thinking):
    """`"<think>"` spells the marker as text, never as the special token: it
    must either work (text markers are still markers) or be refused with a 400."""
    grammar = f'start: "<think>" {WORD} "</think>" {WORD}'
    try:
        reasoning, content, _ = ask(thinking, grammar=grammar, **OUTPUT_OPENS)
    except openai.BadRequestError:
        return
    assert reasoning and content


# ---- the thinking budget ----------------------------------------------------------


def test_without_a_budget_the_random_model_thinks_until_max_tokens(thinking):
    reasoning, content, response = ask(thinking, max_tokens=12)
    assert reasoning and not content
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 4])
def test_max_thinking_tokens_closes_the_section(thinking, tok, ids, n):
    reasoning, content, response = ask(thinking, max_tokens=16, max_thinking_tokens=n, logprobs=True)
    assert thinking_tokens(response, ids[1], tok) == n  # the end marker was the (n+1)th token
    assert len(tok.encode(reasoning or "", add_special_tokens=False)) <= n
    assert content, "the answer follows the closed section"
    assert ask(thinking, stream=True, max_tokens=16, max_thinking_tokens=n)[:2] == (reasoning, content)


def test_the_budget_counts_from_a_section_the_output_opens(thinking, tok, ids):
    start, end = ids
    grammar = f"start: <[{start}]> /[a-z ]+/ <[{end}]> {WORD}"  # it would think until max_tokens
    reasoning, content, response = ask(thinking, max_tokens=20, grammar=grammar, max_thinking_tokens=3,
                                       logprobs=True, **OUTPUT_OPENS)
    assert thinking_tokens(response, end, tok) == 1 + 3  # <think> and three tokens
    assert reasoning and re.fullmatch("[a-z]{3,8}", content), (reasoning, content)


@pytest.mark.slow  # a server of its own
def test_server_wide_max_thinking_tokens(budgeted, tok, ids):
    reasoning, content, response = ask(budgeted, max_tokens=16, logprobs=True)
    assert thinking_tokens(response, ids[1], tok) == 5
    assert len(tok.encode(reasoning or "", add_special_tokens=False)) <= 5 and content
    # a request's own budget wins
    _, content, response = ask(budgeted, max_tokens=16, max_thinking_tokens=2, logprobs=True)
    assert thinking_tokens(response, ids[1], tok) == 2 and content


# ---- the chat template's switch ------------------------------------------------


def test_enable_thinking_false_reaches_the_template(thinking):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reasoning, content = both(thinking, **off)
    assert reasoning is None and content
    no_markers(content)
    # the template wrote the closed empty section: "<think>\n\n</think>\n\n" against "<think>\n"
    with_off, without = ask(thinking, max_tokens=1, **off)[2], ask(thinking, max_tokens=1)[2]
    assert with_off.usage.prompt_tokens > without.usage.prompt_tokens
    # the section is closed already: a budget has nothing to close
    assert ask(thinking, max_thinking_tokens=1, **off)[:2] == (None, content)


# ---- --reasoning off -------------------------------------------------------------


def test_reasoning_off_leaves_the_text_verbatim(reasoning_off, thinking, ids):
    reasoning, content = both(reasoning_off, max_tokens=12)
    assert reasoning is None and content
    # the prompt opened a section, but nothing is split: the grammar is the whole answer
    grammar = f"start: {WORD} <[{ids[1]}]> {WORD}"
    reasoning, content = both(reasoning_off, grammar=grammar)
    assert reasoning is None and re.fullmatch("[a-z]{3,8}</think>[a-z]{3,8}", content), content


# ---- JSON after thinking ------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "w": {"type": "string", "maxLength": 6}},
          "required": ["n", "w"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def test_json_schema_after_thinking(thinking):
    reasoning, content = both(thinking, response_format=JSON_FORMAT, max_thinking_tokens=3, max_tokens=40)
    assert reasoning
    no_markers(reasoning, content)
    jsonschema.validate(json.loads(content), SCHEMA)


# ---- the Anthropic Messages API's thinking blocks ------------------------------------


def test_thinking_blocks_on_the_messages_api(thinking):
    """The section the prompt opens is a thinking block, closed by the request's
    budget; streamed, the same blocks arrive as thinking_delta then text_delta."""
    import anthropic

    base = str(thinking.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    kwargs = dict(model=NAME, messages=HI, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 4},
                  extra_body=SAMPLING)
    message = claude.messages.create(**kwargs)
    assert [b.type for b in message.content][:2] == ["thinking", "text"], message.content
    no_markers(message.content[0].thinking, message.content[1].text)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert kinds.index("signature_delta") < kinds.index("text_delta") and kinds[0] == "thinking_delta"


def test_an_answers_reasoning_sent_back_reaches_the_template(thinking, tok):
    """An earlier answer's reasoning, sent back as each API sends it (chat's
    reasoning_content or reasoning, a Messages thinking block, a Responses
    reasoning item), is rendered by a template that renders it: the prompt is
    the one the model wrote, so a tool-calling turn's steps keep their cached KV."""
    import anthropic

    thought = "The user greets me; greet back."
    before, after = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "again"}]
    rendered = tok.apply_chat_template([*before, {"role": "assistant", "content": "Hello.",
                                                  "reasoning_content": thought}, *after], add_generation_prompt=True)
    plain = tok.apply_chat_template([*before, {"role": "assistant", "content": "Hello."}, *after],
                                    add_generation_prompt=True)
    assert len(rendered) > len(plain)
    for key in ("reasoning_content", "reasoning"):
        reply = thinking.chat.completions.create(
            model=NAME, max_tokens=1, messages=[*before, {"role": "assistant", "content": "Hello.", key: thought},
                                                *after])
        assert reply.usage.prompt_tokens == len(rendered), key

    base = str(thinking.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    answer = [{"type": "thinking", "thinking": thought, "signature": ""}, {"type": "text", "text": "Hello."}]
    counted = claude.messages.count_tokens(model=NAME, messages=[*before, {"role": "assistant", "content": answer},
                                                                 *after])
    assert counted.input_tokens == len(rendered)

    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": thought}]}
    response = thinking.responses.create(model=NAME, max_output_tokens=16, input=[
        *before, reasoning, {"role": "assistant", "content": "Hello."}, *after])
    assert response.usage.input_tokens == len(rendered)
