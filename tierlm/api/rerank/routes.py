"""The rerank route, /v1/rerank (and /rerank), in the shape vLLM, llama.cpp's
server and Jina share: a query and documents in, each document's relevance
from a cross-encoder (tierlm.serving.encoder), most relevant first."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import Field

from tierlm.api.answer import with_model
from tierlm.api.encoding import MAX_INPUTS, score
from tierlm.api.fields import RequestBody
from tierlm.models.model_folder import RERANK
from tierlm.serving.encoder import ServedEncoder
from tierlm.serving.errors import APIError

router = APIRouter()


class RerankRequest(RequestBody):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    keep_alive: float | str | None = None


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, http: HTTPRequest):
    return await with_model(http, body, _rerank, RERANK)


async def _rerank(model: ServedEncoder, body: RerankRequest, http: HTTPRequest):
    if not body.query:
        raise APIError(400, "'query' is empty", "query", "empty_input")
    pairs = await asyncio.to_thread(model.encoder.tokenize_pairs, body.query, body.documents)
    scores = await score(model, pairs)
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: body.top_n]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model.info.name,
        "results": [{"index": i, "relevance_score": float(scores[i]),
                     **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                    for i in order],
        "usage": {"total_tokens": sum(len(ids) for ids, _ in pairs)},
    }
