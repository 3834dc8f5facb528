"""Every API's stream goes through one driver (tierlm.api.answer.stream): a
generation that fails part way, with an error output or with a bug raised,
ends each API's stream in that API's own error frames, never in silence; a
wait sends that API's keep-alive (none for Ollama's lines).

The failure is a fault we cannot cause for real: an engine that gives a wait,
some text, then fails."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from tierlm.api.answer import stream
from tierlm.api.anthropic.routes import MessageEvents
from tierlm.api.chat_body import ChatCompletionRequest
from tierlm.api.ollama.routes import OllamaLines
from tierlm.api.openai.routes import ChatChunks
from tierlm.api.responses.routes import Answer, ResponseEvents
from tierlm.api.responses.schemas import ResponsesRequest
from tierlm.api.responses.store import ResponseStore
from tierlm.api.responses.turns import read_tools
from tierlm.api.sse import KEEPALIVE
from tierlm.engine.request import Request, RequestOutput, SamplingParams
from tierlm.structured.turn import TurnParser, TurnRun


class FailingEngine:
    def __init__(self, bug: bool):
        self.bug = bug

    async def stream_outputs(self, request, keepalive_s=None):
        if keepalive_s is not None:
            yield None
        yield RequestOutput(request.request_id, text="Hello")
        if self.bug:
            raise RuntimeError("injected bug")
        yield RequestOutput(request.request_id, finished=True, error="the step failed", error_type="internal")


MODEL = SimpleNamespace(info=SimpleNamespace(name="m"))
REQUEST = Request("req-1", [1, 2], SamplingParams())


def openai_chat():
    return ChatChunks(MODEL, REQUEST, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]),
                      TurnParser(None, None))


def responses():
    answer = Answer("resp_1", "m", ResponsesRequest(input="hi"), read_tools(None), 0)
    return ResponseEvents(MODEL, TurnRun(None, TurnParser(None, None)), answer, [], ResponseStore(1))


def data_of(frames: list[str]) -> list:
    return [json.loads(line[6:]) for f in frames for line in f.splitlines() if line.startswith("data: {")]


def openai_ends(frames: list[str], code: str) -> None:
    assert frames[-1] == "data: [DONE]\n\n"
    assert data_of(frames)[-1]["error"]["code"] == code


def anthropic_ends(frames: list[str], code: str) -> None:
    assert frames[-1].startswith("event: error\n")
    assert data_of(frames)[-1]["error"]["type"] in ("api_error", "invalid_request_error")
    assert not any("message_stop" in f for f in frames)


def responses_ends(frames: list[str], code: str) -> None:
    payloads = data_of(frames)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads][-2:] == ["error", "response.failed"]
    failed = payloads[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["content"][0]["text"] == "Hello"
    assert failed["error"]["code"] == code


def ollama_ends(frames: list[str], code: str) -> None:
    lines = [json.loads(f) for f in frames]
    assert lines[0]["message"]["content"] == "Hello" and lines[0]["done"] is False
    assert "error" in lines[-1] and len(lines) == 2


APIS = {
    "openai": (openai_chat, 15.0, KEEPALIVE, openai_ends),
    "anthropic": (lambda: MessageEvents(MODEL, REQUEST, TurnParser(None, None)), 10.0, "event: ping", anthropic_ends),
    "responses": (responses, 15.0, KEEPALIVE, responses_ends),
    "ollama": (lambda: OllamaLines(MODEL, time.monotonic(), "message"), None, None, ollama_ends),
}


@pytest.mark.parametrize("bug", [False, True], ids=["error output", "bug raised"])
@pytest.mark.parametrize("api", list(APIS))
def test_a_failure_mid_stream_ends_in_the_apis_own_error_frames(api, bug):
    encoder, keepalive_s, keepalive, ends = APIS[api]
    model = SimpleNamespace(info=MODEL.info, engine=FailingEngine(bug))

    async def run():
        return [frame async for frame in stream(model, REQUEST, TurnParser(None, None), encoder(), keepalive_s)]

    frames = asyncio.run(run())
    if keepalive is not None:
        assert any(f.startswith(keepalive) for f in frames)
    assert any("Hello" in f for f in frames)
    ends(frames, "internal_error" if bug else "generation_failed")
