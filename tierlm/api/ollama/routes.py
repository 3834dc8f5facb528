"""Ollama's API, for the many apps that speak only it (editors, chat front ends,
note-taking plugins): /api/chat and /api/generate, streamed as Ollama streams
(one JSON object a line, `done` on the last, with token counts and durations
in nanoseconds) or whole; /api/tags, /api/ps and /api/show on the pool's
models; /api/version. Errors take Ollama's shape, {"error": "..."}
(api/errors.py). The answers are the same engine's, through the same chat
template, tools, grammars and reasoning split as the OpenAI routes."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from tierlm.api.answer import Encoder, collect, finish_of, stream, verbatim, with_model
from tierlm.api.chat_body import ChatCompletionRequest
from tierlm.api.ollama import turns as ollama
from tierlm.api.ollama.schemas import OllamaBody, OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from tierlm.api.turns import chat_turn, completion_tokens, make_completion
from tierlm.config import parse_duration
from tierlm.engine.request import Request, RequestOutput
from tierlm.models.model_folder import CHAT
from tierlm.pool.pool import ModelPool, Slot
from tierlm.serving.errors import APIError
from tierlm.serving.fill_in_middle import find_format
from tierlm.serving.leases import slot_of, turns_for
from tierlm.serving.served_model import ServedModel
from tierlm.structured.events import Event, Gathered, ReasoningDelta, TextDelta
from tierlm.structured.turn import TurnParser

router = APIRouter(prefix="/api")

# the Ollama API version whose shapes these routes follow (clients check it for features)
OLLAMA_API_VERSION = "0.12.0"


@router.get("/version")
async def version():
    return {"version": OLLAMA_API_VERSION}


# ---- models -----------------------------------------------------------------------


def _pool(http: HTTPRequest) -> ModelPool:
    return http.app.state.pool


def _card(slot: Slot) -> dict:
    entry = slot.entry
    return {"name": entry.name, "model": entry.name, "modified_at": ollama.iso(entry.created),
            "size": entry.size_bytes, "digest": ollama.digest(entry), "details": ollama.details(entry)}


@router.get("/tags")
async def tags(http: HTTPRequest):
    pool = _pool(http)
    pool.refresh()  # a model pulled, copied in or deleted since
    return {"models": [_card(slot) for _, slot in sorted(pool.slots.items())]}


@router.get("/ps")
async def ps(http: HTTPRequest):
    """The loaded models; `expires_at` far ahead for one that stays (pinned, or kept forever)."""
    loaded = []
    for _, slot in sorted(_pool(http).slots.items()):
        if slot.served is None:
            continue
        expires = slot.unload_at - time.monotonic() + time.time() if slot.unload_at is not None else 4e9
        loaded.append({**_card(slot), "expires_at": ollama.iso(expires), "size_vram": slot.memory_bytes,
                       "size": slot.memory_bytes, "context_length": slot.served.context})
    return {"models": loaded}


@router.post("/show")
async def show(body: OllamaShowRequest, http: HTTPRequest):
    """What a model is, without loading it: its context length (what clients
    size their prompts by), its chat template and what it can do."""
    pool = http.app.state.pool
    entry = slot_of(pool, body.model or body.name).entry
    if entry.kind != CHAT:  # an encoder: Ollama says "embedding" (and we "rerank")
        return {"modelfile": "", "parameters": "", "license": "", "template": "",
                "details": ollama.details(entry), "modified_at": ollama.iso(entry.created),
                "model_info": {"general.architecture": entry.model_type,
                               f"{entry.model_type}.context_length": entry.context_length},
                "capabilities": [entry.kind]}
    entry, turns, settings = await turns_for(pool, body.model or body.name)
    capabilities = ["completion"]
    if turns.format.native:
        capabilities.append("tools")
    if turns.markers is not None:
        capabilities.append("thinking")
    if await asyncio.to_thread(find_format, turns.tokenizer) is not None:
        capabilities.append("insert")  # fill in the middle: /api/generate's suffix
    context = settings.context_limit or entry.context_length
    return {"modelfile": "", "parameters": "", "license": "",
            "template": getattr(turns.tokenizer, "chat_template", None) or "",
            "details": ollama.details(entry), "modified_at": ollama.iso(entry.created),
            "model_info": {"general.architecture": entry.model_type,
                           f"{entry.model_type}.context_length": context},
            "capabilities": capabilities}


# ---- answers ----------------------------------------------------------------------


@router.post("/chat")
async def chat(body: OllamaChatRequest, http: HTTPRequest):
    return await with_model(http, body, _chat)


async def _chat(model: ServedModel, body: OllamaChatRequest, http: HTTPRequest):
    started = time.monotonic()
    if not body.messages:
        return _loaded(model, body, http, "message")
    return await _templated(model, ollama.chat_request(body), http, body.stream, started, "message")


@router.post("/generate")
async def generate(body: OllamaGenerateRequest, http: HTTPRequest):
    return await with_model(http, body, _generate)


async def _generate(model: ServedModel, body: OllamaGenerateRequest, http: HTTPRequest):
    """The prompt through the chat template (with `system`), or as it is (`raw`),
    or filled in before `suffix`."""
    started = time.monotonic()
    if body.images:
        raise APIError(400, "image inputs are not supported by this server's models; send text",
                       "images", "unsupported")
    if not body.prompt and not body.suffix:
        return _loaded(model, body, http, "response")
    if body.raw or body.suffix:
        request_body = ollama.completion_request(body)
        tokens = await asyncio.to_thread(completion_tokens, model, request_body)
        request = make_completion(model, request_body, tokens, request_body.max_tokens)
        return await _answer(model, request, http, verbatim(), body.stream, started, "response")
    return await _templated(model, ollama.generate_chat_request(body), http, body.stream, started, "response")


async def _templated(model: ServedModel, body: ChatCompletionRequest, http: HTTPRequest, stream: bool,
                     started: float, kind: str):
    """An answer to messages through the chat template, as the chat route makes it."""
    request, turn = await chat_turn(model, body, False)
    return await _answer(model, request, http, turn.parser, stream, started, kind)


def _loaded(model: ServedModel, body: OllamaBody, http: HTTPRequest, kind: str) -> dict:
    """A request with nothing to answer loads the model (the lease did), or with
    keep_alive 0 unloads it once answered (a pinned model stays), as Ollama's
    clients use it."""
    slot = _pool(http).slots.get(model.info.name)
    pinned = slot is not None and slot.pinned
    unloading = body.keep_alive is not None and parse_duration(body.keep_alive) == 0 and not pinned
    return {**_head(model), **_piece(kind, Gathered()), "done": True,
            "done_reason": "unload" if unloading else "load"}


async def _answer(model: ServedModel, request: Request, http: HTTPRequest, parser: TurnParser,
                  stream_it: bool, started: float, kind: str):
    if stream_it:
        lines = stream(model, request, parser, OllamaLines(model, started, kind), keepalive_s=None)
        return StreamingResponse(lines, media_type="application/x-ndjson")
    output, gathered = await collect(model, request, http, parser)
    return {**_head(model), **_piece(kind, gathered), **_done(output, output.first_token_time, started)}


class OllamaLines(Encoder):
    """The answer as Ollama streams it: a line per piece of text or thinking,
    the tool calls whole once the answer ends, then the line that is `done`. A
    failure ends with a line holding `error`."""

    keepalive = None  # Ollama's clients read lines: nothing is sent while a prompt prefills

    def __init__(self, model: ServedModel, started: float, kind: str):
        self.model, self.started, self.kind = model, started, kind
        self.calls, self.first = Gathered(), None

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        self.first = self.first or output.first_token_time
        return [_line({**_head(self.model), **_piece(self.kind, piece), "done": False})
                for piece in _pieces(events, self.calls)]

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        lines = self.events(events, output, logprobs)
        if self.calls.tool_calls:
            lines.append(_line({**_head(self.model), **_piece(self.kind, self.calls), "done": False}))
        done = _done(output, self.first, self.started)
        return lines + [_line({**_head(self.model), **_piece(self.kind, Gathered()), **done})]

    def error(self, error: APIError) -> list[str]:
        return [_line({"error": error.message})]


def _pieces(events: list[Event], calls: Gathered) -> list[Gathered]:
    """Text and thinking as pieces to send now; tool calls gathered in `calls`."""
    pieces = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            pieces.append(Gathered().add([event]))
        else:  # a call starts, or a piece of its arguments
            calls.add([event])
    return pieces


def _head(model: ServedModel) -> dict:
    return {"model": model.info.name, "created_at": ollama.now()}


def _piece(kind: str, turn: Gathered) -> dict:
    """A chat's message, or generate's response (and thinking)."""
    if kind == "message":
        return {"message": ollama.message_of(turn)}
    return {"response": turn.content, **({"thinking": turn.reasoning} if turn.reasoning else {})}


def _done(output: RequestOutput, first: float | None, started: float) -> dict:
    end = time.monotonic()
    first = first or end

    def ns(seconds: float) -> int:
        return int(max(0.0, seconds) * 1e9)

    return {"done": True, "done_reason": ollama.done_reason(finish_of(output)),
            "total_duration": ns(end - started), "load_duration": 0,
            "prompt_eval_count": output.prompt_tokens, "prompt_eval_duration": ns(first - started),
            "eval_count": output.completion_tokens, "eval_duration": ns(end - first)}


def _line(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"
