"""`response_format` enforced token by token, through the official `openai`
client against a real server on the default model: every answer parses and
validates, streamed or not; what the grammar engine cannot compile is a 400."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
# bounded, so that every answer ends within max_tokens (a small model may write
# digits or letters until it runs out of tokens when nothing stops it)
S = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}

SCHEMAS = {
    "flat_object": {"type": "object", "properties": {"name": S, "age": INT},
                    "required": ["name", "age"], "additionalProperties": False},
    "nested_object": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": INT, "email": S},
        "required": ["id", "email"], "additionalProperties": False}}, "required": ["user"],
        "additionalProperties": False},
    "array_of_strings": {"type": "array", "items": S, "minItems": 1, "maxItems": 4},
    "array_of_objects": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"], "additionalProperties": False}},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "v": INT},
              "required": ["kind", "v"], "additionalProperties": False},
    "integer_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
                       "required": ["n"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["p"], "additionalProperties": False},
    "exclusive_bounds": {"type": "object", "properties": {
        "t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}, "required": ["t"],
        "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"a": S, "b": INT, "c": {"type": "boolean"}},
                        "required": ["a"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [INT, S]}},
               "required": ["value"], "additionalProperties": False},
    "any_of_objects": {"anyOf": [
        {"type": "object", "properties": {"cat": S}, "required": ["cat"], "additionalProperties": False},
        {"type": "object", "properties": {"dog": S}, "required": ["dog"], "additionalProperties": False}]},
    "boolean_and_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
                         "required": ["ok", "none"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"maybe": {"type": ["integer", "null"]}}, "required": ["maybe"],
                 "additionalProperties": False},
    "string_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "string_format_date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                           "required": ["day"], "additionalProperties": False},
    "ref_and_defs": {"$defs": {"pt": {"type": "object", "properties": {"x": INT,
                                                                       "y": INT},
                                      "required": ["x", "y"], "additionalProperties": False}},
                     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                     "required": ["a", "b"], "additionalProperties": False},
    "tuple_items": {"type": "array", "prefixItems": [INT, S], "items": False, "minItems": 2},
    "deep_nesting": {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {
        "type": "object", "properties": {"l3": {"type": "array", "items": INT, "maxItems": 3}},
        "required": ["l3"], "additionalProperties": False}}, "required": ["l2"], "additionalProperties": False}},
        "required": ["l1"], "additionalProperties": False},
    "top_level_enum_string": {"enum": ["yes", "no", "maybe"]},
}
PROMPT = [{"role": "user", "content": "Answer with an example JSON value."}]


def ask(client, schema, stream=False, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=fmt, max_tokens=120,
                                          stream=stream, **kw)


def test_twenty_schemas():
    assert len(SCHEMAS) == 20


@pytest.mark.slow  # twenty schemas, streamed and not
def test_every_answer_validates_streamed_or_not(client):
    """All twenty schemas at once, each streamed and not: they decode in one batch
    (which is what a server does with them), and each answer stands alone."""

    def both(name: str) -> tuple[str, object, str]:
        whole = ask(client, SCHEMAS[name]).choices[0]
        chunks = list(ask(client, SCHEMAS[name], stream=True))
        return name, whole, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(both, sorted(SCHEMAS)))
    for name, whole, streamed in results:
        assert whole.finish_reason == "stop", (name, whole)
        jsonschema.validate(json.loads(whole.message.content), SCHEMAS[name])
        assert streamed == whole.message.content, name
        jsonschema.validate(json.loads(streamed), SCHEMAS[name])


def test_sampled_answers_validate_too(client):
    schema = SCHEMAS["array_of_objects"]
    for seed in range(3):
        out = ask(client, schema, temperature=1.0, seed=seed).choices[0].message.content
        jsonschema.validate(json.loads(out), schema)


def test_json_object_mode_gives_an_object(client):
    out = client.chat.completions.create(model=MODEL, messages=PROMPT, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0).choices[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:  # an object without bounds may run past max_tokens; what came is its start
        assert out.message.content.startswith("{")


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "xml"},
])
def test_what_cannot_be_compiled_is_a_400(client, response_format):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=response_format, max_tokens=5)
    assert e.value.body["param"].startswith("response_format"), e.value.body
    assert e.value.body["message"]
