"""What every API adapter does around one answer: hold the requested model for
as long as the answer takes (for a stream, until its last event is sent), and
send a stream as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from tierlm.api.model_pool import lease_model
from tierlm.pool.pool import Lease


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


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
