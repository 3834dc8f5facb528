"""What a turn's output is made of, as it streams: text, reasoning, tool calls.

Parsers turn the model's text deltas into these events; each API adapter maps
them to its own stream pieces (OpenAI `delta.content` / `delta.tool_calls`,
Anthropic content blocks, Responses output items). A non-streamed answer is the
same events gathered (`Gathered`), so both always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int  # 0, 1, ... within the turn
    id: str
    name: str


@dataclass
class ToolCallArgs:
    index: int
    text: str  # a piece of the arguments' JSON text; the pieces joined are the whole


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgs


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass
class Gathered:
    """A whole turn, built from its events."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> Gathered:
        for e in events:
            if isinstance(e, TextDelta):
                self.content += e.text
            elif isinstance(e, ReasoningDelta):
                self.reasoning += e.text
            elif isinstance(e, ToolCallStart):
                self.tool_calls.append(ToolCall(e.id, e.name, ""))
            else:
                self.tool_calls[e.index].arguments += e.text
        return self
