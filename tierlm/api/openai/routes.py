"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import codecs
import time

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.api.answer import Encoder, collect, finish_of, sse_response, stream, verbatim, with_model
from tierlm.api.chat_body import ChatCompletionRequest, CompletionRequest
from tierlm.api.errors import error_body
from tierlm.api.openai.shape import delta_of, finish_reason, message_of, usage
from tierlm.api.sse import DONE, sse_data
from tierlm.api.turns import chat_turn, completion_tokens, make_completion, single_prompt
from tierlm.engine.request import Request, RequestOutput, TokenLogprobs
from tierlm.serving.errors import APIError
from tierlm.serving.served_model import ServedModel
from tierlm.structured.events import Event
from tierlm.structured.turn import TurnParser

router = APIRouter(prefix="/v1")


# ---- chat completions -------------------------------------------------------


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    return await with_model(http, body, _chat)


async def _chat(model: ServedModel, body: ChatCompletionRequest, http: HTTPRequest):
    request, turn = await chat_turn(model, body, http.app.state.settings.allow_client_chat_template)
    if body.stream:
        encoder = ChatChunks(model, request, body, turn.parser)
        return sse_response(stream(model, request, turn.parser, encoder, http.app.state.settings.sse_keepalive_s))
    output, gathered = await collect(model, request, http, turn.parser)
    return {
        "id": request.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model.info.name,
        "choices": [{
            "index": 0,
            "message": message_of(gathered),
            "logprobs": _chat_logprobs(model, output.logprobs) if body.logprobs else None,
            "finish_reason": finish_reason(finish_of(output), turn.parser.called),
        }],
        "usage": usage(output),
    }


class OpenAIChunks(Encoder):
    """What both OpenAI streams share: an error as an error chunk, then `[DONE]`;
    the usage chunk when `stream_options.include_usage` asks for it."""

    def __init__(self, model: ServedModel, request: Request, body):
        self.model, self.request, self.body = model, request, body
        self.created = int(time.time())

    def error(self, error: APIError) -> list[str]:
        return [sse_data(error_body(error.status, error.message, error.param, error.code))]

    def end(self) -> list[str]:
        return [DONE]

    def usage_frames(self, output: RequestOutput, empty: dict) -> list[str]:
        options = self.body.stream_options
        return [sse_data({**empty, "choices": [], "usage": usage(output)})] \
            if options and options.include_usage else []


class ChatChunks(OpenAIChunks):
    """chat.completion.chunk frames: the role first, a chunk per event, the
    finish reason last."""

    def __init__(self, model: ServedModel, request: Request, body: ChatCompletionRequest, parser: TurnParser):
        super().__init__(model, request, body)
        self.parser = parser

    def chunk(self, delta: dict, finish: str | None = None, logprobs: list | None = None) -> dict:
        return {
            "id": self.request.request_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model.info.name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": None if logprobs is None else _chat_logprobs(self.model, logprobs)}],
        }

    def start(self) -> list[str]:
        return [sse_data(self.chunk({"role": "assistant", "content": ""}))]

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        return [sse_data(c) for c in self._chunks(events, logprobs)]

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        """What the parser held back, then the finish; entries not sent yet go
        with the first of them."""
        held = self._chunks(events, logprobs)
        reason = finish_reason(finish_of(output), self.parser.called)
        last = self.chunk({}, reason, None if held else logprobs)
        return [sse_data(c) for c in [*held, last]] + self.usage_frames(output, self.chunk({}))

    def _chunks(self, events: list[Event], logprobs: list | None) -> list[dict]:
        """One chunk per event; the tokens' logprobs go with the first."""
        out = [self.chunk(delta_of(e)) for e in events]
        if out and self.body.logprobs:
            out[0]["choices"][0]["logprobs"] = _chat_logprobs(self.model, logprobs or [])
        return out


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
        encoder = CompletionChunks(model, request, body, echo)
        return sse_response(stream(model, request, verbatim(), encoder, http.app.state.settings.sse_keepalive_s))
    output, _ = await collect(model, request, http, verbatim())
    return {
        "id": request.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.info.name,
        "choices": [{
            "index": 0,
            "text": echo + output.text,
            "logprobs": None if body.logprobs is None else _LegacyLogprobs(model)(output.logprobs),
            "finish_reason": finish_of(output),
        }],
        "usage": usage(output),
    }


class CompletionChunks(OpenAIChunks):
    """text_completion frames: the echoed prompt first, the text as it comes,
    the finish reason last."""

    def __init__(self, model: ServedModel, request: Request, body: CompletionRequest, echo: str):
        super().__init__(model, request, body)
        self.echo = echo
        self.legacy = None if body.logprobs is None else _LegacyLogprobs(model)  # offsets run on across chunks

    def chunk(self, text: str, finish: str | None = None, logprobs: list | None = None) -> dict:
        return {
            "id": self.request.request_id, "object": "text_completion", "created": self.created,
            "model": self.model.info.name,
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "logprobs": None if self.legacy is None or logprobs is None else self.legacy(logprobs)}],
        }

    def start(self) -> list[str]:
        return [sse_data(self.chunk(self.echo))] if self.echo else []

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        if not events:
            return []
        asked = [] if self.legacy is not None else None
        return [sse_data(self.chunk("".join(e.text for e in events), logprobs=logprobs or asked))]

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        return [sse_data(self.chunk("", finish_of(output), logprobs))] + self.usage_frames(output, self.chunk(""))


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
