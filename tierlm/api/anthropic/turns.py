"""The Anthropic Messages API's side of a turn: its system prompt, content
blocks, tools and thinking read into chat messages and a `TurnSpec`, and the
turn's events written back as content blocks. The turn's logic itself lives in
tierlm.structured, shared with the other APIs."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from tierlm.api.anthropic.schemas import CountTokensRequest
from tierlm.api.turns import tool_of
from tierlm.serving.errors import APIError
from tierlm.structured.events import Gathered
from tierlm.structured.reasoning import with_reasoning
from tierlm.structured.tools import Tool, ToolChoice
from tierlm.structured.turn import TurnSpec

log = logging.getLogger(__name__)

# blocks that say something to the model; any other type is skipped (an agent
# newer than this server sends types nobody has seen)
_UNSUPPORTED = {"image": "image", "document": "document"}


def turn_spec(body: CountTokensRequest) -> TurnSpec:
    tools = read_tools(body.tools)
    return TurnSpec(tools=tools, tool_choice=read_tool_choice(body.tool_choice, bool(tools)),
                    json_schema=read_output_format(body.output_config),
                    max_thinking_tokens=read_thinking(body.thinking))


def read_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise APIError(400, "each tool must be an object", f"tools.{i}")
        if tool.get("type") not in (None, "custom"):
            # Anthropic's own server tools (web search, code execution, ...) run at
            # Anthropic; nothing here can run them
            log.debug("tool %s of type %s skipped: a server tool", tool.get("name"), tool.get("type"))
            continue
        out.append(tool_of(tool, "input_schema", f"tools.{i}"))
    return out


def read_tool_choice(choice: dict[str, Any] | None, have_tools: bool) -> ToolChoice:
    """Anthropic's auto / any / tool / none, as the OpenAI API's auto / required / a
    named function / none."""
    if choice is None:
        return ToolChoice("auto" if have_tools else "none")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return ToolChoice(kind, parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool" and isinstance(choice.get("name"), str):
        return ToolChoice("required", choice["name"], parallel)
    raise APIError(400, "tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                   "or {\"type\": \"tool\", \"name\": ...}", "tool_choice")


def read_output_format(config: dict[str, Any] | None) -> dict | None:
    """The JSON schema `output_config.format` asks the answer to follow (Anthropic's
    structured outputs), or None."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
    return fmt["schema"]


def read_thinking(thinking: dict[str, Any] | None) -> int | None:
    """The thinking budget in tokens: None leaves it to the model (and the server's
    setting), 0 closes a thinking section at once."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise APIError(400, "thinking.budget_tokens must be a whole number of tokens", "thinking.budget_tokens")
        return budget
    if kind == "disabled":
        return 0
    if kind == "adaptive":
        return None
    raise APIError(400, "thinking.type must be 'enabled', 'adaptive' or 'disabled'", "thinking.type")


# ---- the prompt ---------------------------------------------------------------


def chat_messages(body: CountTokensRequest, volatile: list[re.Pattern]) -> list[dict]:
    """The conversation as chat messages (tierlm.structured's shape). `volatile`:
    patterns of system blocks left out (they change on every request and would
    defeat the prefix cache)."""
    system = _system_texts(body.system, volatile, "system")
    out: list[dict] = []
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        if message.role == "system":
            texts = _system_texts(message.content, volatile, f"{where}.content")
            if not out:  # before the conversation: part of the system prompt
                system += texts
            elif texts:  # later on: kept in place, so that what came before stays cached
                _add_user_text(out, "\n".join(texts))
        elif message.role == "user":
            _add_user(out, message.content, where)
        elif message.role == "assistant":
            _add_assistant(out, _assistant(message.content, where))
        else:
            raise APIError(400, f"unknown role '{message.role}': expected user or assistant", f"{where}.role")
    if system:
        out.insert(0, {"role": "system", "content": "\n".join(system)})
    return out


def _system_texts(system, volatile: list[re.Pattern], where: str) -> list[str]:
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system or []
    texts = []
    for j, block in enumerate(blocks):
        text = _text_of(block, f"{where}.{j}")
        if text is None:
            continue
        if any(p.search(text) for p in volatile):
            log.debug("system block left out of the prompt (it changes every request): %.80r", text)
            continue
        texts.append(text)
    return texts


def _text_of(block, where: str) -> str | None:
    """A text block's text; None for a block of another type (skipped)."""
    if not isinstance(block, dict):
        raise APIError(400, "a content block must be an object", where)
    kind = block.get("type")
    if kind in _UNSUPPORTED:
        raise APIError(400, f"{_UNSUPPORTED[kind]} blocks are not supported: no model here reads them", where)
    if kind != "text":
        log.debug("content block of type %r skipped at %s", kind, where)
        return None
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, "a text block needs its text", f"{where}.text")
    return text


def _blocks(content, where: str) -> list[tuple[str, dict]]:
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    return [(f"{where}.{j}", block) for j, block in enumerate(content)]


def _add_user(out: list[dict], content, where: str) -> None:
    """A user turn: its tool results as tool messages (in their order), its text
    as one user message."""
    texts = []
    for at, block in _blocks(content, f"{where}.content"):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            out.append(_tool_result(block, at))
        elif (text := _text_of(block, at)) is not None:
            texts.append(text)
    if texts:
        _add_user_text(out, "\n\n".join(texts))


def _add_user_text(out: list[dict], text: str) -> None:
    """Joined to a user message just before: some chat templates (Gemma's) demand
    that user and assistant alternate."""
    if out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
    else:
        out.append({"role": "user", "content": text})


def _add_assistant(out: list[dict], message: dict) -> None:
    """Joined to an assistant message just before (an agent that retried a cut
    answer sends both halves), as for user messages."""
    if not out or out[-1]["role"] != "assistant":
        out.append(message)
        return
    before = out[-1]
    joined = {**before, "content": before["content"] + message["content"]}
    if message.get("tool_calls"):
        joined["tool_calls"] = [*before.get("tool_calls", []), *message["tool_calls"]]
    out[-1] = joined


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise APIError(400, "a tool_result needs its tool_use_id", f"{where}.tool_use_id")
    content = block.get("content")
    if isinstance(content, list):
        content = "\n".join(t for j, b in enumerate(content) if (t := _text_of(b, f"{where}.content.{j}")))
    text = content if isinstance(content, str) else ""
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant(content, where: str) -> dict:
    """An earlier assistant turn: its text, its tool calls and its thinking (for
    the chat template to render, as some do for the steps of a tool-calling
    turn; redacted thinking holds nothing this server can read)."""
    texts, calls, thoughts = [], [], []
    for at, block in _blocks(content, f"{where}.content"):
        if isinstance(block, dict) and block.get("type") == "tool_use":
            calls.append(_tool_use(block, at))
        elif isinstance(block, dict) and block.get("type") == "thinking":
            if isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif isinstance(block, dict) and block.get("type") == "redacted_thinking":
            continue
        elif (text := _text_of(block, at)) is not None:
            texts.append(text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if "".join(thoughts):
        message.update(with_reasoning("".join(thoughts)))
    return message


def _tool_use(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise APIError(400, "a tool_use block needs its id and name", where)
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


# ---- back to Anthropic's shape --------------------------------------------------


def content_blocks(turn: Gathered) -> list[dict]:
    """A whole answer's content: thinking, then text, then tool calls."""
    blocks: list[dict] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
               for c in turn.tool_calls]
    return blocks


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is (grammar-enforced
    calls are always JSON objects; a family parsed from free text may not be)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def stop_reason(finish: str, called: bool, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` are those computed, the cached ones apart."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
