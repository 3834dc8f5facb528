"""Model assembly: the pool of the models the settings name or the model
folders hold, each served (load, engine, turns) when a request asks for it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from tierlm.cache.block_hash import model_fingerprint
from tierlm.config import Settings, resolve_alias, total_memory
from tierlm.engine.core import WARM_AT_SERVER_START_S, EngineCore
from tierlm.engine.lockstep import fingerprint_key
from tierlm.models.default_model import ensure_default_model
from tierlm.models.model_folder import CHAT
from tierlm.models.loader import load_model, load_tokenizer, read_model_info, tokenizer_stamp
from tierlm.pool.discovery import ModelEntry, default_hf_cache, discover, folders_signature, read_entry
from tierlm.pool.pool import ModelPool
from tierlm.serving import piece_store
from tierlm.serving.encoder import serve_encoder
from tierlm.serving.prompt_pieces import encoder_for
from tierlm.serving.served_model import ServedModel
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
            tokenizer = load_tokenizer(path)
            # the prompt tokenizer's probe renders a chat here, beside the load: the
            # first request finds the template compiled (~10 ms on the H200's host)
            folder, _ = settings.ssd_tier()
            encoder_for(tokenizer, piece_store.path_for(folder, path, tokenizer_stamp(path)) if folder else None)
            future.set_result(_model_turns(tokenizer, settings))
        except Exception as e:  # noqa: BLE001 (the waiting load or request gets it)
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]
            future.set_exception(e)


def make_pool(settings: Settings, model_path: Path | None, lockstep=None) -> ModelPool:
    """Every model in the model folders, and the one `--model` names (the
    default: loaded at start, never unloaded for being idle; over several ranks
    when `lockstep` is this rank's place among them)."""
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
        lambda entry: serve(entry, current.settings.for_model(entry.name), entry.name == default, current.turns,
                            lockstep=lockstep if entry.name == default else None),
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
    """The memory a model's weights will take once loaded, before it has been.
    On MLX's CPU backend a model quantized in a format tierlm's kernels take
    (4, 5 or 8 bits) stays quantized, its scales and biases in float32 (a group
    of 32 values holds 1 bit a value more than in 16 bits); other weights run in
    float32, with a bfloat16 copy beside for AMX. Erring high only makes the
    first load evict more."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or settings.cpu_weights_dtype not in ("auto", "float32", "quantized"):
        return entry.size_bytes
    bits = int(entry.quantization.split("-bit")[0]) if entry.quantization and "-bit" in entry.quantization else 16
    if bits in (4, 5, 8) and settings.cpu_weights_dtype != "float32":
        return int(entry.size_bytes * (bits + 2) / (bits + 1))
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
                turns_cache: TurnsCache | None = None, grammars: bool = True, lockstep=None) -> ServedModel:
    """Load a model and start its engine: what the pool keeps for it, and what
    tierlm.LLM runs. The tokenizer and turns come from `turns_cache`, or load
    beside the weights. `grammars`: build llguidance's view of the tokenizer
    (tools and JSON answers need it; the Python API does not). An encoder
    (embeddings, rerank) is served by an engine of its own (serving/encoder.py)."""
    aliases = ("default",) if is_default else ()
    if entry.kind != CHAT:
        return await serve_encoder(entry, settings, aliases)
    info = read_model_info(entry.path, entry.name)
    turns_future = (turns_cache or TurnsCache(1)).future(entry.path, settings)
    engine = make_engine(entry, info.name, settings, lambda: turns_future.result().tokenizer, lockstep)
    if is_default:  # loaded at the server's start, no request waiting: a first start compiles every shape
        engine.warm_at_start_s = WARM_AT_SERVER_START_S
    await engine.start()
    turns = await asyncio.wrap_future(turns_future)  # done: the load waited for it
    if grammars:
        _build_ll_tokenizer(turns)
    return ServedModel(info, engine, aliases=aliases, turns=turns, settings=settings)


def make_engine(entry: ModelEntry, name: str, settings: Settings, tokenizer, lockstep=None) -> EngineCore:
    """The engine of a model folder. Over several ranks (`lockstep`: the model
    `--model` names, on every rank) each rank loads its shard; the CPU backend's
    own kernels stay out there (they would replace the sharded products)."""
    memory = settings.memory_limit_bytes() or total_memory()
    sharded = lockstep is not None
    return EngineCore(name, lambda: load_model(
        entry.path, settings.cpu_weights_dtype, memory, use_cpu_kernels=settings.cpu_kernels and not sharded,
        use_amx=settings.cpu_amx and not sharded, tokenizer=tokenizer,
        shard_group=lockstep.group if sharded else None),
        settings, model_fingerprint(entry.path, fingerprint_key(lockstep)), lockstep=lockstep)


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


# ---- what the settings say ----------------------------------------------------


def resolve_model(settings: Settings) -> Path:
    """The folder of the model the settings name: a folder, a model's name in
    the model folder, or "default" (the built-in model, fetched on first use)."""
    if settings.model and settings.model != "default":
        path = Path(settings.model).expanduser()
        if not path.is_dir():
            candidate = Path(settings.model_dir).expanduser() / settings.model
            path = candidate if candidate.is_dir() else path
        return path
    return ensure_default_model(Path(settings.model_dir).expanduser())


def model_dirs_of(settings: Settings) -> list[Path]:
    return [Path(d).expanduser() for d in (settings.model_dir, *settings.extra_model_dirs)]


def hf_cache_of(settings: Settings) -> Path | bool:
    return default_hf_cache() if settings.hf_cache else False
