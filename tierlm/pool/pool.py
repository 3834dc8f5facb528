"""The model pool: which models are loaded, loading one when a request asks
for it, and unloading idle ones to stay under the memory budget.

The pool holds what a factory builds for a model (the API's served model: an
engine and what the adapters need of it) and knows of it only `.engine`. A
request holds a `Lease` while it runs: a leased model is never evicted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from tierlm.pool.discovery import ModelEntry

log = logging.getLogger(__name__)

FOREVER = None  # a keep-alive of None: never unloaded for being idle
BUSY_WAIT_S = 120.0  # how long a load waits for busy models to free memory before a 503
PAUSE_WAIT_S = 30.0  # how long a new request waits out a memory pause before a 503
RELIEVE_WAIT_S = 60.0  # how long an engine's worker waits for the pool to unload idle models


class PoolError(Exception):
    """A request the pool cannot serve: `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Slot:
    """One model the pool knows of, loaded or not."""

    entry: ModelEntry
    served: Any = None  # what the factory built; None while not loaded
    loading: asyncio.Task | None = None
    memory_bytes: int = 0  # what loading it took, measured
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    unload_at: float | None = None  # when it goes if still idle (keep-alive); None: never
    pinned: bool = False

    @property
    def state(self) -> str:
        if self.served is not None:
            return "pinned" if self.pinned else "loaded"
        return "loading" if self.loading is not None else "available"


class Lease:
    """A request's hold on a loaded model; `release` once it is done (a lease
    dropped unreleased is released when collected, so none is leaked)."""

    def __init__(self, pool: ModelPool, slot: Slot, keep_alive: float | None | str):
        self.pool, self.slot, self.keep_alive = pool, slot, keep_alive
        self.released = False

    @property
    def served(self):
        return self.slot.served

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._release(self.slot, self.keep_alive)

    def __del__(self):
        self.release()


DEFAULT_KEEP_ALIVE = "default"  # a lease's keep-alive when the request sent none


class ModelPool:
    def __init__(
        self,
        entries: dict[str, ModelEntry],
        factory: Callable[[ModelEntry], Awaitable[Any]],
        budget_bytes: int,
        keep_alive_s: Callable[[str], float | None],
        resolve_alias: Callable[[str], str | None] = lambda name: None,
        pinned: frozenset[str] = frozenset(),
        default: str | None = None,
        rediscover: Callable[[], dict[str, ModelEntry]] | None = None,
        folders_signature: Callable[[], object] | None = None,
        first_estimate: Callable[[ModelEntry], int] = lambda entry: entry.size_bytes,
    ):
        self.slots = {name: Slot(entry, pinned=name in pinned) for name, entry in entries.items()}
        self.factory, self.budget_bytes = factory, budget_bytes
        self.keep_alive_s, self.resolve_alias = keep_alive_s, resolve_alias
        self.default = default
        self.rediscover = rediscover  # the models there are now (`refresh`)
        # changes whenever what `rediscover` finds may have (None: assume it always has)
        self.folders_signature = folders_signature
        self._scanned: object = None  # the signature the slots were last matched against
        self._gone: set[str] = set()  # models whose folder went while loaded: dropped once unloaded
        self.first_estimate = first_estimate  # what a model never loaded here will take
        self._load_lock = asyncio.Lock()  # one load at a time: its memory is measured alone
        self._freed = asyncio.Event()  # set whenever a model is released or unloaded
        self._reaper: asyncio.Task | None = None
        self._estimates: dict[str, int] = {}  # model path -> what it took to load last time
        self.current: Any = None  # what its maker keeps beside it (the API: the settings in force)
        self.paused: str | None = None  # why new requests wait (the memory enforcer), or None
        self.waiting_for_memory = 0  # requests waiting out a pause now
        self._resumed = asyncio.Event()

    # ---- names --------------------------------------------------------------

    def resolve(self, requested: str | None) -> Slot:
        """The slot a request's model name means: the default for none (or
        "default"), a model's name, then the aliases of the settings. An unknown
        name is a 404 naming what exists, never another model in its place."""
        if requested in (None, "", "default") and self.default is not None:
            return self.slots[self.default]
        slot = self._named(requested)
        if slot is None or (slot.served is None and not slot.entry.path.is_dir()):
            self.refresh()  # pulled or copied in since, or its folder deleted
            slot = self._named(requested)
        if slot is None:
            names = ", ".join(sorted(self.slots)) or "none"
            raise PoolError(404, f"The model '{requested}' does not exist. Models here: {names}", "model_not_found")
        return slot

    def _named(self, requested: str) -> Slot | None:
        if requested in self.slots:
            return self.slots[requested]
        for slot in self.slots.values():
            if requested == str(slot.entry.path):
                return slot
        return self.slots.get(self.resolve_alias(requested))

    def refresh(self) -> None:
        """Match the models to the model folders as they are now, when their
        signature says they may have changed: a model pulled or copied in is
        added; one whose folder is gone is dropped, but only once it is not
        loaded (a loaded one serves on from memory until it is unloaded). The
        default model is always kept."""
        if self.rediscover is None:
            return
        # taken first: a change during the scan is seen next time
        signature = self.folders_signature() if self.folders_signature is not None else object()
        if signature != self._scanned:
            self._scanned = signature  # a scan that fails is not tried again until the folders change
            try:
                found = self.rediscover()
            except Exception:  # a listing shows what it knew: never a 500 for it
                log.warning("looking at the model folders again failed; the models stay as they were",
                            exc_info=True)
                return
            self._match(found)
        self._drop_gone()

    def _match(self, found: dict[str, ModelEntry]) -> None:
        """Slots for the models found that have none; the ones not found are gone."""
        # the default's folder is its slot alone, whatever name the folder would give it (a link
        # to that folder, by another name, is a model of its own)
        default = os.path.abspath(self.slots[self.default].entry.path) if self.default is not None else None
        found = {n: e for n, e in found.items() if n == self.default or os.path.abspath(e.path) != default}
        for name, entry in found.items():
            slot = self.slots.get(name)
            if slot is None:
                log.info("found model %s at %s", name, entry.path)
                self.slots[name] = Slot(entry)
            elif slot.entry != entry and slot.served is None and slot.loading is None:
                slot.entry = entry  # replaced on disk (a new pull): its next load reads the new one
        self._gone = {name for name in self.slots if name not in found and name != self.default}

    def _drop_gone(self) -> None:
        """The slots of models whose folder is gone, once nothing holds them."""
        for name in list(self._gone):
            slot = self.slots.get(name)
            if slot is None or (slot.served is None and slot.loading is None and slot.in_flight == 0):
                self._gone.discard(name)
                if self.slots.pop(name, None) is not None:
                    log.info("model %s: its folder %s is gone, no longer listed", name, slot.entry.path)

    # ---- leases -------------------------------------------------------------

    async def acquire(self, requested: str | None, keep_alive=DEFAULT_KEEP_ALIVE) -> Lease:
        """The model, loaded (a load in progress is waited for, never repeated),
        held until the lease is released."""
        slot = self.resolve(requested)
        if self.paused is not None:
            await self._wait_unpaused()
            slot = self.resolve(requested)  # the folders may have changed meanwhile
        while slot.served is None:
            if slot.loading is None:
                slot.loading = asyncio.create_task(self._load(slot))
            try:
                await asyncio.shield(slot.loading)
            finally:
                if slot.loading is not None and slot.loading.done():
                    slot.loading = None
        slot.in_flight += 1
        slot.last_used, slot.unload_at = time.monotonic(), None
        return Lease(self, slot, keep_alive)

    async def _wait_unpaused(self) -> None:
        """While admission is paused, wait for it to resume, up to PAUSE_WAIT_S; then a 503."""
        if self.paused is None:
            return
        reason = self.paused
        self.waiting_for_memory += 1
        try:
            await asyncio.wait_for(self._resumed.wait(), timeout=PAUSE_WAIT_S)
        except asyncio.TimeoutError:
            raise PoolError(503, f"the server is short of memory ({reason}); this request waited "
                            f"{PAUSE_WAIT_S:.0f} s for it to drop. Try again later", "memory_pressure") from None
        finally:
            self.waiting_for_memory -= 1

    def pause(self, reason: str) -> None:
        """New requests wait (acquire) until `resume`."""
        self.paused = reason
        self._resumed.clear()

    def resume(self) -> None:
        self.paused = None
        self._resumed.set()

    def _release(self, slot: Slot, keep_alive) -> None:
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        if slot.in_flight == 0:
            seconds = self.keep_alive_s(slot.entry.name) if keep_alive == DEFAULT_KEEP_ALIVE else keep_alive
            slot.unload_at = None if seconds is FOREVER or slot.pinned else slot.last_used + seconds
        self._freed.set()

    # ---- loading and unloading ----------------------------------------------

    async def _load(self, slot: Slot) -> None:
        async with self._load_lock:
            if slot.served is not None:
                return
            await self._make_room(slot)
            before = mx.get_active_memory()
            log.info("loading %s (%s)", slot.entry.name, slot.entry.path)
            tic = time.monotonic()
            try:
                slot.served = await self.factory(slot.entry)
            except Exception as e:
                log.exception("could not load %s", slot.entry.name)
                raise PoolError(503, f"could not load {slot.entry.name}: {type(e).__name__}: {e}",
                                "model_load_failed") from e
            # the weights as the engine counts them, or what MLX allocated meanwhile
            profile = getattr(slot.served.engine, "profile", None)
            slot.memory_bytes = max(getattr(profile, "weight_bytes", 0), mx.get_active_memory() - before)
            self._estimates[str(slot.entry.path)] = slot.memory_bytes
            slot.served.engine.memory_elsewhere = lambda: self._held_beside(slot)
            slot.served.engine.on_memory_pressure = self._pressure_hook(slot)
            slot.last_used, slot.unload_at = time.monotonic(), None
            log.info("loaded %s in %.1f s: %.0f MiB", slot.entry.name, time.monotonic() - tic,
                     slot.memory_bytes / 2**20)

    def estimate_bytes(self, slot: Slot) -> int:
        """What loading the model will take: measured the last time it loaded,
        else the maker's estimate (its weights on disk, as the device holds them)."""
        measured = self._estimates.get(str(slot.entry.path))
        return measured if measured is not None else self.first_estimate(slot.entry)

    def used_bytes(self) -> int:
        return sum(s.memory_bytes for s in self.slots.values() if s.served is not None)

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until `slot` fits;
        wait for busy ones to finish when that is what it takes. A model that
        cannot fit even alone (beside the pinned ones) is a 507."""
        needed = self.estimate_bytes(slot)
        fixed = sum(s.memory_bytes for s in self.slots.values() if s.served is not None and s.pinned)
        if needed + fixed > self.budget_bytes:
            raise PoolError(507, f"{slot.entry.name} needs about {needed / 2**20:.0f} MiB; the model memory "
                            f"budget is {self.budget_bytes / 2**20:.0f} MiB, {fixed / 2**20:.0f} MiB of it "
                            "held by pinned models", "insufficient_memory")
        deadline = time.monotonic() + BUSY_WAIT_S
        while (over := self.used_bytes() + needed - self.budget_bytes) > 0:
            if await self.evict_idle(over, f"to make room for {slot.entry.name}"):
                continue
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise PoolError(503, f"no memory for {slot.entry.name}: the loaded models stayed busy",
                                "model_busy") from None

    def idle_slots(self, spare: Slot | None = None) -> list[Slot]:
        """Loaded models that may be unloaded now (not pinned, nothing in flight,
        not `spare`), least recently used first."""
        idle = [s for s in self.slots.values()
                if s.served is not None and not s.pinned and s.in_flight == 0 and s is not spare]
        return sorted(idle, key=lambda s: s.last_used)

    async def evict_idle(self, needed: int, why: str, spare: Slot | None = None) -> int:
        """Unload idle models, least recently used first, until `needed` bytes are
        freed (as measured at their loads) or none is left; how many went."""
        freed = unloaded = 0
        while freed < needed and (idle := self.idle_slots(spare)):
            victim = idle[0]
            log.info("unloading %s: %s", victim.entry.name, why)
            freed += victim.memory_bytes
            unloaded += 1
            await self._unload(victim)
        return unloaded

    def _held_beside(self, slot: Slot) -> int:
        """What the other loaded models hold (read from an engine's worker thread)."""
        while True:
            try:
                slots = list(self.slots.values())
                return sum(s.memory_bytes for s in slots if s is not slot and s.served is not None)
            except RuntimeError:  # a model was found meanwhile: the dict changed size
                continue

    def _pressure_hook(self, slot: Slot) -> Callable[[int], bool]:
        """The engine's prefill-eviction hook (EngineCore.on_memory_pressure): on
        its worker thread, a request to `slot` lacks `missing` bytes; the pool
        unloads other idle models on its loop (joining *their* workers, never
        this one's) and says whether any went. Made on the pool's loop."""
        loop = asyncio.get_running_loop()

        def relieve(missing: int) -> bool:
            if loop.is_closed():
                return False
            why = f"a request to {slot.entry.name} needs {missing / 2**20:.0f} MiB more to fit"
            future = asyncio.run_coroutine_threadsafe(self.evict_idle(missing, why, spare=slot), loop)
            try:
                return future.result(RELIEVE_WAIT_S) > 0
            except Exception:
                future.cancel()
                log.warning("unloading idle models for %s did not finish", slot.entry.name, exc_info=True)
                return False

        return relieve

    async def load(self, requested: str) -> Slot:
        """Load a model without a request (POST /v1/models/{id}/load)."""
        lease = await self.acquire(requested)
        slot = lease.slot
        lease.release()
        return slot

    async def unload(self, requested: str, force: bool = False) -> bool:
        """Unload a model: after its requests in flight, or aborting them with
        `force`. Whether it was loaded."""
        slot = self.resolve(requested)
        if slot.loading is not None:
            await asyncio.gather(slot.loading, return_exceptions=True)
        if slot.served is None:
            return False
        if force:
            slot.served.engine.abort_all_requests()
        while slot.in_flight and slot.served is not None:
            self._freed.clear()
            await self._freed.wait()
        if slot.served is not None:
            await self._unload(slot)
        return True

    async def _unload(self, slot: Slot) -> None:
        served, slot.served, slot.memory_bytes = slot.served, None, 0
        tic = time.monotonic()
        await served.engine.close()
        log.info("unloaded %s in %.1f s", slot.entry.name, time.monotonic() - tic)
        self._freed.set()

    # ---- keep-alive ---------------------------------------------------------

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """Once a second: unload the models whose keep-alive ran out."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in list(self.slots.values()):
                due = slot.unload_at is not None and now >= slot.unload_at
                if due and slot.served is not None and slot.in_flight == 0 and not slot.pinned:
                    log.info("unloading %s: idle for its keep-alive", slot.entry.name)
                    slot.unload_at = None
                    await self._unload(slot)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.slots.values():
            if slot.loading is not None:
                await asyncio.gather(slot.loading, return_exceptions=True)
            if slot.served is not None:
                await self._unload(slot)

    # ---- what it shows --------------------------------------------------------

    def listing(self) -> list[dict]:
        return [self.describe(slot) for _, slot in sorted(self.slots.items())]

    def describe(self, slot: Slot) -> dict:
        """What the pool knows of one model (listed or not: a slot dropped by a
        refresh while a route still holds it is described all the same)."""
        now = time.monotonic()
        return {
            "name": slot.entry.name,
            "state": slot.state,
            "size_bytes": slot.entry.size_bytes,
            "context_length": slot.entry.context_length,
            "memory_bytes": slot.memory_bytes if slot.served is not None else None,
            "in_flight": slot.in_flight,
            "idle_s": round(now - slot.last_used, 1) if slot.served is not None else None,
            "expires_in_s": None if slot.unload_at is None else round(max(0.0, slot.unload_at - now), 1),
        }
