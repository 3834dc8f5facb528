"""The OpenAI chat API's side of a turn: `tools`, `tool_choice` and
`response_format` read into a `TurnSpec`, and the turn's events written back
as OpenAI messages and stream deltas. The turn's logic itself lives in
tierlm.structured, shared with the other APIs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierlm.api.errors import APIError
from tierlm.api.fill_in_middle import fim_tokens
from tierlm.api.templates import render_chat_template
from tierlm.api.validation import check_template_args
from tierlm.structured.events import Event, Gathered, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from tierlm.structured.reasoning import with_reasoning
from tierlm.structured.tools import Tool, ToolChoice, TurnError
from tierlm.structured.turn import TurnSpec

if TYPE_CHECKING:
    from tierlm.api.openai_schemas import ChatCompletionRequest, CompletionRequest
    from tierlm.api.served_model import ServedModel
    from tierlm.engine.request import Request


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
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str):
            raise APIError(400, "a function tool needs a name", f"tools[{i}].function.name")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, "parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        out.append(Tool(name, str(function.get("description") or ""), parameters))
    return out


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
    """A chat request's prompt ids, rendered by the model's template."""
    try:
        messages, variables = model.turns.prepare(spec, message_dicts(body.messages, flatten_content))
    except TurnError as e:
        raise turn_error(e) from e
    kwargs = {**model.settings.template_kwargs(check_template_args(body.chat_template_kwargs)), **variables}
    return render_chat_template(model.tokenizer, messages, kwargs, body.chat_template, allow_client_template)


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
        return list(model.tokenizer.encode(prompt))
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt", "empty_prompt")
    raise APIError(400, "send one prompt per request (prompt arrays are not supported)", "prompt")


def make_completion(model: ServedModel, body: CompletionRequest, tokens: list[int],
                    max_tokens: int | None) -> Request:
    """A text completion's request; the text continues the prompt as it stands
    (keep_leading_space). A middle ends where the model says the file goes on."""
    request = model.make_request("cmpl", tokens, body, max_tokens, keep_leading_space=True,
                                 logprobs=body.logprobs_count)
    if body.suffix:
        request.params.stop_token_ids += model.fim_format.stops
    return request


# ---- back to OpenAI's shape --------------------------------------------------


def delta_of(event: Event) -> dict:
    """One event as a chat.completion.chunk delta."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    assert isinstance(event, ToolCallArgs)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def message_of(turn: Gathered) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["content"] = turn.content or None
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    return message


def finish_reason(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason
