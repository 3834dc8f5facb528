"""What the embedding and rerank routes share: inputs read and checked (texts
or token ids, their number, their length against the model's; a lone
surrogate is refused with every body, api/fields.py), tokenized off the event
loop, and run by the model's encoder engine with every other request waiting
(tierlm.serving.encoder)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tierlm.serving.encoder import ServedEncoder
from tierlm.serving.errors import APIError

MAX_INPUTS = 2048  # texts in one request, as OpenAI's limit


def read_inputs(value: Any, param: str = "input", texts_only: bool = False) -> list[str] | list[list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists
    (`texts_only`: strings only, as Ollama's), as a list of texts or of id
    sequences; a 400 naming what is wrong."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value) and not texts_only:
        value = [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, f"'{param}' must be a non-empty string, list of strings or list of token ids",
                       param, "invalid_value")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"'{param}' holds {len(value)} inputs; at most {MAX_INPUTS} per request", param,
                       "invalid_value")
    strings = all(isinstance(v, str) for v in value)
    if texts_only and not strings:
        raise APIError(400, f"'{param}' must be a string or a list of strings", param, "invalid_value")
    if not strings and not all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
        raise APIError(400, f"'{param}' must hold only strings or only lists of integer token ids", param,
                       "invalid_value")
    for i, v in enumerate(value):
        if not v:
            raise APIError(400, f"'{param}[{i}]' is empty", f"{param}[{i}]", "empty_input")
    return value


def check_dimensions(model: ServedEncoder, dimensions: int | None) -> None:
    """These models cannot shorten their vectors: any other number is a 400."""
    if dimensions is not None and dimensions != model.encoder.dimensions:
        raise APIError(400, f"the model {model.info.name} makes {model.encoder.dimensions}-dimension "
                       "embeddings and cannot shorten them", "dimensions", "invalid_value")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def sequences(model: ServedEncoder, inputs: list[str] | list[list[int]], truncate: int | None,
                    param: str = "input") -> list[list[int]]:
    """Each input's token ids. One longer than the model takes is a 400, unless
    `truncate` (a token count, or -1 for the model's own limit) asks to cut it."""
    encoder = model.encoder
    if isinstance(inputs[0], str):
        ids = await asyncio.to_thread(encoder.tokenize, inputs)
    else:
        vocab = encoder.config.vocab_size
        for i, seq in enumerate(inputs):
            if not all(0 <= t < vocab for t in seq):
                raise APIError(400, f"'{param}[{i}]': token ids must be between 0 and {vocab - 1}",
                               f"{param}[{i}]", "invalid_value")
        ids = inputs
    if truncate is not None:
        return [encoder.truncate(seq, None if truncate == -1 else truncate) for seq in ids]
    for i, seq in enumerate(ids):
        if len(seq) > encoder.max_tokens:
            raise APIError(400, f"'{param}[{i}]' is {len(seq)} tokens, more than the {encoder.max_tokens} "
                           f"the model {model.info.name} takes; shorten it or ask to truncate",
                           f"{param}[{i}]", "context_length_exceeded")
    return ids


async def embed(model: ServedEncoder, ids: list[list[int]]) -> np.ndarray:
    """Rows of embeddings, batched with every other request's."""
    try:
        return await model.engine.embed(ids)
    except RuntimeError as e:  # unloaded or failed meanwhile
        raise APIError(503, str(e), "model", "model_unavailable") from e


async def score(model: ServedEncoder, pairs: list[tuple[list[int], list[int]]]) -> np.ndarray:
    try:
        return await model.engine.score(pairs)
    except RuntimeError as e:
        raise APIError(503, str(e), "model", "model_unavailable") from e
