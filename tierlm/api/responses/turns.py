"""The Responses API's side of a turn: input items read into chat messages,
`tools` / `tool_choice` / `text.format` / `reasoning` into a `TurnSpec`, and
the turn's events written back as output items. The turn's logic itself
(tool formats, grammars, reasoning) lives in tierlm.structured, shared with
the other APIs.

Lenient where clients drift: item, part and tool types this server has no use
for (web_search, item_reference, encrypted reasoning, ...) are skipped with a
debug line; what it cannot honour (an image) is a 400 naming its place."""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tierlm.api.responses.schemas import ResponsesRequest
from tierlm.api.turns import format_schema, read_tool_choice, tool_of
from tierlm.serving.errors import APIError
from tierlm.structured.events import Gathered
from tierlm.structured.reasoning import with_reasoning
from tierlm.structured.tools import Tool, ToolChoice, TurnError
from tierlm.structured.turn import TurnSpec

log = logging.getLogger(__name__)

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
UNSUPPORTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}
NO_THINKING = ("none", "minimal")  # reasoning efforts that ask for no thinking section


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input items -> chat messages -----------------------------------------------


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    if isinstance(body.input, list):
        return list(body.input)
    if body.input is None:
        return []
    raise APIError(400, "input must be a string or a list of items", "input", "invalid_value")


def chat_messages(instructions: str | None, earlier: list[dict], items: list[dict]) -> list[dict]:
    """OpenAI chat-shaped messages (tierlm.structured's shape) of a conversation:
    `earlier` items come from a stored response, `items` from this request."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(earlier):
        _add_item(messages, item, f"previous_response_id ({i})")
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "the input holds no message", "input", "empty_prompt")
    return _as_templates_take_them(messages)


def _as_templates_take_them(messages: list[dict]) -> list[dict]:
    """The turns as strict chat templates accept them (Gemma's wants user and
    assistant to alternate, Qwen's one system message, first), while Codex sends
    several developer messages, and two user messages in a row: the system
    messages that open the input are joined into one, later ones become user
    text, and a user turn joins the user turn before it; so does an assistant's
    turn the assistant text before it."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "system" and any(o["role"] != "system" for o in out):
            m["role"] = "user"
        last = out[-1] if out else None
        if last is not None and last["role"] == m["role"] and m["role"] != "tool" and not last.get("tool_calls"):
            joined = "\n\n".join(t for t in (last["content"], m["content"]) if t)
            out[-1] = {**last, **m, "content": joined}
        else:
            out.append(m)
    return out


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise APIError(400, "each input item must be an object", where, "invalid_value")
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        _add_call(messages, item, where)
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), where)})
    elif kind == "reasoning" and (text := _reasoning_text(item)):
        # opens the assistant turn it came with: its calls and text join it (chat templates
        # render it for the steps of a tool-calling turn)
        messages.append({"role": "assistant", "content": "", **with_reasoning(text)})
    else:  # encrypted or summarized reasoning (nothing this server wrote), hosted tools' items
        log.debug("responses: ignoring an input item of type %r", kind)


def _reasoning_text(item: dict) -> str:
    """The text of a reasoning item's own reasoning (its `content`, as this server
    writes it; a summary is not what the model wrote)."""
    parts = item.get("content")
    if not isinstance(parts, list):
        return ""
    return "".join(p["text"] for p in parts
                   if isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str))


def _message(item: dict, where: str) -> dict:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise APIError(400, "a message's role must be user, assistant, system or developer",
                       f"{where}.role", "invalid_value")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _add_call(messages: list[dict], item: dict, where: str) -> None:
    """A call joins the assistant message before it (its text, or the calls made
    beside it in one turn), as chat messages hold them."""
    arguments = item.get("arguments", "")
    if not isinstance(arguments, (str, dict)):
        raise APIError(400, "arguments must be JSON text", f"{where}.arguments", "invalid_value")
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    messages[-1].setdefault("tool_calls", []).append(call)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"'{key}' must be a string", f"{where}.{key}", "invalid_value")
    return value


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", where, "invalid_value")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSUPPORTED_PARTS:
            raise APIError(400, f"{UNSUPPORTED_PARTS[kind]} inputs ({kind}) are not supported by this "
                           "server's models; send text", f"{where}[{j}]", "unsupported")
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            log.debug("responses: ignoring a content part of type %r", kind)
    return "".join(texts)


def _output_text(output: Any, where: str) -> str:
    if output is None or isinstance(output, (str, list)):
        return _text(output, f"{where}.output")
    raise APIError(400, "output must be a string or a list of parts", f"{where}.output", "invalid_value")


