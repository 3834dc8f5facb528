"""The OpenAI Responses API (what Codex CLI speaks): POST /v1/responses, and
GET / DELETE /v1/responses/{id} for the answers kept for previous_response_id.

One adapter: the body is read into chat messages and a TurnSpec
(responses/turns.py), rendered and generated as a chat completion is, and
the turn's events written back as output items, whole or streamed
(responses/stream.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.api.answer import Encoder, collect, sse_response, stream, with_model
from tierlm.api.responses.schemas import ResponsesRequest
from tierlm.api.responses.store import ResponseStore, StoredResponse
from tierlm.api.responses.stream import StreamWriter
from tierlm.api.responses.turns import (
    Tools,
    chat_messages,
    input_items,
    output_items,
    read_tools,
    turn_error,
    turn_spec,
    wants_no_thinking,
)
from tierlm.api.turns import render_turn, start_turn
from tierlm.engine.request import FinishReason, Request, RequestOutput
from tierlm.serving.errors import APIError
from tierlm.serving.served_model import ServedModel
from tierlm.structured.events import Event
from tierlm.structured.turn import TurnRun, TurnSpec

router = APIRouter(prefix="/v1")

# this API's names of the engine's fields, for the errors that name them
_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}


@router.post("/responses")
async def create_response(body: ResponsesRequest, http: HTTPRequest):
    return await with_model(http, body, _respond)


@router.get("/responses/{response_id}")
async def get_response(response_id: str, http: HTTPRequest):
    return _stored(http, response_id, "response_id").response


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, http: HTTPRequest):
    _stored(http, response_id, "response_id")
    _store(http).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _store(http: HTTPRequest) -> ResponseStore:
    """The app's store, made on first use."""
    state = http.app.state
    if getattr(state, "response_store", None) is None:
        state.response_store = ResponseStore(state.settings.response_store_size)
    return state.response_store


def _stored(http: HTTPRequest, response_id: str, param: str, status: int = 404) -> StoredResponse:
    """A kept response; 404 for the routes that name it in their path, 400 (as
    OpenAI's) for a previous_response_id in a body."""
    stored = _store(http).get(response_id)
    if stored is None:
        code = "previous_response_not_found" if param == "previous_response_id" else "response_not_found"
        raise APIError(status, f"Response with id '{response_id}' not found (this server keeps the most "
                       "recent responses in memory, none sent with store: false).", param, code)
    return stored


# ---- one answer ------------------------------------------------------------------


@dataclass
class Answer:
    """What every shape of this answer repeats: its id, the request's settings."""

    id: str
    model: str
    body: ResponsesRequest
    tools: Tools
    created_at: int

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": (body.reasoning or {}).get("summary")},
            "store": body.stored, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": "disabled", "user": body.user, "background": False,
        }


def _usage(model: ServedModel, output: RequestOutput, reasoning: str) -> dict:
    reasoning_tokens = len(model.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {
        "input_tokens": output.prompt_tokens,
        "input_tokens_details": {"cached_tokens": output.cached_tokens},
        "output_tokens": output.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output.completion_tokens)},
        "total_tokens": output.prompt_tokens + output.completion_tokens,
    }


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == FinishReason.LENGTH else "completed"


async def _respond(model: ServedModel, body: ResponsesRequest, http: HTTPRequest):
    store = _store(http)
    earlier = _stored(http, body.previous_response_id, "previous_response_id", 400).items \
        if body.previous_response_id else []
    items = input_items(body)
    tools = read_tools(body.tools)
    spec = turn_spec(body, tools, model.turns.markers is not None)
    request, turn = await asyncio.to_thread(_turn_request, model, body, spec, tools, earlier, items)  # one hand-off
    answer = Answer("resp_" + request.request_id.partition("-")[2], model.info.name, body, tools, int(time.time()))
    conversation = [*earlier, *items]
    if body.stream:
        encoder = ResponseEvents(model, turn, answer, conversation, store)
        return sse_response(stream(model, request, turn.parser, encoder, http.app.state.settings.sse_keepalive_s))
    output, gathered = await collect(model, request, http, turn.parser)
    status = _status(output)
    response = answer.response(status, output_items(gathered, tools, status),
                               _usage(model, output, gathered.reasoning))
    _keep(store, response, conversation)
    return response


def _turn_request(model: ServedModel, body: ResponsesRequest, spec: TurnSpec, tools: Tools,
                  earlier: list[dict], items: list[dict]) -> tuple[Request, TurnRun]:
    """The prompt rendered, the turn's grammar compiled and the request made."""
    tokens = _render(model, body, spec, tools, earlier, items)
    turn = start_turn(model, spec, tokens, lambda e: turn_error(e, tools))
    return model.make_request("resp", tokens, body.sampling(), body.max_output_tokens,
                              constraint=turn.constraint, names=_NAMES, tokenized=True), turn


def _render(model: ServedModel, body: ResponsesRequest, spec: TurnSpec, tools: Tools,
            earlier: list[dict], items: list[dict]) -> list[int]:
    messages = chat_messages(body.instructions, earlier, items)
    # effort none / minimal: Qwen3-style templates then write an empty section
    variables = {"enable_thinking": False} if wants_no_thinking(body) and model.turns.markers is not None else None
    return render_turn(model.turns, model.settings, spec, messages, variables,
                       error=lambda e: turn_error(e, tools), messages_param="input")


def _keep(store: ResponseStore, response: dict, conversation: list[dict]) -> None:
    if response["store"]:
        store.put(response, conversation)


# ---- a streamed answer -------------------------------------------------------------


class ResponseEvents(Encoder):
    """The answer as Responses stream events: created and in progress first,
    each output item opened, grown and closed (StreamWriter), then completed or
    incomplete; a failure ends with `error` and `response.failed`."""

    def __init__(self, model: ServedModel, turn: TurnRun, answer: Answer, conversation: list[dict],
                 store: ResponseStore):
        self.model, self.turn, self.answer, self.conversation, self.store = model, turn, answer, conversation, store
        self.writer = StreamWriter(answer.tools)

    def start(self) -> list[str]:
        return [self.writer.event(kind, response=self.answer.response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def events(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        return self.writer.feed(events)

    def finish(self, events: list[Event], output: RequestOutput, logprobs: list | None) -> list[str]:
        return _completed(self.model, self.writer, events, self.answer, output, self.conversation, self.store)

    def error(self, error: APIError) -> list[str]:
        return _failed(self.writer, self.answer, error)


def _completed(model: ServedModel, writer: StreamWriter, held: list[Event], answer: Answer, output: RequestOutput,
               conversation: list[dict], store: ResponseStore) -> list[str]:
    status = _status(output)
    events = writer.feed(held) + writer.finish(status)
    response = answer.response(status, writer.items, _usage(model, output, writer.reasoning))
    _keep(store, response, conversation)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    return events + [writer.event(kind, response=response)]


def _failed(writer: StreamWriter, answer: Answer, error: APIError) -> list[str]:
    code = error.code or "server_error"
    return [
        writer.event("error", code=code, message=error.message, param=error.param),
        writer.event("response.failed", response=answer.response(
            "failed", writer.items, error={"code": code, "message": error.message})),
    ]
