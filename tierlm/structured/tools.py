"""Tools as a turn uses them: the tool list and `tool_choice` checked, the
messages prepared for a template that knows tools or not, and the grammar that
makes a call well formed.

Messages are OpenAI chat-shaped dicts (`role`, `content`, `tool_calls` with
`function.name` / `function.arguments`, `tool_call_id`); each adapter turns its
API's messages into these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from tierlm.structured.grammar import json_body
from tierlm.structured.reasoning import REASONING_KEYS
from tierlm.structured.tool_formats import ToolFormat

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# calls in one answer at most: a small model asked for a call may call again and
# again, to the end of the context, when nothing stops it
MAX_PARALLEL_CALLS = 8


class TurnError(ValueError):
    """Something in the request's tools, tool_choice or output format is wrong:
    a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict | None = None  # a JSON schema of the arguments object

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def as_json(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.schema}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # "none" | "auto" | "required"
    name: str | None = None  # a named function: mode "required", this tool only
    parallel: bool = True  # several calls in one turn (OpenAI's parallel_tool_calls)


def check_tools(tools: list[Tool], choice: ToolChoice, param: str = "tools") -> None:
    names = set()
    for i, tool in enumerate(tools):
        if not _NAME.match(tool.name):
            raise TurnError(f"tool name {tool.name!r} must be 1-64 letters, digits, '_', '-', '.' or ':'",
                            f"{param}[{i}].function.name")
        if tool.name in names:
            raise TurnError(f"two tools are named {tool.name!r}", f"{param}[{i}].function.name")
        if tool.parameters is not None and not isinstance(tool.parameters, dict):
            raise TurnError("parameters must be a JSON schema object", f"{param}[{i}].function.parameters")
        names.add(tool.name)
    if choice.mode == "required" and not tools:
        raise TurnError("tool_choice 'required' needs at least one tool", "tool_choice")
    if choice.name is not None and choice.name not in names:
        raise TurnError(f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice")


# ---- messages --------------------------------------------------------------


def template_messages(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """The messages as the chat template should see them. A template that knows
    tools gets each call's arguments as an object (templates write them with
    `tojson`); for one that does not, calls and results become text in the
    generic format, results as a user turn (some templates accept no other
    roles, or demand that user and assistant alternate)."""
    if fmt.native:
        return [_with_argument_objects(m) for m in messages]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            _append_user_text(out, _generic_result(m))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _generic_calls(m, fmt),
                        **{k: m[k] for k in REASONING_KEYS if k in m}})
        elif m["role"] == "user":
            _append_user_text(out, m.get("content") or "")
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name", *REASONING_KEYS)})
    return out


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments_object(function.get("arguments"))
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _arguments_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # the client's text, as sent
    return arguments if arguments is not None else {}


def _generic_calls(message: dict, fmt: ToolFormat) -> str:
    text = message.get("content") or ""
    for call in message["tool_calls"]:
        function = call.get("function") or {}
        body = {"name": function.get("name", ""), fmt.args_key: _arguments_object(function.get("arguments"))}
        text += f"{fmt.start}{json.dumps(body, ensure_ascii=False)}{fmt.end}"
    return text


def _generic_result(message: dict) -> str:
    body = {"tool_call_id": message.get("tool_call_id"), "content": message.get("content") or ""}
    if message.get("name"):
        body["name"] = message["name"]
    return f"<tool_response>{json.dumps(body, ensure_ascii=False)}</tool_response>"


def _append_user_text(out: list[dict], text: str) -> None:
    """A user turn's text, or a tool result: joined to the user turn before it
    (made of results, or followed by them), so that user and assistant alternate."""
    if out and out[-1]["role"] == "user" and out[-1].get("_results"):
        out[-1]["content"] += "\n" + text
    elif out and out[-1]["role"] == "user" and text.startswith("<tool_response>"):
        out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{text}", "_results": True}
    else:
        out.append({"role": "user", "content": text, "_results": text.startswith("<tool_response>")})


def generic_instructions(tools: list[Tool], fmt: ToolFormat) -> str:
    """What a model whose template knows no tools is told about them. The same
    words whatever the turn's tool_choice (the grammar holds the model to it), so
    that turns which change it share the prompt's prefix in the cache."""
    listed = "\n".join(json.dumps(t.as_json(), ensure_ascii=False) for t in tools)
    example = f'{fmt.start}{{"name": "<tool name>", "{fmt.args_key}": {{<arguments>}}}}{fmt.end}'
    return (
        "You can call tools. Each tool is described by a JSON object:\n"
        f"<tools>\n{listed}\n</tools>\n"
        f"To call a tool, answer with {example}, one such block per call, with arguments that "
        "follow the tool's parameters schema. Tool results come back in <tool_response> blocks. "
        "If no tool is needed, answer the user directly."
    )


