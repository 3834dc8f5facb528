"""Ollama's API in the OpenAI shape the engine's adapters already take, and back:
its messages (tool calls with argument objects and no ids, tool results named
by tool, `thinking`), its options (num_predict, repeat_penalty, ...), `format`
and `think` become a ChatCompletionRequest or a CompletionRequest; a turn
becomes Ollama's message, and the pool's models its model cards."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from tierlm.api.chat_body import ChatCompletionRequest, CompletionRequest
from tierlm.api.errors import validation_message
from tierlm.api.ollama.schemas import OllamaBody, OllamaChatRequest, OllamaGenerateRequest
from tierlm.pool.discovery import ModelEntry
from tierlm.serving.errors import APIError
from tierlm.structured.events import Gathered

# Ollama's options that have an OpenAI-shaped field of another name; those of
# the same name (temperature, top_p, top_k, min_p, seed, stop, presence_penalty,
# frequency_penalty; tierlm's speculative_tokens) pass as they are, the rest (num_ctx, num_gpu, ...) are ignored
_RENAMED = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}
_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
         "speculative_tokens")


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def sampling(body: OllamaBody) -> dict[str, Any]:
    """The options as OpenAI-shaped sampling fields, and what every request carries."""
    options = body.options or {}
    out: dict[str, Any] = {"model": body.model, "keep_alive": body.keep_alive}
    for key in _SAME:
        if options.get(key) is not None:
            out[key] = options[key]
    for key, field in _RENAMED.items():
        if options.get(key) is not None:
            out[field] = options[key]
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] <= 0:
        del out["max_tokens"]  # -1 and -2: until the end of the context, as Ollama reads them
    return out


def chat_request(body: OllamaChatRequest) -> ChatCompletionRequest:
    fields = {**sampling(body), "messages": chat_messages(body.messages), "tools": body.tools,
              "tool_choice": body.tool_choice, **_format(body.format), **_think(body.think)}
    return _validated(ChatCompletionRequest, fields)


def generate_chat_request(body: OllamaGenerateRequest) -> ChatCompletionRequest:
    """/api/generate's prompt through the chat template, as Ollama renders it."""
    messages = [{"role": "system", "content": body.system}] if body.system else []
    fields = {**sampling(body), "messages": [*messages, {"role": "user", "content": body.prompt}],
              **_format(body.format), **_think(body.think)}
    return _validated(ChatCompletionRequest, fields)


def completion_request(body: OllamaGenerateRequest) -> CompletionRequest:
    """/api/generate's prompt as it is (`raw`), or filled in before `suffix`."""
    if body.format:
        raise APIError(400, "'format' needs the chat template: it cannot go with raw or suffix", "format")
    return _validated(CompletionRequest, {**sampling(body), "prompt": body.prompt, "suffix": body.suffix})


def _validated(schema, fields: dict):
    try:
        return schema.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e, {field: option for option, field in _RENAMED.items()})
        raise APIError(400, message, param, "invalid_value") from None


def _format(fmt: str | dict | None) -> dict:
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise APIError(400, "'format' must be \"json\" or a JSON schema", "format", "invalid_value")


def _think(think: bool | str | None) -> dict:
    """`think` as the chat template's switch (Qwen3's enable_thinking, gpt-oss's
    reasoning_effort); false also closes a section the template opens anyway."""
    if think is None:
        return {}
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}, "max_thinking_tokens": 0}
    if think is True:
        return {"chat_template_kwargs": {"enable_thinking": True}}
    return {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": think}}


def chat_messages(messages: list[dict]) -> list[dict]:
    """Ollama's messages in OpenAI's shape: each call gets an id, and each tool
    result the id of the call it answers (by the tool's name, else in order)."""
    out: list[dict] = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name), oldest first
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, "each message must be an object", f"messages[{i}]", "invalid_value")
        if m.get("images"):
            raise APIError(400, "image inputs are not supported by this server's models; send text",
                           f"messages[{i}].images", "unsupported")
        message = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("role") == "assistant":
            calls = [_call(call, f"call_{i}_{j}", f"messages[{i}].tool_calls[{j}]")
                     for j, call in enumerate(m.get("tool_calls") or [])]
            if calls:
                message["tool_calls"] = calls
                unanswered = [(c["id"], c["function"]["name"]) for c in calls]
            if m.get("thinking"):  # validated as chat's reasoning_content is: text
                message["reasoning_content"] = m["thinking"]
        elif m.get("role") == "tool":
            message["tool_call_id"] = _answered(unanswered, m.get("tool_name"), i)
        out.append(message)
    return out


def _call(call: Any, call_id: str, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, "a tool call needs a function with a name", where, "invalid_value")
    arguments = function.get("arguments") or {}
    return {"id": call_id, "type": "function", "function": {
        "name": function["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _answered(unanswered: list[tuple[str, str]], tool_name: str | None, i: int) -> str:
    for k, (call_id, name) in enumerate(unanswered):
        if tool_name is None or name == tool_name:
            del unanswered[k]
            return call_id
    return f"call_result_{i}"  # a result of no call seen: the template shows it all the same


# ---- back to Ollama's shape ------------------------------------------------------


def message_of(turn: Gathered) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["thinking"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                 for c in turn.tool_calls]
    return message


def _arguments(text: str) -> dict:
    try:
        arguments = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


def digest(entry: ModelEntry) -> str:
    """A stable id of a model's folder as found (Ollama's digest of its weights)."""
    return hashlib.sha256(f"{entry.path}\0{entry.created}\0{entry.size_bytes}".encode()).hexdigest()


def details(entry: ModelEntry) -> dict:
    return {"parent_model": "", "format": "safetensors", "family": entry.model_type,
            "families": [entry.model_type], "parameter_size": "",
            "quantization_level": entry.quantization or "unquantized"}


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")