# ---- tools, tool_choice, text.format, reasoning -> TurnSpec -------------------------


@dataclass
class Tools:
    tools: list[Tool] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # where each came from: "tools[4].tools[1]"
    namespaces: dict[str, str] = field(default_factory=dict)  # a namespaced function's name -> its namespace


def read_tools(tools: list | None) -> Tools:
    """Function tools, flat (Responses' {type, name, description, parameters}) or
    chat-shaped; a namespace's functions are offered under their own names (a call
    names its namespace again, as OpenAI's do). Hosted and custom tools are skipped."""
    out = Tools()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise APIError(400, "each tool must be an object", f"tools[{i}]", "invalid_value")
        if tool.get("type") == "function":
            out.tools.append(_function(tool, f"tools[{i}]"))
            out.origins.append(f"tools[{i}]")
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            _add_namespace(out, tool, f"tools[{i}]")
        else:
            log.debug("responses: ignoring a tool of type %r", tool.get("type"))
    return out


def _add_namespace(out: Tools, namespace: dict, where: str) -> None:
    taken = {t.name for t in out.tools}
    for j, inner in enumerate(namespace["tools"]):
        if not (isinstance(inner, dict) and inner.get("type") == "function"):
            log.debug("responses: ignoring a namespaced tool of type %r", inner.get("type"))
            continue
        tool = _function(inner, f"{where}.tools[{j}]")
        if tool.name in taken:  # a call could not say which one it meant
            log.debug("responses: namespaced tool %r shadows another of its name; skipped", tool.name)
            continue
        out.tools.append(tool)
        out.origins.append(f"{where}.tools[{j}]")
        out.namespaces[tool.name] = str(namespace.get("name") or "")


def _function(tool: dict, where: str) -> Tool:
    function = tool["function"] if isinstance(tool.get("function"), dict) else tool
    return tool_of(function, "parameters", where, "invalid_value")


def read_tool_choice_of(choice: Any, have_tools: bool, parallel: bool) -> ToolChoice:
    """auto / none / required / {type: function, name} (chat's nested name too)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return ToolChoice("required", choice["name"], parallel)
    try:
        return read_tool_choice(choice, have_tools, parallel)
    except APIError:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"name\": ...}", "tool_choice", "invalid_value") from None


def read_text_format(text: dict | None) -> dict | bool | None:
    """The JSON schema a text answer must follow (`text.format`), or None for free text."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    return format_schema(fmt, schema, "text.format", "text.format.schema")


def wants_no_thinking(body: ResponsesRequest) -> bool:
    return isinstance(body.reasoning, dict) and body.reasoning.get("effort") in NO_THINKING


def turn_spec(body: ResponsesRequest, tools: Tools, has_thinking: bool) -> TurnSpec:
    parallel = body.parallel_tool_calls is not False
    return TurnSpec(
        tools=tools.tools,
        tool_choice=read_tool_choice_of(body.tool_choice, bool(tools.tools), parallel),
        json_schema=read_text_format(body.text),
        # effort none / minimal: a section the template opens anyway is closed at once
        max_thinking_tokens=0 if has_thinking and wants_no_thinking(body) else None,
    )


_TOOL_PARAM = re.compile(r"^tools\[(\d+)\](?:\.function)?")


def turn_error(e: TurnError, tools: Tools) -> APIError:
    """A 400 naming the request's own place: structured/ counts the flattened
    tools and names chat's `tools[i].function.name`."""
    param = e.param
    if (m := _TOOL_PARAM.match(param)) and int(m.group(1)) < len(tools.origins):
        param = tools.origins[int(m.group(1))] + param[m.end():]
    param = "text.format" if param == "response_format" else param
    return APIError(400, str(e), param, "invalid_request")


# ---- a turn's events -> output items ------------------------------------------------


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, tools: Tools,
              status: str = "completed") -> dict:
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if name in tools.namespaces:
        item["namespace"] = tools.namespaces[name]
    return item


def output_items(turn: Gathered, tools: Tools, status: str) -> list[dict]:
    """A whole turn's output: its reasoning, its text (always a message when
    nothing else was said), its calls. `status` is the last item's (the one cut
    short when the answer is incomplete), as a stream closes them."""
    items = []
    if turn.reasoning:
        items.append(reasoning_item(new_id("rs"), turn.reasoning))
    if turn.content or not turn.tool_calls:
        items.append(message_item(new_id("msg"), turn.content))
    items += [call_item(new_id("fc"), c.id, c.name, c.arguments, tools) for c in turn.tool_calls]
    items[-1]["status"] = status
    return items
