"""A turn as every API begins it: the request read into a `TurnSpec` (tools,
tool_choice, an answer format), its messages rendered into prompt ids by the
chat template, the turn started (constraint and parser). A chat body
(api/chat_body.py) is read here whole, for the OpenAI and Ollama routes; the
other APIs read their own bodies and share the rest. The turn's logic itself
lives in tierlm.structured."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierlm.engine import stages as request_stages
from tierlm.serving.errors import APIError
from tierlm.serving.fill_in_middle import fim_tokens
from tierlm.serving.templates import render_chat_template
from tierlm.serving.validation import check_template_args
from tierlm.structured.reasoning import with_reasoning
from tierlm.structured.tools import Tool, ToolChoice, TurnError
from tierlm.structured.turn import ModelTurns, TurnRun, TurnSpec

if TYPE_CHECKING:
    from tierlm.api.chat_body import ChatCompletionRequest, CompletionRequest
    from tierlm.config import Settings
    from tierlm.engine.request import Request
    from tierlm.serving.served_model import ServedModel


def turn_spec(body) -> TurnSpec:
    """The turn a chat completion body asks for; a 400 naming the field if it is wrong."""
    tools = read_tools(body.tools)
    return TurnSpec(
        tools=tools,
        tool_choice=read_tool_choice(body.tool_choice, bool(tools), body.parallel_tool_calls),
        json_schema=read_response_format(body.response_format),
        grammar=body.grammar,
        max_thinking_tokens=body.max_thinking_tokens,
    )


def read_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    out = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        out.append(tool_of(function, "parameters", f"tools[{i}].function"))
    return out


def tool_of(fields: dict, schema_key: str, where: str, code: str | None = None) -> Tool:
    """A tool from its name, description and JSON schema (at `schema_key`), as
    every API's tools hold them; `where` is the place of `fields` in the request
    (`tools[0].function`, `tools.0`), named with the field a 400 is about."""
    name, schema = fields.get("name"), fields.get(schema_key)
    if not isinstance(name, str):
        raise APIError(400, "a tool needs a name", f"{where}.name", code)
    if schema is not None and not isinstance(schema, dict):
        raise APIError(400, f"{schema_key} must be a JSON schema object", f"{where}.{schema_key}", code)
    return Tool(name, str(fields.get("description") or ""), schema)


def read_tool_choice(choice, have_tools: bool, parallel: bool = True) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if have_tools else "none", parallel=parallel)
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return ToolChoice("required", name, parallel)
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def read_response_format(fmt: dict[str, Any] | None) -> dict | bool | None:
    """The JSON schema a text answer must follow, or None for free text."""
    if fmt is None:
        return None
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return format_schema(fmt, schema, "response_format", "response_format.json_schema.schema")


def format_schema(fmt, schema, param: str, schema_param: str) -> dict | bool | None:
    """What an answer format (`{"type": "text" | "json_object" | "json_schema"}`,
    the last with its `schema`, wherever the API keeps it) asks for: None for free
    text, else the JSON schema of the answer."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "a json_schema format needs a 'schema' object", schema_param, "invalid_value")
        return schema
    raise APIError(400, f"{param}.type must be 'text', 'json_object' or 'json_schema'", f"{param}.type",
                   "invalid_value")


def turn_error(e: TurnError) -> APIError:
    return APIError(400, str(e), e.param, "invalid_request")


def message_dicts(messages, flatten) -> list[dict]:
    """The request's messages as plain dicts (tierlm.structured's shape)."""
    out = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": flatten(m.content)}
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.role == "assistant" and (m.reasoning_content or m.reasoning):
            message.update(with_reasoning(m.reasoning_content or m.reasoning))
        out.append(message)
    return out


def flatten_content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text":
            raise APIError(400, f"content parts of type '{part.type}' are not supported", "messages")
        texts.append(part.text or "")
    return "".join(texts)


