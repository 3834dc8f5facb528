"""Request bodies of the Anthropic routes (/v1/messages, /v1/messages/count_tokens).

Agents drift ahead of every server: a new release sends a field, a content
block or a beta option nobody has seen. So unknown fields are ignored here, and
content blocks stay plain dicts, read (and unknown types skipped) in
anthropic/turns.py. Known fields are range-checked as Anthropic does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tierlm.api.fields import RequestBody
from tierlm.engine.request import MAX_DRAFT_TOKENS
from tierlm.serving.validation import SEED_MAX, SEED_MIN


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str  # user, assistant; "system" entries are folded into the system prompt
    content: str | list[dict[str, Any]]


class CountTokensRequest(RequestBody):
    """What decides the prompt: the same fields as a message request's."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format`: a JSON schema the answer follows


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # ours: the same tokens each time
    # ours: draft tokens verified a step at most (speculative decoding; 0: none)
    speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # Ollama's: how long the model stays loaded after this request
    keep_alive: float | str | None = None
