"""The request body of the OpenAI Responses API (POST /v1/responses).

Clients drift (Codex sends fields OpenAI added last month): unknown fields are
ignored, never a 422. Items, tools and formats stay plain dicts here and are
read leniently in responses/turns.py, where a wrong one is a 400 naming its
place (`input[3].content[0]`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tierlm.api.fields import RequestBody, SamplingFields
from tierlm.engine.request import MAX_DRAFT_TOKENS
from tierlm.serving.validation import SEED_MAX, SEED_MIN


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Any = None  # a string or a list of items: read in turns.input_items
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # {effort, summary}
    text: dict[str, Any] | None = None  # {format: {type: text | json_object | json_schema, ...}, verbosity}
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    # ours: draft tokens verified a step at most (speculative decoding; 0: none)
    speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    metadata: dict[str, Any] | None = None
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = None
    keep_alive: float | str | None = None  # as on the chat route (Ollama's)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def sampling(self) -> SamplingFields:
        """The sampling fields as the engine side reads them (chat's names)."""
        return SamplingFields(model=self.model, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              speculative_tokens=self.speculative_tokens)
