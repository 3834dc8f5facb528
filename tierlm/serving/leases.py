"""The pool's models by name, as a request asks for them: resolved (an unknown
name is a 404 naming the models here), held for the request (a lease), loaded
or unloaded by hand, or only their tokenizer and turns read (counting a
prompt's tokens loads no model). Pool errors become APIErrors naming `model`."""

from __future__ import annotations

import logging

from tierlm.config import Settings, parse_duration
from tierlm.pool.discovery import ModelEntry
from tierlm.pool.pool import Lease, ModelPool, PoolError, Slot
from tierlm.serving.errors import APIError
from tierlm.structured.turn import ModelTurns

log = logging.getLogger(__name__)


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


async def lease_model(pool: ModelPool, requested: str | None, keep_alive=None) -> Lease:
    """The requested model, loaded and held for this request (release the lease
    when the request is done). Pool errors become API errors naming `model`."""
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
