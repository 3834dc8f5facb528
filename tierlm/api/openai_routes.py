"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.api.errors import error_body
from tierlm.api.openai_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from tierlm.api.openai_turns import (
    completion_tokens,
    delta_of,
    finish_reason,
    make_completion,
    message_of,
    single_prompt,
)
from tierlm.api.served_model import ServedModel, error_of, raise_for_error, usage
from tierlm.api.serving import chat_turn, sse_response, with_model
from tierlm.api.sse import DONE, KEEPALIVE, sse_data
from tierlm.engine.request import FinishReason, Request, RequestOutput, TokenLogprobs
from tierlm.structured.events import Gathered
from tierlm.structured.turn import TurnParser

router = APIRouter(prefix="/v1")
log = logging.getLogger(__name__)


# ---- chat completions -------------------------------------------------------


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    return await with_model(http, body, _chat)


async def _chat(model: ServedModel, body: ChatCompletionRequest, http: HTTPRequest):
    request, turn = await chat_turn(model, body, http.app.state.settings.allow_client_chat_template)
    if body.stream:
        return sse_response(_chat_chunks(model, request, body, http, turn.parser))
    output = await model.generate_unless_disconnected(request, http)
    raise_for_error(output)
    gathered = Gathered().add(turn.parser.feed(output.text) + turn.parser.finish())
    return {
        "id": request.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model.info.name,
        "choices": [{
            "index": 0,
            "message": message_of(gathered),
            "logprobs": _chat_logprobs(model, output.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason(_finish(output), turn.parser.called),
        }],
        "usage": usage(output),
    }


def _chat_chunks(model, request, body, http, parser: TurnParser) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
        return {
            "id": request.request_id, "object": "chat.completion.chunk", "created": created,
            "model": model.info.name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": None if logprobs is None else _chat_logprobs(model, logprobs)}],
        }

    def chunks(events: list, logprobs: list | None) -> list[dict]:
        """One chunk per event; the tokens' logprobs go with the first."""
        out = [chunk(delta_of(e)) for e in events]
        if out and body.logprobs:
            out[0]["choices"][0]["logprobs"] = _chat_logprobs(model, logprobs or [])
        return out

    def final(out: RequestOutput, logprobs: list | None) -> list[dict]:
        """What the parser held back, then the finish; entries not sent yet go
        with the first of them."""
        held = chunks(parser.finish(), logprobs)
        return [*held, chunk({}, finish_reason(_finish(out), parser.called), None if held else logprobs)]

    return _stream(
        model, request, body, http,
        first=chunk({"role": "assistant", "content": ""}),
        pieces=lambda text, logprobs: chunks(parser.feed(text), logprobs),
        final=final,
        usage_chunk=lambda out: {**chunk({}), "choices": [], "usage": usage(out)},
    )


def _chat_logprobs(model: ServedModel, entries: list[TokenLogprobs] | None) -> dict:
    """OpenAI's chat `logprobs`: one entry per generated token, each with its top
    alternatives (`top_logprobs`, most likely first; empty when 0 were asked)."""
    return {
        "content": [{**_token_logprob(model, token, logprob),
                     "top_logprobs": [_token_logprob(model, t, lp) for t, lp in alternatives]}
                    for token, logprob, alternatives in entries or ()],
        "refusal": None,
    }


def _token_logprob(model: ServedModel, token: int, logprob: float) -> dict:
    data = model.token_bytes(token)
    return {"token": _token_text(data), "logprob": logprob, "bytes": list(data)}


def _token_text(data: bytes) -> str:
    """A token's text; bytes that are part of a UTF-8 character (byte-level BPE
    splits some) as escapes, `\\xe2`, as OpenAI shows them."""
    return data.decode("utf-8", "backslashreplace")


# ---- text completions -------------------------------------------------------


def _prompt_text(model: ServedModel, prompt, tokens: list[int]) -> str:
    """The prompt as text, for `echo`; token ids are decoded once validated."""
    prompt = single_prompt(prompt)
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(tokens)


@router.post("/completions")
async def completions(body: CompletionRequest, http: HTTPRequest):
    return await with_model(http, body, _completion)


async def _completion(model: ServedModel, body: CompletionRequest, http: HTTPRequest):
    tokens = await asyncio.to_thread(completion_tokens, model, body)
    request = make_completion(model, body, tokens, body.max_tokens or model.settings.default_max_tokens or 16)
    echo = _prompt_text(model, body.prompt, tokens) if body.echo else ""
    if body.stream:
        return sse_response(_completion_chunks(model, request, body, http, echo))
    output = await model.generate_unless_disconnected(request, http)
    raise_for_error(output)
    return {
        "id": request.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.info.name,
        "choices": [{
            "index": 0,
            "text": echo + output.text,
            "logprobs": None if body.logprobs is None else _LegacyLogprobs(model)(output.logprobs),
            "finish_reason": _finish(output),
        }],
        "usage": usage(output),
    }


def _completion_chunks(model, request, body, http, echo: str) -> AsyncIterator[str]:
    created = int(time.time())
    legacy = None if body.logprobs is None else _LegacyLogprobs(model)  # text offsets run on across chunks

    def chunk(text: str, finish: str | None = None, logprobs: list | None = None) -> dict:
        return {
            "id": request.request_id, "object": "text_completion", "created": created,
            "model": model.info.name,
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "logprobs": None if legacy is None or logprobs is None else legacy(logprobs)}],
        }

    asked = [] if legacy is not None else None
    return _stream(
        model, request, body, http,
        first=chunk(echo) if echo else None,
        pieces=lambda text, logprobs: [chunk(text, logprobs=logprobs or asked)],
        final=lambda out, logprobs: [chunk("", _finish(out), logprobs)],
        usage_chunk=lambda out: {**chunk(""), "choices": [], "usage": usage(out)},
    )