def render_chat(model: ServedModel, body: ChatCompletionRequest, spec: TurnSpec,
                allow_client_template: bool) -> list[int]:
    """A chat request's prompt ids, rendered by the model's template (or the
    client's, where the server allows it)."""
    messages = message_dicts(body.messages, flatten_content)
    return render_turn(model.turns, model.settings, spec, messages, check_template_args(body.chat_template_kwargs),
                       body.chat_template, allow_client_template)


def render_turn(turns: ModelTurns, settings: Settings, spec: TurnSpec, messages: list[dict],
                variables: dict | None = None, client_template: str | None = None,
                allow_client_template: bool = False, defaults: dict | None = None,
                error: Callable[[TurnError], APIError] | None = None, messages_param: str = "messages") -> list[int]:
    """A turn's prompt ids: `messages` (chat's shape) prepared for the turn
    (tools, reasoning kept or dropped) and rendered by the chat template with
    its variables: `defaults`, then the model's settings', then the request's
    (`variables`), then the turn's own. A turn that cannot be is a 400
    (`error` names the field as the request's API does, `messages_param` the
    messages)."""
    try:
        messages, turn_variables = turns.prepare(spec, messages)
    except TurnError as e:
        raise (error or turn_error)(e) from e
    kwargs = {**(defaults or {}), **settings.template_kwargs(variables), **turn_variables}
    return render_chat_template(turns.tokenizer, messages, kwargs, client_template, allow_client_template,
                                messages_param)


def start_turn(model: ServedModel, spec: TurnSpec, tokens: list[int],
               error: Callable[[TurnError], APIError] | None = None) -> TurnRun:
    """The turn's constraint and parser for this prompt (compiling a grammar can
    take a while: call off the event loop); a turn that cannot be is a 400."""
    try:
        run = model.turns.start(spec, tokens)
    except TurnError as e:
        raise (error or turn_error)(e) from e
    request_stages.mark("grammar")
    return run


async def chat_turn(model: ServedModel, body: ChatCompletionRequest,
                    allow_client_template: bool) -> tuple[Request, TurnRun]:
    """A chat body's request and its turn (constraint, parser): the prompt
    rendered by the chat template, the grammar compiled and the request made
    off the event loop, in one hand-off (each wakes the loop once more)."""
    return await asyncio.to_thread(_chat_request, model, body, allow_client_template)


def _chat_request(model: ServedModel, body: ChatCompletionRequest,
                  allow_client_template: bool) -> tuple[Request, TurnRun]:
    spec = turn_spec(body)
    tokens = render_chat(model, body, spec, allow_client_template)
    turn = start_turn(model, spec, tokens)
    request = model.make_request("chatcmpl", tokens, body, body.max_completion_tokens or body.max_tokens,
                                 logprobs=body.logprobs_count, constraint=turn.constraint, tokenized=True)
    return request, turn


def single_prompt(prompt):
    """A one-element prompt array's element; any other prompt as it is."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def completion_tokens(model: ServedModel, body: CompletionRequest) -> list[int]:
    """The prompt's ids; with a non-empty `suffix` (an empty one asks for nothing
    after the completion, as Ollama reads it), the model's fill-in-the-middle prompt."""
    if body.suffix:
        return fim_tokens(model.fim_format, model.tokenizer, single_prompt(body.prompt), body.suffix,
                          model.info.name)
    return _prompt_tokens(model, body.prompt)


def _prompt_tokens(model: ServedModel, prompt) -> list[int]:
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        tokens = list(model.tokenizer.encode(prompt))
        request_stages.mark("tokenize")
        return tokens
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
    raise APIError(400, "send one prompt per request (prompt arrays are not supported)", "prompt")


def make_completion(model: ServedModel, body: CompletionRequest, tokens: list[int],
                    max_tokens: int | None) -> Request:
    """A text completion's request; the text continues the prompt as it stands
    (keep_leading_space). A middle ends where the model says the file goes on."""
    tokenized = isinstance(single_prompt(body.prompt), str)  # else the client's ids (a middle needs text)
    request = model.make_request("cmpl", tokens, body, max_tokens, keep_leading_space=True,
                                 logprobs=body.logprobs_count, tokenized=tokenized)
    if body.suffix:
        request.params.stop_token_ids += model.fim_format.stops
    return request
