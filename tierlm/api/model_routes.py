"""The models: /v1/models lists every model here, loaded or not; load and
unload one by name or alias (admin routes: the admin key, tierlm.admin.access).
A name only ever selects among the models discovery listed: it is never made
into a path."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from tierlm.pool.pool import ModelPool, Slot
from tierlm.serving.leases import load_slot, slot_of, unload_slot

router = APIRouter(prefix="/v1")


def _pool(http: HTTPRequest) -> ModelPool:
    return http.app.state.pool


@router.get("/models")
async def list_models(http: HTTPRequest):
    pool = _pool(http)
    pool.refresh()  # a model pulled, copied in or deleted since
    # the default (`--model`) first, then by name: a client that takes the first
    # model listed (a load generator, a chat UI's preselection) gets the one the
    # server was started for, not whichever model of its folder sorts first
    slots = sorted(pool.slots.items(), key=lambda item: (item[0] != pool.default, item[0]))
    return {"object": "list", "data": [_card(pool, slot) for _, slot in slots]}


@router.post("/models/{model_id:path}/load")
async def load_model(model_id: str, http: HTTPRequest):
    slot = slot_of(http.app.state.pool, model_id)
    await load_slot(http.app.state.pool, slot)
    return _card(_pool(http), slot)


@router.post("/models/{model_id:path}/unload")
async def unload_model(model_id: str, http: HTTPRequest, force: bool = False):
    """Unload after the model's requests in flight, or (`?force=true`) aborting them."""
    slot = slot_of(http.app.state.pool, model_id)
    await unload_slot(http.app.state.pool, slot, force)
    return _card(_pool(http), slot)


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, http: HTTPRequest):
    return _card(_pool(http), slot_of(http.app.state.pool, model_id))


def _card(pool: ModelPool, slot: Slot) -> dict:
    """OpenAI's model object, and what the pool knows of it."""
    entry = slot.entry
    listed = pool.describe(slot)
    return {
        "id": entry.name,
        "object": "model",
        "created": entry.created,
        "owned_by": "tierlm",
        "max_model_len": entry.context_length,
        "state": listed["state"],
        "size_bytes": entry.size_bytes,
        "quantization": entry.quantization,
        "memory_bytes": listed["memory_bytes"],
        "in_flight": listed["in_flight"],
        "expires_in_s": listed["expires_in_s"],
    }