class _LegacyLogprobs:
    """The completions API's `logprobs` (tokens, token_logprobs, top_logprobs,
    text_offset), for the whole text or chunk by chunk: each token's offset is
    where its first character starts in the completion's text (a token that begins
    inside a character split across tokens gets that character's offset).
    `top_logprobs` maps the n most likely tokens, and always the chosen one (up to
    n + 1 entries, as OpenAI's)."""

    def __init__(self, model: ServedModel, offset: int = 0):
        self.model, self.offset = model, offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, entries: list[TokenLogprobs] | None) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token, logprob, alternatives in entries or ():
            data = self.model.token_bytes(token)
            text = _token_text(data)
            top = {_token_text(self.model.token_bytes(t)): lp for t, lp in alternatives}
            top.setdefault(text, logprob)
            tokens.append(text)
            token_logprobs.append(logprob)
            top_logprobs.append(top)
            text_offset.append(self.offset)
            self.offset += len(self._utf8.decode(data))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


# ---- shared streaming -------------------------------------------------------


def _finish(output: RequestOutput) -> str:
    return (output.finish_reason or FinishReason.STOP).value


async def _stream(
    model: ServedModel,
    request: Request,
    body: SamplingFields,
    http: HTTPRequest,
    first: dict | None,
    pieces: Callable[[str, list | None], list[dict]],
    final: Callable[[RequestOutput, list | None], list[dict]],
    usage_chunk: Callable[[RequestOutput], dict],
) -> AsyncIterator[str]:
    """Drive one request and frame its outputs as SSE. Keep-alive comments go out
    while a long prompt is prefilling; a failure ends with an error event, never
    silence; leaving early (client gone) aborts the request. `pieces` frames new
    text as chunks (none while a parser holds it back). Logprobs go with the text
    of their tokens; those of tokens whose text is held back (a partial character,
    a possible stop string, a tool call's markup) wait for the next chunk, or the
    final ones."""
    keepalive = http.app.state.settings.sse_keepalive_s
    outputs = model.engine.stream_outputs(request, keepalive_s=keepalive)
    if first is not None:
        yield sse_data(first)
    logprobs: list | None = None  # entries not yet sent
    try:
        async for output in outputs:
            if output is None:
                yield KEEPALIVE
                continue
            if output.error is not None:
                yield sse_data(error_of(output).body())
                break
            if output.logprobs:
                logprobs = output.logprobs if logprobs is None else logprobs + output.logprobs
            if output.text and (framed := pieces(output.text, logprobs)):
                for data in framed:
                    yield sse_data(data)
                logprobs = None
            if output.finished:
                for data in final(output, logprobs):
                    yield sse_data(data)
                if body.stream_options and body.stream_options.include_usage:
                    yield sse_data(usage_chunk(output))
        yield DONE
    except Exception as e:  # a bug: the stream still ends with an error event, never silence
        log.exception("stream of %s failed", request.request_id)
        yield sse_data(error_body(500, f"internal error: {type(e).__name__}", code="internal_error"))
        yield DONE
    finally:
        await outputs.aclose()  # aborts the request if it has not finished
