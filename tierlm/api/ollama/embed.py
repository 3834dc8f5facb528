"""Ollama's embedding routes: /api/embed (texts in, L2-normalized vectors out,
as Ollama gives them; too long a text is cut unless `truncate` is false; no
input only loads the model) and
the older /api/embeddings (one prompt, its vector as the model makes it)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import Field, StrictBool

from tierlm.api.answer import with_model
from tierlm.api.encoding import check_dimensions, embed, read_inputs, sequences
from tierlm.api.fields import RequestBody
from tierlm.models.model_folder import EMBEDDING
from tierlm.serving.encoder import ServedEncoder

router = APIRouter(prefix="/api")


class EmbedRequest(RequestBody):
    model: str = Field(min_length=1)
    input: Any = None
    truncate: StrictBool = True  # as Ollama's JSON reads it: "yes" is no boolean
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class LegacyEmbeddingsRequest(RequestBody):
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


@router.post("/embed")
async def embed_route(body: EmbedRequest, http: HTTPRequest):
    return await with_model(http, body, _embed, EMBEDDING)


@router.post("/embeddings")
async def embeddings(body: LegacyEmbeddingsRequest, http: HTTPRequest):
    return await with_model(http, body, _legacy, EMBEDDING)


async def _embed(model: ServedEncoder, body: EmbedRequest, http: HTTPRequest):
    started = time.monotonic()
    check_dimensions(model, body.dimensions)
    if body.input in (None, []):  # as Ollama's: nothing to embed loads the model (the lease did)
        return {"model": model.info.name, "embeddings": [], "total_duration": 0, "load_duration": 0,
                "prompt_eval_count": 0}
    ids = await sequences(model, read_inputs(body.input, texts_only=True), -1 if body.truncate else None)
    vectors = await embed(model, ids)
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return {"model": model.info.name, "embeddings": vectors.tolist(),
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": sum(len(seq) for seq in ids)}


async def _legacy(model: ServedEncoder, body: LegacyEmbeddingsRequest, http: HTTPRequest):
    ids = await sequences(model, [body.prompt], -1, "prompt")
    return {"embedding": (await embed(model, ids))[0].tolist()}
