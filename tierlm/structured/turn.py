"""One assistant turn, as every API adapter asks for it: what the model is
told (messages, tools), what it may answer (a token constraint), and how its
text is read back (reasoning, content, tool calls as events).

An adapter reads its API's fields into a `TurnSpec`, calls `prepare` before
rendering the chat template and `start` with the rendered prompt, puts the
constraint on the request and feeds the generated text to the parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from tierlm.engine.constraint import AllOf, TokenConstraint
from tierlm.structured.events import Event, ReasoningDelta, TextDelta
from tierlm.structured.grammar import GrammarError, ModelGrammars, json_body
from tierlm.structured.reasoning import (
    ReasoningSplitter,
    ThinkingBudget,
    ThinkingMarkers,
    markers_for,
    starts_in_thinking,
)
from tierlm.structured.tool_calls import ToolCallParser
from tierlm.structured.tool_formats import format_for, format_named
from tierlm.structured.tools import (
    Tool,
    ToolChoice,
    TurnError,
    call_grammar,
    check_tools,
    generic_instructions,
    no_call_grammar,
    strip_private,
    template_messages,
    with_instructions,
)

PROMPT_TAIL_TOKENS = 64  # enough of the prompt's end to see whether it opened a thinking section


@dataclass
class TurnSpec:
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    json_schema: dict | bool | None = None  # a text answer must be JSON valid against it
    grammar: str | None = None  # a text answer must match this Lark grammar (llguidance's dialect)
    max_thinking_tokens: int | None = None

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


@dataclass
class TurnRun:
    """What one started turn needs: its request's constraint and its text's parser."""

    constraint: TokenConstraint | None
    parser: TurnParser


class ModelTurns:
    """How one model takes turns: its tool-call format, its thinking markers,
    its grammars. Built once per served model."""

    def __init__(self, tokenizer, tool_format: str | None = None, reasoning: str | None = None,
                 max_thinking_tokens: int | None = None, parallel_calls: bool = True):
        self.tokenizer = tokenizer
        self.grammars = ModelGrammars(tokenizer)
        self.format = format_named(tool_format) if tool_format else format_for(tokenizer)
        self.markers = markers_for(tokenizer, reasoning)
        self.max_thinking_tokens = max_thinking_tokens
        self.parallel_calls = parallel_calls  # False: one call an answer, whatever a request allows

    def prepare(self, spec: TurnSpec, messages: list[dict]) -> tuple[list[dict], dict]:
        """The messages for the chat template, and what to add to its variables."""
        check_tools(spec.tools, spec.tool_choice)
        if spec.grammar is not None and spec.json_schema is not None:
            raise TurnError("give either a grammar or a response_format, not both", "response_format")
        messages, variables = template_messages(messages, self.format), {}
        # The tools are in the prompt whatever tool_choice says, "none" too: a turn
        # that changes it keeps the conversation's prefix, and its cached KV; the
        # grammar holds the model to the choice.
        if spec.tools and self.format.native:
            variables["tools"] = [{"type": "function", "function": t.as_json()} for t in spec.tools]
        elif spec.tools:
            messages = with_instructions(messages, generic_instructions(spec.tools, self.format))
        return strip_private(messages), variables

    def start(self, spec: TurnSpec, prompt_tokens: list[int]) -> TurnRun:
        """Compile what the turn needs for this prompt (can take a while for a
        large schema: call off the event loop). Raises TurnError."""
        thinking = self.markers is not None and starts_in_thinking(
            self.tokenizer.decode(prompt_tokens[-PROMPT_TAIL_TOKENS:]), self.markers)
        constraints = [c for c in (self._grammar_constraint(spec, thinking), self._budget(spec, thinking)) if c]
        constraint = None if not constraints else constraints[0] if len(constraints) == 1 else AllOf(*constraints)
        return TurnRun(constraint, self._parser(spec, thinking))

    def _grammar_constraint(self, spec: TurnSpec, thinking: bool) -> TokenConstraint | None:
        grammar = self._grammar(spec, thinking)
        if grammar is None:
            return None
        try:
            self.grammars.check(grammar)
            return self.grammars.constraint(grammar)
        except GrammarError as e:
            if spec.calls_tools:
                self._check_each_tool(spec.tools)
            param = "grammar" if spec.grammar is not None else "tools"
            param = "response_format" if spec.json_schema is not None and not spec.calls_tools else param
            raise TurnError(f"the grammar engine cannot compile this: {e}", param) from e

    def _check_each_tool(self, tools: list[Tool]) -> None:
        """A TurnError naming the first tool whose parameters schema does not compile alone."""
        for i, tool in enumerate(tools):
            try:
                self.grammars.check(_lark(_json_lark(tool.schema, tool=True)))
            except GrammarError as e:
                # llguidance's message, less its listing of the grammar (numbered lines, carets)
                lines = (line.strip() for line in str(e).splitlines())
                reason = " ".join(line for line in lines if line and not re.match(r"(\d+ \||\^)", line))
                raise TurnError(f"tool {tool.name!r}: its parameters schema cannot be used: {reason}",
                                f"tools[{i}].function.parameters") from e

    def _budget(self, spec: TurnSpec, thinking: bool) -> ThinkingBudget | None:
        budget = spec.max_thinking_tokens if spec.max_thinking_tokens is not None else self.max_thinking_tokens
        if self.markers is None or budget is None:
            return None
        start = tuple(self.tokenizer.encode(self.markers.start, add_special_tokens=False))
        return ThinkingBudget(self.markers, budget, thinking, start)

    def _parser(self, spec: TurnSpec, thinking: bool) -> TurnParser:
        splitter = ReasoningSplitter(self.markers, thinking) if self.markers is not None else None
        names = {t.name for t in spec.tools}
        tools = [{"type": "function", "function": t.as_json()} for t in spec.tools]  # mlx-lm's parsers type values
        calls = ToolCallParser(self.format, names, tools=tools) if spec.calls_tools else None
        return TurnParser(splitter, calls)

    def _grammar(self, spec: TurnSpec, thinking: bool) -> str | None:
        """The whole answer's grammar, or None when it is free."""
        lark = spec.grammar
        if spec.calls_tools:
            if spec.grammar is not None:
                raise TurnError("a grammar cannot be combined with tools; send tool_choice 'none'", "grammar")
            choice = spec.tool_choice if self.parallel_calls else replace(spec.tool_choice, parallel=False)
            lark = call_grammar(spec.tools, self.format, choice, self.grammars.literal, spec.json_schema)
        if lark is None and spec.json_schema is not None:
            lark = _json_lark(spec.json_schema)
        if lark is None and spec.tools and not spec.calls_tools:  # "none": the tools are listed all the same
            lark = no_call_grammar(self.format, self.grammars.literal, spec.tools)
        if lark is None:
            return None
        if spec.grammar is not None:
            lark = self.grammars.name_special_tokens(lark)
        if not thinking:
            return _lark(lark)
        return _after_thinking(lark, self.markers, self.grammars.literal, sorted(self.tokenizer.eos_token_ids))


