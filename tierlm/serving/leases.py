"""The pool's models by name, as a request asks for them: resolved (an unknown
name is a 404 naming the models here), held for the request (a lease), loaded
or unloaded by hand, or only their tokenizer and turns read (counting a
prompt's tokens loads no model). Pool errors become APIErrors naming `model`."""

from __future__ import annotations

import logging

from tierlm.config import Settings, parse_duration
from tierlm.models.model_folder import CHAT, EMBEDDING, RERANK
from tierlm.pool.discovery import ModelEntry
from tierlm.pool.pool import Lease, ModelPool, PoolError, Slot
from tierlm.serving.errors import APIError
from tierlm.structured.turn import ModelTurns

log = logging.getLogger(__name__)

# where each kind of model is asked (models.model_folder.model_kind)
ROUTES = {
    CHAT: "/v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, /api/chat and /api/generate",
    EMBEDDING: "/v1/embeddings, /api/embed and /api/embeddings",
    RERANK: "/v1/rerank and /rerank",
}


def check_serves(entry: ModelEntry, kind: str) -> None:
    """A 400 naming the routes that serve the model, if it is not a `kind` model
    (an embedding model asked to chat, a chat model asked for embeddings)."""
    if entry.kind != kind:
        raise APIError(400, f"the model {entry.name} is a{'n' if entry.kind[0] in 'aeiou' else ''} "
                       f"{entry.kind} model, served on {ROUTES[entry.kind]}, not this route", "model",
                       "wrong_model_kind")


def slot_of(pool: ModelPool, requested: str | None) -> Slot:
    """The pool's slot for a model name or alias; an unknown one is a 404 naming
    the models here."""
    try:
        return pool.resolve(requested)
    except PoolError as e:
        raise APIError(e.status, str(e), "model", e.code) from e


async def load_slot(pool: ModelPool, slot: Slot) -> None:
    """Load a model by hand (the load routes, the dashboard); pool errors (507, a
    failed load) as API errors naming `model`."""
    try:
        await pool.load(slot.entry.name)
    except PoolError as e:
        raise APIError(e.status, str(e), "model", e.code) from e


async def unload_slot(pool: ModelPool, slot: Slot, force: bool = False) -> None:
    """Unload a model by hand after its requests in flight (`force`: aborting
    them); a pinned one is a 409, it stays loaded."""
    if slot.pinned:
        raise APIError(409, f"{slot.entry.name} is pinned: unpin it first", "model", "model_pinned")
    await pool.unload(slot.entry.name, force=force)


async def turns_for(pool: ModelPool, requested: str | None) -> tuple[ModelEntry, ModelTurns, Settings]:
    """A model's tokenizer and turns (its chat template, tools, reasoning) and its
    settings, never loading the model nor touching an engine (counting a
    prompt's tokens): a loaded model's own, else the cached ones, else its
    tokenizer alone loaded now, off the event loop. The name is resolved as
    `lease_model` does it (an unknown one is the same 404)."""
    slot = slot_of(pool, requested)
    check_serves(slot.entry, CHAT)
    served = slot.served
    if served is not None:
        return slot.entry, served.turns, served.settings
    settings = pool.current.settings.for_model(slot.entry.name)
    try:
        turns = await pool.current.turns.get(slot.entry.path, settings)
    except Exception as e:
        log.exception("could not load the tokenizer of %s", slot.entry.name)
        raise APIError(503, f"could not load the tokenizer of {slot.entry.name}: {type(e).__name__}: {e}",
                       "model", "model_load_failed") from e
    return slot.entry, turns, settings


async def lease_model(pool: ModelPool, requested: str | None, keep_alive=None, kind: str = CHAT) -> Lease:
    """The requested model, loaded and held for this request (release the lease
    when the request is done); a model of another kind is a 400 before it loads.
    Pool errors become API errors naming `model`."""
    check_serves(slot_of(pool, requested).entry, kind)
    try:
        if keep_alive is None:
            lease = await pool.acquire(requested)
        else:
            lease = await pool.acquire(requested, _keep_alive_value(keep_alive))
    except PoolError as e:
        raise APIError(e.status, str(e), "model", e.code) from e
    if not lease.served.engine.is_alive:
        lease.release()
        raise APIError(503, f"the model {lease.slot.entry.name} is not running", "model", "model_loading")
    return lease


def _keep_alive_value(value) -> float | None:
    """A request's keep_alive in seconds (None: forever)."""
    try:
        return parse_duration(value)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"keep_alive: {e}", "keep_alive", "invalid_value") from e
