"""The API's model pool: the models the settings name or the model folders
hold, each served (engine, turns) when a request asks for it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from fastapi import Request as HTTPRequest

from tierlm.api.errors import APIError
from tierlm.api.served_model import ServedModel
from tierlm.cache.block_hash import model_fingerprint
from tierlm.config import Settings, parse_duration, resolve_alias, total_memory
from tierlm.engine.core import EngineCore
from tierlm.models.loader import load_model, load_tokenizer, read_model_info, tokenizer_stamp
from tierlm.pool.discovery import ModelEntry, default_hf_cache, discover, folders_signature, read_entry
from tierlm.pool.pool import Lease, ModelPool, PoolError, Slot
from tierlm.structured.turn import ModelTurns

log = logging.getLogger(__name__)


TURNS_CACHED = 4  # models whose tokenizer and ModelTurns outlive their unload


class CurrentSettings:
    """What the API keeps beside the pool: the settings in force (replaced when
    the settings file changes) and the models' cached tokenizers and turns."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.turns = TurnsCache()


class TurnsCache:
    """Per model folder and the settings that shape them: the tokenizer and its
    `ModelTurns`, kept across unloads (the last TURNS_CACHED, least recently
    used out), so that a reload skips them, above all llguidance's view of a
    large vocabulary (seconds for Gemma's), and so that a model's tokens can be
    counted without loading it. They hold no MLX array: an unload still frees
    all of the model's memory that MLX held."""

    def __init__(self, size: int = TURNS_CACHED):
        self.size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, Future] = OrderedDict()

    def future(self, path: Path, settings: Settings) -> Future:
        """The model's ModelTurns, cached or loading in a thread of its own now
        (a failed load is not kept)."""
        key = (str(path), tokenizer_stamp(path), settings.tool_format, settings.reasoning,
               settings.max_thinking_tokens, settings.parallel_tool_calls)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
            future = self._entries[key] = Future()
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        threading.Thread(target=self._build, args=(key, future, path, settings), daemon=True,
                         name="tokenizer-load").start()
        return future

    async def get(self, path: Path, settings: Settings) -> ModelTurns:
        return await asyncio.wrap_future(self.future(path, settings))

    def _build(self, key: tuple, future: Future, path: Path, settings: Settings) -> None:
        try:
            future.set_result(_model_turns(load_tokenizer(path), settings))
        except Exception as e:  # noqa: BLE001 (the waiting load or request gets it)
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]
            future.set_exception(e)


def make_pool(settings: Settings, model_path: Path | None) -> ModelPool:
    """Every model in the model folders, and the one `--model` names (the
    default: loaded at start, never unloaded for being idle)."""
    entries = discover(model_dirs_of(settings), hf_cache_of(settings))
    default = None
    if model_path is not None:
        named = settings.for_model(model_path.name).served_model_name
        entry = read_entry(model_path, named or model_path.name)
        # the same folder, however --model named it (a link to it is another model's folder)
        others = {n: e for n, e in entries.items() if os.path.abspath(e.path) != os.path.abspath(entry.path)}
        entries = {entry.name: entry, **others}
        default = entry.name
    current = CurrentSettings(settings)
    pool = ModelPool(
        entries,
        lambda entry: serve(entry, current.settings.for_model(entry.name), entry.name == default, current.turns),
        budget_bytes=settings.max_model_memory_bytes(),
        keep_alive_s=lambda name: current.settings.for_model(name).keep_alive_s(),
        resolve_alias=lambda requested: resolve_alias(current.settings, requested, list(pool.slots)),
        pinned=_pinned(settings, entries, default),
        default=default,
        rediscover=lambda: discover(model_dirs_of(current.settings), hf_cache_of(current.settings)),
        folders_signature=lambda: folders_signature(model_dirs_of(current.settings),
                                                    hf_cache_of(current.settings)),
        first_estimate=lambda entry: first_load_estimate(entry, current.settings.for_model(entry.name)),
    )
    pool.current = current
    return pool


