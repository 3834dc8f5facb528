"""The request fields every API shares: a body's rules (unknown fields ignored,
text valid Unicode, no NaN) and the sampling fields the engine reads
(tierlm.serving.served_model). Known fields are range-checked here; the ranges
that depend on the model in serving/validation.py."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierlm.engine.request import MAX_DRAFT_TOKENS
from tierlm.serving.errors import APIError
from tierlm.serving.validation import SEED_MAX, SEED_MIN, find_lone_surrogate

log = logging.getLogger(__name__)


class BodyPart(BaseModel):
    """A part of a body, or a whole one (RequestBody)."""

    # NaN and Infinity (which Python's JSON parser accepts) are no numbers to sample with
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(BodyPart):
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


class StreamOptions(BodyPart):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """What the engine samples by (vLLM's extras included), under OpenAI's
    names: chat and text completions take them as they are, the other APIs
    read their own fields into them."""

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
    # tierlm's: draft tokens verified a step at most (speculative decoding; 0: none for this request)
    speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
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