def _json_lark(schema: dict | bool, tool: bool = False) -> str:
    """A Lark grammar whose answer is JSON valid against `schema`."""
    return f"%llguidance {{}}\nstart: {json_body(schema, tool)}\n"


def _lark(lark: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def _after_thinking(lark: str, markers: ThinkingMarkers, literal, eos: list[int]) -> str:
    """`lark` after a free thinking section that the prompt opened: the answer's
    grammar starts once the model closes it (never with the end of sequence,
    which would leave the answer out)."""
    end = literal(markers.end)
    if end.startswith("<["):  # one special token: llguidance lexes none inside a lazy lexeme
        thought = f"thought: <[^{end[2:-2]},{','.join(map(str, eos))}]>* {end}\n"
    else:
        thought = f"thought[lazy]: THOUGHT {end}\nTHOUGHT: /(.|\\n)*/\n"
    head = '%llguidance {}\nstart: thought ("\\n" "\\n"?)? @answer\n' + thought
    return json.dumps({"grammars": [{"lark_grammar": head}, {"name": "answer", "lark_grammar": lark}]})


class TurnParser:
    """The generated text as events: reasoning first split off, then tool calls
    read from the rest."""

    def __init__(self, splitter: ReasoningSplitter | None, calls: ToolCallParser | None):
        self.splitter, self.calls = splitter, calls

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, text: str) -> list[Event]:
        return self._route(self.splitter.feed(text) if self.splitter else [TextDelta(text)])

    def finish(self) -> list[Event]:
        events = self._route(self.splitter.finish()) if self.splitter else []
        if self.calls is not None:
            events += self.calls.finish()
        return events

    def _route(self, events: list) -> list[Event]:
        if self.calls is None:
            return [e for e in events if e.text]
        out: list[Event] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                out.append(e)
            elif e.text:
                out += self.calls.feed(e.text)
        return out
