"""A constrained request decodes in the same batch as the others, with a mask
of its own: in-process engine on the default model."""

import asyncio
import json

import jsonschema
import pytest
from engine_testing import request, run, started

from tierlm.structured.grammar import ModelGrammars, json_schema_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def grammars(loaded):
    return ModelGrammars(loaded[1])


def constrained(loaded, engine, grammars, **params):
    return request(loaded, engine, max_tokens=80, text=ASK,
                   constraint=grammars.constraint(json_schema_grammar(PERSON)), **params)


def test_constrained_and_free_requests_in_one_batch_give_what_they_give_alone(loaded, grammars):
    async def main():
        engine = await started(loaded)
        try:
            alone_c = await engine.generate(constrained(loaded, engine, grammars))
            alone_f = await engine.generate(request(loaded, engine, max_tokens=24, text=ASK))
            together = await asyncio.gather(
                engine.generate(constrained(loaded, engine, grammars)),
                engine.generate(request(loaded, engine, max_tokens=24, text=ASK)),
            )
            return alone_c, alone_f, together
        finally:
            await engine.close()

    alone_c, alone_f, (batch_c, batch_f) = run(main())
    assert batch_c.text == alone_c.text and batch_f.text == alone_f.text
    jsonschema.validate(json.loads(alone_c.text), PERSON)
    assert alone_c.finish_reason.value == "stop"
    assert not alone_f.text.lstrip().startswith("{")  # the free request is not held to the schema


@pytest.mark.slow  # many sampled answers; test_structured_output_api samples too
def test_sampled_constrained_requests_always_validate(loaded, grammars):
    async def main():
        engine = await started(loaded)
        try:
            requests = [constrained(loaded, engine, grammars, temperature=1.0, seed=s) for s in range(6)]
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.close()

    for out in run(main()):
        assert out.error is None
        jsonschema.validate(json.loads(out.text), PERSON)
