"""The request body of the OpenAI Responses API (POST /v1/responses).

Clients drift (Codex sends fields OpenAI added last month): unknown fields are
ignored, never a 422. Items, tools and formats stay plain dicts here and are
read leniently in api/responses_turns.py, where a wrong one is a 400 naming its
place (`input[3].content[0]`)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, model_validator

from tierlm.api.errors import APIError
from tierlm.api.openai_schemas import SamplingFields, _Body
from tierlm.api.validation import SEED_MAX, SEED_MIN, find_lone_surrogate

log = logging.getLogger(__name__)


class ResponsesRequest(_Body):
    model: str | None = None
    input: Any = None  # a string or a list of items: read in responses_turns.input_items
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
    metadata: dict[str, Any] | None = None
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = None
    keep_alive: float | str | None = None  # as on the chat route (Ollama's)

    @model_validator(mode="before")
    @classmethod
    def _check_text_and_log_unknown(cls, data):
        if (where := find_lone_surrogate(data)) is not None:
            raise APIError(400, f"'{where}': the text holds a lone UTF-16 surrogate, which is not "
                           "valid Unicode", where, "invalid_value")
        if isinstance(data, dict) and (unknown := sorted(set(data) - set(cls.model_fields))):
            log.debug("responses: ignoring fields %s", ", ".join(unknown))
        return data

    @property
    def stored(self) -> bool:
        return self.store is not False

    def sampling(self) -> SamplingFields:
        """The sampling fields as the engine side reads them (chat's names)."""
        return SamplingFields(model=self.model, temperature=self.temperature, top_p=self.top_p, seed=self.seed)
