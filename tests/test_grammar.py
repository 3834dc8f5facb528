"""tierlm.structured.grammar: the one place tierlm uses llguidance. These tests
fail loudly when llguidance's surface changes (LLTokenizer from a Hugging Face
tokenizer, LLMatcher, the JSON and Lark front ends, the token bitmask)."""

import json

import numpy as np
import pytest

from tierlm.structured.grammar import (
    GrammarError,
    GrammarViolation,
    ModelGrammars,
    closed_objects,
    json_body,
    json_schema_grammar,
    lark_grammar,
)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return ModelGrammars(tokenizer)


def drive(grammars, grammar: str, text: str):
    """Feed `text`'s tokens through a fresh constraint, checking each was allowed."""
    constraint = grammars.constraint(grammar)
    vocab = grammars.ll_tokenizer.vocab_size
    for token in grammars.tokenizer.encode(text, add_special_tokens=False):
        mask = constraint.allowed(vocab)
        assert mask.shape == (vocab,) and mask.dtype == bool
        assert mask[token], f"{grammars.tokenizer.decode([token])!r} refused"
        constraint.consume(token)
    return constraint


def test_json_schema_accepts_valid_text_then_only_eos(grammars, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    constraint = drive(grammars, json_schema_grammar(schema), '{"n": 42}')
    mask = constraint.allowed(grammars.ll_tokenizer.vocab_size)
    assert set(np.flatnonzero(mask)) == set(tokenizer.eos_token_ids)
    assert constraint.done or constraint.matcher.is_accepting()


def test_a_refused_token_is_a_violation(grammars, tokenizer):
    constraint = grammars.constraint(json_schema_grammar({"type": "integer"}))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not constraint.allowed(grammars.ll_tokenizer.vocab_size)[letter]
    with pytest.raises(GrammarViolation):
        constraint.consume(letter)


def test_the_mask_covers_a_wider_model_vocabulary(grammars):
    constraint = grammars.constraint(json_schema_grammar({"type": "integer"}))
    vocab = grammars.ll_tokenizer.vocab_size
    mask = constraint.allowed(vocab + 100)
    assert mask.shape == (vocab + 100,) and not mask[vocab:].any()


def _call_of_a(tool: bool = False) -> str:
    """A Lark grammar: "call " and an object whose key "a" holds an array."""
    return lark_grammar(f'start: "call " {json_body({"type": "object", "properties": {"a": {"type": "array"}}}, tool)}')


@pytest.mark.parametrize("text", ['{"a": [1, 2]}', '{"a":[1,2]}', '{\n  "a": [\n    1,\n    2\n  ]\n}'])
def test_a_tool_calls_json_is_laid_out_as_the_model_likes(grammars, text):
    """Compact or indented, as the model writes it (a small model held to one
    layout it did not choose writes worse values)."""
    drive(grammars, _call_of_a(tool=True), "call " + text)


def test_json_allows_no_run_of_newlines(grammars):
    """At most one newline between two tokens: a small model would otherwise write newlines forever."""
    with pytest.raises(AssertionError, match="refused"):
        drive(grammars, _call_of_a(tool=True), 'call {\n\n"a": [1]}')


def test_an_answers_json_is_compact(grammars):
    drive(grammars, _call_of_a(), 'call {"a": [1, 2]}')
    with pytest.raises(AssertionError, match="refused"):
        drive(grammars, _call_of_a(), 'call {"a" :[1,2]}')


@pytest.mark.parametrize("grammar", [
    json_schema_grammar({"type": "string", "pattern": "(?<=a)b"}),  # look-behind: unsupported
    lark_grammar("start: undefined_rule"),
])
def test_what_cannot_compile_is_a_grammar_error(grammars, grammar):
    with pytest.raises(GrammarError):
        grammars.check(grammar)


def test_a_schema_that_is_not_json_is_a_grammar_error():
    with pytest.raises(GrammarError):
        json_schema_grammar("{not json")


def test_special_tokens_are_named_in_lark(grammars, tokenizer):
    eos = tokenizer.eos_token_ids
    special = tokenizer.decode(sorted(eos))
    assert grammars.literal(special) == f"<[{sorted(eos)[0]}]>"
    assert grammars.literal("<tool_call>") == json.dumps("<tool_call>")  # several tokens in SmolLM2


def test_objects_that_list_their_properties_are_closed():
    """additionalProperties left out counts as false, as vLLM's strict mode; saying it opts out."""
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
        "free": {"type": "object"},
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]}}}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False and props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"] and props["open"]["additionalProperties"] is True
    assert all("additionalProperties" not in part for part in props["both"]["allOf"])
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {"type": "string"}}}  # not changed


def test_a_closed_object_ends_after_its_keys(grammars, tokenizer):
    grammar = json.dumps({"grammars": [{"lark_grammar": "start: " + json_body(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})}]})
    constraint = drive(grammars, grammar, '{"a": 1')
    mask = constraint.allowed(grammars.ll_tokenizer.vocab_size)
    assert {tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)} <= {"}", "0", "1", "2", "3", "4", "5", "6",
                                                                           "7", "8", "9"}
