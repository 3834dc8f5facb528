"""Request bodies of the OpenAI routes. Unknown fields are ignored, as OpenAI
clients send many optional ones; known fields are range-checked here."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierlm.api.errors import APIError
from tierlm.api.validation import SEED_MAX, SEED_MIN, find_lone_surrogate

log = logging.getLogger(__name__)


class _Body(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are no numbers to sample with
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(_Body):
    """A whole request's body, for every API: its fields a client sends that this
    server does not know are ignored (logged at debug: clients send fields newer
    than any server), and its text must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        if (where := find_lone_surrogate(data)) is not None:
            raise APIError(400, f"'{where}': the text holds a lone UTF-16 surrogate, which is not "
                           "valid Unicode", where, "invalid_value")
        if isinstance(data, dict) and (unknown := sorted(set(data) - set(cls.model_fields))):
            log.debug("%s: ignoring fields %s", cls.__name__, ", ".join(unknown))
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and text completions (vLLM's extras included). The
    ranges that depend on the model are checked in api/validation.py."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # how long the model stays loaded after this request (seconds, or "5m"; -1
    # forever, 0 unloaded after it), as Ollama's keep_alive
    keep_alive: float | str | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v



class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""  # JSON text, as OpenAI sends it (an object is accepted too)


class ToolCallRef(_Body):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
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
    suffix: str | None = None  # text after the completion: fill in the middle (api/fill_in_middle.py)
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
