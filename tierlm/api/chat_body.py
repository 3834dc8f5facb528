"""The chat and text completion bodies: OpenAI's shape, which chat templates,
vLLM and llama.cpp speak too. The OpenAI routes take them as they come;
Ollama's reads its bodies into them. Unknown fields are ignored, as clients
send many optional ones; known fields are range-checked here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tierlm.api.fields import SamplingFields, BodyPart
from tierlm.serving.errors import APIError

class ContentPart(BodyPart):
    type: str
    text: str | None = None


class FunctionCall(BodyPart):
    name: str
    arguments: str | dict[str, Any] = ""  # JSON text, as OpenAI sends it (an object is accepted too)


class ToolCallRef(BodyPart):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BodyPart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallRef] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning, sent back (DeepSeek's and vLLM's name)
    reasoning: str | None = None  # the same, by OpenRouter's and newer vLLM's name


# alternatives per token: OpenAI's chat limit; its legacy completions stop at 5,
# which vLLM (and tierlm) raise to 20 as well
MAX_TOP_LOGPROBS = 20


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # extensions: a Lark grammar (llguidance's dialect) the answer must match, as
    # llama.cpp's `grammar`; and a cap on thinking tokens, closing the section
    grammar: str | None = None
    max_thinking_tokens: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server allows client templates

    @model_validator(mode="after")
    def _check_logprobs(self):
        n = self.top_logprobs
        if n is not None:
            if not 0 <= n <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"'top_logprobs': must be between 0 and {MAX_TOP_LOGPROBS}, got {n}",
                               "top_logprobs", "invalid_value")
            if not self.logprobs:
                raise APIError(400, "'top_logprobs': logprobs must be set to true when top_logprobs is used",
                               "top_logprobs", "invalid_value")
        return self

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per token for the engine; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    suffix: str | None = None  # text after the completion: fill in the middle (serving/fill_in_middle.py)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)

    @model_validator(mode="after")
    def _check_logprobs(self):
        n = self.logprobs
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"'logprobs': must be between 0 and {MAX_TOP_LOGPROBS}, got {n}",
                           "logprobs", "invalid_value")
        if n is not None and self.echo:
            raise APIError(400, "'echo': echo together with logprobs (the prompt's logprobs) is not supported",
                           "echo", "unsupported")
        if self.suffix and self.echo:
            raise APIError(400, "'echo': echo together with suffix (fill in the middle) is not supported",
                           "echo", "unsupported")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs
