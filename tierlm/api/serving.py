"""What every API adapter does around one answer: hold the requested model for
as long as the answer takes (for a stream, until its last event is sent), and
send a stream as server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from tierlm.api.model_pool import lease_model
from tierlm.api.openai_schemas import ChatCompletionRequest
from tierlm.api.openai_turns import render_chat, turn_error, turn_spec
from tierlm.api.served_model import ServedModel
from tierlm.engine.request import Request
from tierlm.pool.pool import Lease
from tierlm.structured.tools import TurnError
from tierlm.structured.turn import TurnRun, TurnSpec


async def with_model(http: HTTPRequest, body, handle: Callable[..., Awaitable]) -> object:
    """`handle(model, body, http)` with the model `body.model` names held: until
    the answer is made, or for a stream until its last chunk is sent. `body`
    may carry `keep_alive` (Ollama's: how long the model stays loaded after)."""
    lease = await lease_model(http, body.model, getattr(body, "keep_alive", None))
    try:
        result = await handle(lease.served, body, http)
    except BaseException:
        lease.release()
        raise
    if isinstance(result, StreamingResponse):
        result.body_iterator = _released_after(result.body_iterator, lease)
    else:
        lease.release()
    return result


async def _released_after(chunks: AsyncIterator, lease: Lease) -> AsyncIterator:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        lease.release()


async def chat_turn(model: ServedModel, body: ChatCompletionRequest,
                    allow_client_template: bool) -> tuple[Request, TurnRun]:
    """A chat body's request and its turn (constraint, parser): the prompt
    rendered by the chat template and the grammar compiled, off the event loop."""
    spec = turn_spec(body)
    tokens = await asyncio.to_thread(render_chat, model, body, spec, allow_client_template)
    turn = await asyncio.to_thread(start_turn, model, spec, tokens)
    request = model.make_request("chatcmpl", tokens, body, body.max_completion_tokens or body.max_tokens,
                                 logprobs=body.logprobs_count, constraint=turn.constraint)
    return request, turn


def start_turn(model: ServedModel, spec: TurnSpec, tokens: list[int]) -> TurnRun:
    """The turn's constraint and parser for this prompt (compiling a grammar can
    take a while: call off the event loop); a turn that cannot be is a 400."""
    try:
        return model.turns.start(spec, tokens)
    except TurnError as e:
        raise turn_error(e) from e


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
