"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens, what
Claude Code and the `anthropic` SDK speak. Errors on these paths take
Anthropic's shape (api/errors.py)."""

from __future__ import annotations

import asyncio
import re

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.api.answer import Encoder, collect, finish_of, sse_response, stream, with_model
from tierlm.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from tierlm.api.anthropic.turns import chat_messages, content_blocks, stop_reason, turn_spec, usage
from tierlm.api.errors import anthropic_error_body
from tierlm.api.fields import SamplingFields
from tierlm.api.sse import sse_event
from tierlm.api.turns import render_turn, start_turn
from tierlm.config import Settings
from tierlm.engine.request import Request, RequestOutput
from tierlm.serving.errors import APIError
from tierlm.serving.leases import turns_for
from tierlm.serving.served_model import ServedModel
from tierlm.structured.events import Event, ReasoningDelta, TextDelta, ToolCallStart
from tierlm.structured.turn import ModelTurns, TurnParser, TurnRun, TurnSpec

router = APIRouter(prefix="/v1")

PING_EVERY_S = 10.0  # at most this long without an event, or agents give up on the server


@router.post("/messages")
async def messages(body: MessagesRequest, http: HTTPRequest):
    return await with_model(http, body, _message)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, http: HTTPRequest):
    """The prompt's true length, rendered as /v1/messages would render it, with the
    tokenizer alone: no model is loaded and no engine is asked."""
    _, turns, settings = await turns_for(http.app.state.pool, body.model)
    tokens = await asyncio.to_thread(_render, turns, settings, body, turn_spec(body))
    return {"input_tokens": len(tokens)}


async def _message(model: ServedModel, body: MessagesRequest, http: HTTPRequest):
    request, turn = await asyncio.to_thread(_message_request, model, body)  # one hand-off off the loop
    if body.stream:
        keepalive = min(http.app.state.settings.sse_keepalive_s, PING_EVERY_S)
        return sse_response(stream(model, request, turn.parser, MessageEvents(model, request, turn.parser), keepalive))
    output, gathered = await collect(model, request, http, turn.parser)
    return {
        "id": request.request_id,
        "type": "message",
        "role": "assistant",
        "model": model.info.name,
        "content": content_blocks(gathered),
        "stop_reason": stop_reason(finish_of(output), turn.parser.called, output.stop_sequence),
        "stop_sequence": output.stop_sequence,
        "usage": usage(output.prompt_tokens, output.cached_tokens, output.completion_tokens),
    }


def _message_request(model: ServedModel, body: MessagesRequest) -> tuple[Request, TurnRun]:
    """The prompt rendered, the turn's grammar compiled and the request made."""
    spec = turn_spec(body)
    tokens = _render(model.turns, model.settings, body, spec)
    if model.prompt_too_long(len(tokens)):
        raise _prompt_too_long(len(tokens), model.context)
    turn = start_turn(model, spec, tokens)
    max_tokens = model.within_context(len(tokens), body.max_tokens)
    return model.make_request("msg", tokens, _sampling(body), max_tokens, constraint=turn.constraint,
                              tokenized=True), turn


def _prompt_too_long(prompt_tokens: int, context: int) -> APIError:
    """In Anthropic's own words: Claude Code reads both numbers from this message
    and compacts the conversation to fit, where it would otherwise assume the
    200k-token context of its own models and fail at every turn from here."""
    return APIError(400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum", "messages",
                    "context_length_exceeded")


def _render(turns: ModelTurns, settings: Settings, body: CountTokensRequest, spec: TurnSpec) -> list[int]:
    volatile = [re.compile(p) for p in settings.volatile_prompt_blocks]
    # thinking off: templates with a switch (Qwen 3's) leave the section out, unless the settings say
    defaults = {"enable_thinking": False} if spec.max_thinking_tokens == 0 else None
    return render_turn(turns, settings, spec, chat_messages(body, volatile), defaults=defaults)


def _sampling(body: MessagesRequest) -> SamplingFields:
    """Anthropic's sampling fields as the engine's common ones."""
    return SamplingFields(model=body.model, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, stop=body.stop_sequences, seed=body.seed, keep_alive=body.keep_alive,
                          speculative_tokens=body.speculative_tokens)


# ---- streaming ----------------------------------------------------------------


class _Blocks:
    """Turn events as content blocks: a block starts when the kind of output
    changes (thinking, text, each tool call) and stops before the next starts."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def feed(self, event: Event) -> list[str]:
        out: list[str] = []
        if isinstance(event, ToolCallStart):
            out += self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        elif isinstance(event, ReasoningDelta):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        else:  # a piece of the open tool call's arguments
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        return out

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # thinking blocks end with their signature (none here)
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*out, sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        return [*out, sse_event("content_block_start",
                                {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


class MessageEvents(Encoder):
    """The message as Anthropic streams it: message_start, content blocks as
    they are generated, message_delta (stop reason, usage), message_stop. Pings
    while a long prompt prefills; a failure ends with an error event."""

    keepalive = sse_event("ping", {"type": "ping"})

    def __init__(self, model: ServedModel, request: Request, parser: TurnParser):
        self.model, self.request, self.parser = model, request, parser
        self.blocks = _Blocks()

    def start(self) -> list[str]:
        return [sse_event("message_start", {"type": "message_start", "message": {
            "id": self.request.request_id, "type": "message", "role": "assistant", "model": self.model.info.name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(len(self.request.prompt_tokens), 0, 0)}})]

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        return [frame for e in events for frame in self.blocks.feed(e)]

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        reason = stop_reason(finish_of(output), self.parser.called, output.stop_sequence)
        return self.events(events, output, logprobs) + self.blocks.stop() + [
            sse_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": output.stop_sequence},
                "usage": usage(output.prompt_tokens, output.cached_tokens, output.completion_tokens)}),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def error(self, error: APIError) -> list[str]:
        return [sse_event("error", anthropic_error_body(error.status, error.message))]
