"""Grammars with llguidance: a JSON schema, a Lark grammar or a tool-call
format compiled for one model's tokenizer, and the token constraint that
enforces it while the request decodes.

This is the one place tierlm reaches into llguidance; tests/test_grammar.py
fails loudly when its surface changes.
"""

from __future__ import annotations

import json
import threading

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

# Compact JSON for answers: free whitespace lets small models write newlines
# forever (and SmolLM2-135M, given any layout, writes some numbers forever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A tool call's arguments laid out as the model learned to write them, compact
# or indented, with at most one newline between two tokens: held to compact
# JSON where it indents (Qwen2.5-Coder in a ```json fence), a model writes worse
# values (`echo 'hello world'` for `echo 'hello world' > notes.txt`).
TOOL_JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": r"\n?[ \t]{0,16}", "lenient": True}


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile; the message says why."""


class GrammarViolation(RuntimeError):
    """The request's tokens left its grammar (a bug, or a stop string cutting a token)."""


def json_schema_grammar(schema: dict | bool) -> str:
    """The grammar of JSON text that validates against `schema`."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema is not valid: {e}") from e


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def json_body(schema: dict | bool, tool: bool = False) -> str:
    """A JSON schema as a body inside a Lark rule (`%json {...}`), compact as above,
    its objects closed (closed_objects).
    `tool`: a tool's arguments, in the model's layout (TOOL_JSON_OPTIONS), and
    keywords llguidance does not implement (`propertyNames`, ...) are ignored
    rather than refused: an agent writes a tool's schema for models that read it,
    not for grammars (Claude Code's use propertyNames)."""
    if schema is True or schema == {}:
        schema = {}
    elif schema is False:
        raise GrammarError("the JSON schema `false` accepts nothing")
    options = TOOL_JSON_OPTIONS if tool else JSON_OPTIONS
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": options})


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "contains", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema, closable: bool = True):
    """`schema` with `additionalProperties: false` on every object that lists its
    `properties` and says nothing of other keys, as vLLM's strict mode reads
    schemas: a small model otherwise adds keys until its tokens run out. A
    schema opts out by saying `additionalProperties` (true, or a schema) or
    `patternProperties`; an object without `properties` stays free-form. `allOf`
    and its parts are left open: closing one would refuse the others' keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, closable=False) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    opened = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if closable and isinstance(out.get("properties"), dict) and not any(k in out for k in opened):
        out["additionalProperties"] = False
    return out


class ModelGrammars:
    """Compiles grammars for one model. llguidance's view of the tokenizer takes
    about a second to build: it is built once, on first use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # mlx-lm's TokenizerWrapper
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = sorted(self.tokenizer.eos_token_ids)
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer._tokenizer, eos_token=eos)
            return self._ll

    def literal(self, text: str) -> str:
        """`text` as a Lark literal for this model: a special token by name (a
        quoted string never matches one), anything else quoted."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def name_special_tokens(self, lark: str) -> str:
        """A client's Lark grammar with each quoted literal that spells a special
        token (`"<think>"`) written as that token (`<[id]>`): llguidance would
        otherwise produce the token, then refuse it as not matching the text."""
        for text, token in self._special_tokens().items():
            lark = lark.replace(json.dumps(text), f"<[{token}]>")
        return lark

    def _special_tokens(self) -> dict[str, int]:
        added = self.tokenizer._tokenizer.get_added_vocab()  # llguidance counts every added token special
        return {text: token for text, token in added.items() if self.ll_tokenizer.is_special_token(token)}

    def check(self, grammar: str) -> None:
        """Raise GrammarError unless `grammar` compiles for this model."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise GrammarError(error)

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for one request (it keeps that request's parse state).
        Compiling can take a while for a large schema: call it off the event loop."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarConstraint(matcher, self.ll_tokenizer.vocab_size)


class GrammarConstraint:
    """A `TokenConstraint` (tierlm.engine.constraint) backed by an LLMatcher.

    The first mask is computed when the constraint is made, off the engine's
    thread: it is the slow one (llguidance builds its lexer states then, up to
    a few milliseconds), and the batch would wait for it."""

    def __init__(self, matcher: llguidance.LLMatcher, ll_vocab: int):
        self.matcher = matcher
        self._bitmask = allocate_token_bitmask(1, ll_vocab)
        self._ll_vocab = ll_vocab
        self._next = self._mask()  # the mask for the state the matcher is in, if computed

    def consume(self, token: int) -> None:
        self._next = None
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise GrammarViolation(f"token {token} broke the grammar: {self.matcher.get_error()}")

    def allowed(self, vocab: int) -> np.ndarray:
        mask, self._next = (self._next if self._next is not None else self._mask()), None
        if vocab <= mask.size:
            return mask[:vocab]
        # the model has more rows than the tokenizer has tokens: those are never allowed
        return np.concatenate([mask, np.zeros(vocab - mask.size, bool)])

    def _mask(self) -> np.ndarray:
        fill_next_token_bitmask(self.matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), count=self._ll_vocab, bitorder="little")
        return bits.view(bool)  # 0/1 bytes are bools already: no copy

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