def with_instructions(messages: list[dict], instructions: str) -> list[dict]:
    """The messages with `instructions` added to the system prompt (one is made if none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{instructions}" if content else instructions}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def strip_private(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in messages]


# ---- grammar ---------------------------------------------------------------


def call_schema(tools: list[Tool], fmt: ToolFormat, only: str | None = None) -> dict:
    """The JSON schema of one call's body: the name first (the parser streams the
    arguments once it has it), then the arguments, valid for that tool."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, fmt.args_key: t.schema},
            "required": ["name", fmt.args_key],
            "additionalProperties": False,
        }
        for t in tools if only is None or t.name == only
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def no_call_grammar(fmt: ToolFormat, literal: Callable[[str], str], tools: list[Tool] = ()) -> str | None:
    """A Lark grammar (llguidance's dialect) for tool_choice "none", whose prompt
    still lists the tools (the prefix the conversation's other turns cached): any
    text in which the call's opening marker never appears. A marker that is one
    special token is never written by text anyway; a marker spelled in text, and
    a call in JSON text (`fenced`), are taken out of the text's language
    (llguidance's regex complement, `~`). None where the format has no marker to
    keep out."""
    if not fmt.start:
        return None
    text = r"/(.|\n)*/"
    if not literal(fmt.start).startswith("<["):
        text += r" & ~/(.|\n)*" + _regex_literal(fmt.start) + r"(.|\n)*/"
    if fmt.fenced and tools:
        text += r" & ~/(.|\n)*" + _json_call_opening(tools) + r"(.|\n)*/"
    return f"%llguidance {{}}\nstart: TEXT\nTEXT: {text}\n"


def _json_call_opening(tools: list[Tool]) -> str:
    """A regex for the start of a call written as JSON text: `{"name": "<one of the tools>"`."""
    names = "|".join(_regex_literal(json.dumps(t.name)) for t in tools)
    return r'\{\s*"name"\s*:\s*(' + names + ")"


def _fenced_calls(tools: list[Tool], fmt: ToolFormat, single: bool) -> list[str]:
    """Rules for calls written as JSON in text (`fenced`), in a ```json fence or
    bare: text runs free until it opens `{"name": "<one of the tools>"` (a lazy
    trigger, as llama.cpp's), and from there the call must be well formed, and
    close its fence if it opened one."""
    rules = [f"fenced: {'fcall' if single else f'fcall{{1,{MAX_PARALLEL_CALLS}}}'} \"\\n\"?",
             "fcall: " + " | ".join(f"fcall_{i}" for i in range(len(tools))),
             f'ARGS_KEY: /[ \\n]{{0,8}},[ \\n]{{0,8}}"{fmt.args_key}"[ \\n]{{0,4}}:[ \\n]{{0,4}}/',
             r"CLOSE: /[ \n]{0,8}\}/", r'FENCE_END: /\n?```/']
    # a fence closes only where one opened (a bare call followed by ``` would
    # leave the ``` in the text)
    for i, tool in enumerate(tools):
        opening, body = _json_call_opening([tool]), f"ARGS_KEY {json_body(tool.schema, tool=True)} CLOSE"
        rules += [
            f"fcall_{i}: ffence_{i} {body} FENCE_END | fbare_{i} {body}",
            f"ffence_{i}[lazy]: TEXT? /```(json)?\\n?{opening}/",
            f"fbare_{i}[lazy]: TEXT? /{opening}/",
        ]
    return rules


def _regex_literal(text: str) -> str:
    """`text` inside a Lark regex: the regex's special characters and its delimiter escaped."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~/" else c for c in text)


def call_grammar(tools: list[Tool], fmt: ToolFormat, choice: ToolChoice, literal: Callable[[str], str],
                 text_schema: dict | None = None) -> str | None:
    """A Lark grammar (llguidance's dialect) for what the model may answer, or
    None when it is free.

    - `required` and a named tool: calls and nothing else.
    - `auto`: free text until the model writes the call's opening marker (a lazy
      trigger, as llguidance's structural tags, or the marker's own token);
      from there the call must be well formed. With `text_schema`, the answer
      is calls or JSON of that schema.
    - One call for a named tool or unless `choice.parallel`; else up to
      MAX_PARALLEL_CALLS, one per line at most. The answer ends after its calls.
    `literal` writes a marker as Lark (a special token is named, not spelled)."""
    if choice.mode == "none" or not tools or not fmt.json_body or not fmt.start:
        return None
    body = json_body(call_schema(tools, fmt, choice.name), tool=True)
    pad = ' "\\n"?' if fmt.name in ("hermes", "json_tools") else ""  # the newlines its models write
    close = f"{pad} {literal(fmt.end)}" if fmt.end else ""
    single = choice.name is not None or not choice.parallel
    calls = "call" if single else f'call ("\\n"? call){{0,{MAX_PARALLEL_CALLS - 1}}}'
    # the newline its models write after the last call, before the end of the
    # turn: without it, a newline could only lead to another call
    calls += pad
    opening = literal(fmt.start)
    lines = ["%llguidance {}"]
    if choice.mode == "required" or text_schema is not None:
        answer = " | answer" if choice.mode != "required" else ""
        lines += [f"start: {calls}{answer}", f"call: {opening}{pad} {body}{close}"]
        if answer:
            lines.append(f"answer: {json_body(text_schema)}")
    elif opening.startswith("<["):
        # a marker that is one special token: text never writes it, so the text
        # runs free until the model emits it, and the calls follow
        start = "TEXT? calls? | fenced" if fmt.fenced else "TEXT? calls?"
        lines += [f"start: {start}", f"calls: {calls}", r"TEXT: /(.|\n)+/", f"call: {opening}{pad} {body}{close}"]
        if fmt.fenced:
            lines += _fenced_calls(tools, fmt, single)
    else:
        # a marker spelled in text: a lazy trigger on it (llguidance lexes no
        # special token inside one). A model that leaves out the newline after
        # the marker is held to the grammar all the same.
        lines += [
            f"start: {'call | tail' if single else f'call{{0,{MAX_PARALLEL_CALLS}}} tail'}",
            "tail: TEXT",
            r"TEXT: /(.|\n)*/",
            f"call_open[lazy]: TEXT {opening}",
            f"call: call_open{pad} {body}{close}",
        ]
    return "\n".join(lines) + "\n"
