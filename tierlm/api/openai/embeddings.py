"""OpenAI's embeddings route, /v1/embeddings, for an embedding model in the
pool (tierlm.serving.encoder): texts or token ids in, vectors out as floats
or base64 (little-endian float32, as the openai library decodes them)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import Field

from tierlm.api.answer import with_model
from tierlm.api.encoding import check_dimensions, embed, read_inputs, sequences
from tierlm.api.fields import RequestBody
from tierlm.models.model_folder import EMBEDDING
from tierlm.serving.encoder import ServedEncoder
from tierlm.serving.errors import APIError

router = APIRouter(prefix="/v1")


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's: cut each input to this many tokens (-1: the model's limit) instead of a 400
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    keep_alive: float | str | None = None


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, http: HTTPRequest):
    return await with_model(http, body, _embeddings, EMBEDDING)


async def _embeddings(model: ServedEncoder, body: EmbeddingRequest, http: HTTPRequest):
    check_dimensions(model, body.dimensions)
    if body.truncate_prompt_tokens == 0:
        raise APIError(400, "'truncate_prompt_tokens' must be -1 or at least 1", "truncate_prompt_tokens",
                       "invalid_value")
    ids = await sequences(model, read_inputs(body.input), body.truncate_prompt_tokens)
    vectors = await embed(model, ids)
    tokens = sum(len(seq) for seq in ids)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model.info.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
