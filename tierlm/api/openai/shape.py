"""A turn written back in OpenAI's shape: its events as chat.completion.chunk
deltas, a whole turn as a message, the finish reason and the usage."""

from __future__ import annotations

from typing import Any

from tierlm.engine.request import RequestOutput
from tierlm.structured.events import Event, Gathered, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart


def delta_of(event: Event) -> dict:
    """One event as a chat.completion.chunk delta."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    assert isinstance(event, ToolCallArgs)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def message_of(turn: Gathered) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["content"] = turn.content or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    return message


def finish_reason(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


def usage(output: RequestOutput) -> dict:
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "total_tokens": output.prompt_tokens + output.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }
