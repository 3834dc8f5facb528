"""Request bodies of Ollama's API (/api/chat, /api/generate, /api/show). As
Ollama does, unknown fields and options (num_ctx, num_gpu, mirostat, ...) are
ignored; the fields here are checked again once turned into the OpenAI shape
(ollama/turns.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tierlm.api.fields import RequestBody


class OllamaBody(RequestBody):
    model: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: bool | str | None = None  # a thinking switch, or gpt-oss's effort ("low", "medium", "high")


class OllamaChatRequest(OllamaBody):
    messages: list[dict[str, Any]] = Field(default_factory=list)  # none: load the model, answer nothing
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # not Ollama's: OpenAI's, for a client that must have a call


class OllamaGenerateRequest(OllamaBody):
    prompt: str = ""  # empty: load the model, answer nothing
    suffix: str | None = None
    system: str | None = None
    raw: bool = False  # the prompt as it is, no chat template
    images: list[Any] | None = None


class OllamaShowRequest(RequestBody):
    model: str | None = None
    name: str | None = None  # the older name of `model`
