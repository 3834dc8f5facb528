"""One answer's life, written once for every API: the model held while the
answer is made; the engine's outputs read through the turn's parser into
events; those events framed by the API's `Encoder` as a stream, or gathered
whole. Keep-alives while a long prompt prefills, an error frame instead of
silence, the request aborted when the client leaves: all here, so a fix to
one of them is a fix to every API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from tierlm.api.sse import KEEPALIVE
from tierlm.engine import stages as request_stages
from tierlm.engine.request import FinishReason, Request, RequestOutput
from tierlm.models.model_folder import CHAT
from tierlm.pool.pool import Lease
from tierlm.serving.errors import APIError
from tierlm.serving.leases import lease_model
from tierlm.serving.served_model import ServedModel
from tierlm.structured.events import Event, Gathered
from tierlm.structured.turn import TurnParser

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a whole answer in the making checks its client is still there


def verbatim() -> TurnParser:
    """The parser of an answer taken as it is (a text completion): its text as
    text events, no tool calls, no reasoning."""
    return TurnParser(None, None)


def finish_of(output: RequestOutput) -> str:
    return (output.finish_reason or FinishReason.STOP).value


# ---- the model held ------------------------------------------------------------------


async def with_model(http: HTTPRequest, body, handle: Callable[..., Awaitable], kind: str = CHAT) -> object:
    """`handle(model, body, http)` with the model `body.model` names held: until
    the answer is made, or for a stream until its last frame is sent. `body`
    may carry `keep_alive` (Ollama's: how long the model stays loaded after).
    `kind`: what the route serves (chat, embedding, rerank); a model of another
    kind is a 400 naming its routes."""
    request_stages.mark("read")
    lease = await lease_model(http.app.state.pool, body.model, getattr(body, "keep_alive", None), kind)
    request_stages.mark("model")
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


async def _released_after(frames: AsyncIterator, lease: Lease) -> AsyncIterator:
    try:
        async for frame in frames:
            yield frame
    finally:
        lease.release()


# ---- a whole answer ------------------------------------------------------------------


async def collect(model: ServedModel, request: Request, http: HTTPRequest,
                  parser: TurnParser) -> tuple[RequestOutput, Gathered]:
    """The whole answer: the merged output and its events gathered. A failed
    request raises its error; a client that leaves meanwhile aborts it."""
    output = await _generate_unless_disconnected(model, request, http)
    raise_for_error(output)
    return output, Gathered().add(parser.feed(output.text) + parser.finish())


async def _generate_unless_disconnected(model: ServedModel, request: Request, http: HTTPRequest) -> RequestOutput:
    task = asyncio.create_task(model.engine.generate(request))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()  # stream_outputs' cleanup aborts the request
            raise APIError(499, "client disconnected")


def error_of(output: RequestOutput) -> APIError:
    """A failed request's error as the API answers it, whole or in a stream."""
    if output.error_type == "memory":
        return APIError(400, output.error, "messages", "memory_limit")
    if output.error_type == "overloaded":  # the memory enforcer ended it (tierlm.pool.enforcer)
        return APIError(503, output.error, code="memory_pressure")
    return APIError(500, output.error, code="generation_failed")


def raise_for_error(output: RequestOutput) -> None:
    if output.error is not None:
        raise error_of(output)


# ---- a streamed answer ---------------------------------------------------------------


class Encoder:
    """One API's frames of one streamed answer. The driver (`stream`) calls
    `start`, then `events` for each output, `finish` with the last, and `end`;
    `error` instead of the rest when the request fails, then `end`. Each returns
    the frames to send, in order."""

    keepalive: str | None = KEEPALIVE  # sent while nothing else is (a long prefill)

    def start(self) -> list[str]:
        return []

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        """Frames of new events (none while the parser holds text back).
        `logprobs`: entries of tokens not sent yet, which go with these frames
        (kept for the next ones if there are none)."""
        raise NotImplementedError

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        """Frames of what the parser held back (`events`) and of the end."""
        raise NotImplementedError

    def error(self, error: APIError) -> list[str]:
        raise NotImplementedError

    def end(self) -> list[str]:
        return []


async def stream(model: ServedModel, request: Request, parser: TurnParser, encoder: Encoder,
                 keepalive_s: float | None) -> AsyncIterator[str]:
    """Drive one request and frame its outputs. A keep-alive goes out after each
    `keepalive_s` without an output (None: never); a failure ends with the
    encoder's error frames, never silence; leaving early (client gone) aborts
    the request. Logprobs go with the text of their tokens: those of tokens
    whose text is held back (a partial character, a possible stop string, a
    tool call's markup) wait for the next frames, or the final ones."""
    for frame in encoder.start():
        yield frame
    outputs = model.engine.stream_outputs(request, keepalive_s=keepalive_s)
    held: list | None = None
    try:
        async for output in outputs:
            if output is None:
                yield encoder.keepalive
                continue
            if "deliver" not in request.stages.ends:
                request.stages.mark("deliver")
            if output.error is not None:
                for frame in encoder.error(error_of(output)):
                    yield frame
                break
            if output.logprobs:
                held = output.logprobs if held is None else held + output.logprobs
            frames = encoder.events(parser.feed(output.text) if output.text else [], output, held)
            if frames:
                held = None
            if output.finished:
                frames += encoder.finish(parser.finish(), output, held)
            for frame in frames:
                yield frame
        for frame in encoder.end():
            yield frame
    except Exception as e:  # a bug: the stream still ends with an error, never silence
        log.exception("stream of %s failed", request.request_id)
        for frame in encoder.error(APIError(500, f"internal error: {type(e).__name__}",
                                            code="internal_error")) + encoder.end():
            yield frame
    finally:
        await outputs.aclose()  # aborts the request if it has not finished


def sse_response(frames: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers)
