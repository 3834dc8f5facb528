"""What every API adapter does around one answer: hold the requested model for
as long as the answer takes (for a stream, until its last event is sent), and
send a stream as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from tierlm.api.model_pool import lease_model
from tierlm.api.openai_turns import turn_error
from tierlm.api.served_model import ServedModel
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
