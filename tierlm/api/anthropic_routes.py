"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens, what
Claude Code and the `anthropic` SDK speak. Errors on these paths take
Anthropic's shape (api/errors.py)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from tierlm.api.anthropic_turns import chat_messages, content_blocks, stop_reason, turn_spec, usage
from tierlm.api.errors import APIError, anthropic_error_body
from tierlm.api.model_pool import turns_for
from tierlm.api.openai_schemas import SamplingFields
from tierlm.api.openai_turns import turn_error
from tierlm.api.served_model import ServedModel, error_of, raise_for_error
from tierlm.api.serving import sse_response, start_turn, with_model
from tierlm.api.sse import sse_event
from tierlm.api.templates import render_chat_template
from tierlm.config import Settings
from tierlm.engine.request import FinishReason, Request
from tierlm.structured.events import Event, Gathered, ReasoningDelta, TextDelta, ToolCallStart
from tierlm.structured.tools import TurnError
from tierlm.structured.turn import ModelTurns, TurnParser, TurnSpec

router = APIRouter(prefix="/v1")
log = logging.getLogger(__name__)

PING_EVERY_S = 10.0  # at most this long without an event, or agents give up on the server


@router.post("/messages")
async def messages(body: MessagesRequest, http: HTTPRequest):
    return await with_model(http, body, _message)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, http: HTTPRequest):
    """The prompt's true length, rendered as /v1/messages would render it, with the
    tokenizer alone: no model is loaded and no engine is asked."""
    _, turns, settings = await turns_for(http, body.model)
    tokens = await asyncio.to_thread(_render, turns, settings, body, turn_spec(body))
    return {"input_tokens": len(tokens)}


async def _message(model: ServedModel, body: MessagesRequest, http: HTTPRequest):
    spec = turn_spec(body)
    tokens = await asyncio.to_thread(_render, model.turns, model.settings, body, spec)
    if model.prompt_too_long(len(tokens)):
        raise _prompt_too_long(len(tokens), model.context)
    turn = await asyncio.to_thread(start_turn, model, spec, tokens)
    max_tokens = model.within_context(len(tokens), body.max_tokens)
    request = model.make_request("msg", tokens, _sampling(body), max_tokens, constraint=turn.constraint)
    if body.stream:
        return sse_response(_events(model, request, http, turn.parser))
    output = await model.generate_unless_disconnected(request, http)
    raise_for_error(output)
    gathered = Gathered().add(turn.parser.feed(output.text) + turn.parser.finish())
    finish = (output.finish_reason or FinishReason.STOP).value
    return {
        "id": request.request_id,
        "type": "message",
        "role": "assistant",
        "model": model.info.name,
        "content": content_blocks(gathered),
        "stop_reason": stop_reason(finish, turn.parser.called, output.stop_sequence),
        "stop_sequence": output.stop_sequence,
        "usage": usage(output.prompt_tokens, output.cached_tokens, output.completion_tokens),
    }


def _prompt_too_long(prompt_tokens: int, context: int) -> APIError:
    """In Anthropic's own words: Claude Code reads both numbers from this message
    and compacts the conversation to fit, where it would otherwise assume the
    200k-token context of its own models and fail at every turn from here."""
    return APIError(400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum", "messages",
                    "context_length_exceeded")


def _render(turns: ModelTurns, settings: Settings, body: CountTokensRequest, spec: TurnSpec) -> list[int]:
    volatile = [re.compile(p) for p in settings.volatile_prompt_blocks]
    try:
        messages, variables = turns.prepare(spec, chat_messages(body, volatile))
    except TurnError as e:
        raise turn_error(e) from e
    kwargs = {**settings.template_kwargs(), **variables}
    if spec.max_thinking_tokens == 0:
        kwargs.setdefault("enable_thinking", False)  # templates with a switch (Qwen 3's) leave thinking out
    return render_chat_template(turns.tokenizer, messages, kwargs, None, False)


def _sampling(body: MessagesRequest) -> SamplingFields:
    """Anthropic's sampling fields as the engine's common ones."""
    return SamplingFields(model=body.model, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, stop=body.stop_sequences, seed=body.seed, keep_alive=body.keep_alive)


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


async def _events(model: ServedModel, request: Request, http: HTTPRequest, parser: TurnParser) -> AsyncIterator[str]:
    """The message as Anthropic streams it: message_start, content blocks as they
    are generated, message_delta (stop reason, usage), message_stop. Pings go out
    while a long prompt prefills; a failure ends with an error event."""
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": request.request_id, "type": "message", "role": "assistant", "model": model.info.name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": usage(len(request.prompt_tokens), 0, 0)}})
    keepalive = min(http.app.state.settings.sse_keepalive_s, PING_EVERY_S)
    outputs = model.engine.stream_outputs(request, keepalive_s=keepalive)
    blocks = _Blocks()
    try:
        async for output in outputs:
            if output is None:
                yield sse_event("ping", {"type": "ping"})
                continue
            if output.error is not None:
                error = error_of(output)
                yield sse_event("error", anthropic_error_body(error.status, error.message))
                return
            for event in parser.feed(output.text) if output.text else ():
                for data in blocks.feed(event):
                    yield data
            if output.finished:
                for data in [d for e in parser.finish() for d in blocks.feed(e)] + blocks.stop():
                    yield data
                finish = (output.finish_reason or FinishReason.STOP).value
                yield sse_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(finish, parser.called, output.stop_sequence),
                              "stop_sequence": output.stop_sequence},
                    "usage": usage(output.prompt_tokens, output.cached_tokens, output.completion_tokens)})
                yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as e:  # a bug: the stream still ends with an error event, never silence
        log.exception("stream of %s failed", request.request_id)
        yield sse_event("error", anthropic_error_body(500, f"internal error: {type(e).__name__}"))
    finally:
        await outputs.aclose()  # aborts the request if it has not finished