def first_load_estimate(entry: ModelEntry, settings: Settings) -> int:
    """The memory a model's weights will take once loaded, before it has been:
    on MLX's CPU backend tierlm runs them in float32 (quantized ones
    dequantized) and keeps a bfloat16 copy for AMX beside, several times their
    size on disk. Erring high only makes the first load evict more."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or settings.cpu_weights_dtype not in ("auto", "float32"):
        return entry.size_bytes
    bits = int(entry.quantization.split("-bit")[0]) if entry.quantization and "-bit" in entry.quantization else 16
    return int(entry.size_bytes * 32 / bits * (1.5 if settings.cpu_amx else 1.0))


def apply_settings(pool: ModelPool, new: Settings) -> None:
    """The settings file changed: aliases, pins, keep-alive, the budget and each
    loaded model's request defaults take effect now; what an engine was built
    with (cache sizes, batch limits) at its next load."""
    pool.current.settings = new
    pool.budget_bytes = new.max_model_memory_bytes()
    pinned = _pinned(new, pool.slots, pool.default)
    for name, slot in pool.slots.items():
        slot.pinned = name in pinned
        if slot.served is not None:
            slot.served.settings = new.for_model(name)
    log.info("settings reloaded: %d models, %d pinned", len(pool.slots), len(pinned))


def _pinned(settings: Settings, names, default: str | None) -> frozenset[str]:
    return frozenset(n for n in names if n == default or settings.for_model(n).pinned)


async def serve(entry: ModelEntry, settings: Settings, is_default: bool = False,
                turns_cache: TurnsCache | None = None) -> ServedModel:
    """Load a model and start its engine; what the pool keeps for it. The
    tokenizer and turns come from `turns_cache`, or load beside the weights."""
    info = read_model_info(entry.path, entry.name)
    memory = settings.memory_limit_bytes() or total_memory()
    turns_future = (turns_cache or TurnsCache(1)).future(entry.path, settings)
    engine = EngineCore(info.name, lambda: load_model(
        entry.path, settings.cpu_weights_dtype, memory, use_cpu_kernels=settings.cpu_kernels,
        use_amx=settings.cpu_amx, tokenizer=lambda: turns_future.result().tokenizer),
        settings, model_fingerprint(entry.path, {}))
    await engine.start()
    turns = await asyncio.wrap_future(turns_future)  # done: the load waited for it
    _build_ll_tokenizer(turns)
    return ServedModel(info, engine, aliases=("default",) if is_default else (), turns=turns, settings=settings)


def _model_turns(tokenizer, settings: Settings) -> ModelTurns:
    """How the model takes turns (tools, reasoning)."""
    return ModelTurns(tokenizer, None if settings.tool_format == "auto" else settings.tool_format,
                      settings.reasoning, settings.max_thinking_tokens, settings.parallel_tool_calls)


def _build_ll_tokenizer(turns: ModelTurns) -> None:
    """llguidance's view of the tokenizer, built in the background for a model
    that loads: it takes seconds for a large vocabulary (Gemma's 262k tokens),
    which the load need not wait for; the first request with a grammar waits
    for it if it comes sooner. Built once per cached ModelTurns (a reload finds
    it made); never for a model whose tokens are only counted."""
    threading.Thread(target=lambda: turns.grammars.ll_tokenizer, name="llguidance-tokenizer", daemon=True).start()


def slot_of(http: HTTPRequest, requested: str | None) -> Slot:
    """The pool's slot for a model name or alias; an unknown one is a 404 naming
    the models here."""
    try:
        return http.app.state.pool.resolve(requested)
    except PoolError as e:
        raise APIError(e.status, str(e), "model", e.code) from e


async def load_slot(http: HTTPRequest, slot: Slot) -> None:
    """Load a model by hand (the load routes, the dashboard); pool errors (507, a
    failed load) as API errors naming `model`."""
    try:
        await http.app.state.pool.load(slot.entry.name)
    except PoolError as e:
        raise APIError(e.status, str(e), "model", e.code) from e


async def unload_slot(http: HTTPRequest, slot: Slot, force: bool = False) -> None:
    """Unload a model by hand after its requests in flight (`force`: aborting
    them); a pinned one is a 409, it stays loaded."""
    if slot.pinned:
        raise APIError(409, f"{slot.entry.name} is pinned: unpin it first", "model", "model_pinned")
    await http.app.state.pool.unload(slot.entry.name, force=force)


async def turns_for(http: HTTPRequest, requested: str | None) -> tuple[ModelEntry, ModelTurns, Settings]:
    """A model's tokenizer and turns (its chat template, tools, reasoning) and its
    settings, never loading the model nor touching an engine (counting a
    prompt's tokens): a loaded model's own, else the cached ones, else its
    tokenizer alone loaded now, off the event loop. The name is resolved as
    `lease_model` does it (an unknown one is the same 404)."""
    pool: ModelPool = http.app.state.pool
    slot = slot_of(http, requested)
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


async def lease_model(http: HTTPRequest, requested: str | None, keep_alive=None) -> Lease:
    """The requested model, loaded and held for this request (release the lease
    when the request is done). Pool errors become API errors naming `model`."""
    pool: ModelPool = http.app.state.pool
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


# ---- what the settings say ----------------------------------------------------


def model_dirs_of(settings: Settings) -> list[Path]:
    return [Path(d).expanduser() for d in (settings.model_dir, *settings.extra_model_dirs)]


def hf_cache_of(settings: Settings) -> Path | bool:
    return default_hf_cache() if settings.hf_cache else False
