"""EngineCore: the asyncio side of one loaded model.

The event loop never touches MLX. It hands scheduler steps to one worker thread
(`run_in_executor`), several steps per job (a decode burst bounded by a time
budget), and keeps the next burst queued behind the running one so the worker
never waits for the loop. Tokens do not wait for a burst to end: the worker
posts them to an ordered outbox at most every `stream_flush_ms` and wakes the
loop, which routes them into per-request collectors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from tierlm import backends
from tierlm.cache.codecs import codecs_for
from tierlm.cache.prefix_cache import PrefixCache
from tierlm.config import Settings
from tierlm.engine import allocator, half_kv, key_scaling, ownership, warmup, workers
from tierlm.engine.collector import OutputCollector
from tierlm.engine.lockstep import Lockstep
from tierlm.engine.draft_model import load_draft_model
from tierlm.engine.memory_guard import MemoryGuard, ModelProfile, default_memory_limit, profile_model
from tierlm.engine.quantized_kv import why_not_quantized
from tierlm.engine.request import FinishReason, MemoryGuardError, Request, RequestOutput
from tierlm.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

PRELOAD_SHARE = 0.5  # of the hot tier, filled from SSD at start at most: the rest stays free for new blocks
# Reading blocks back from SSD before the engine reports ready, at most (the rest
# while idle): a request right after a restart (an agent retrying) then finds the
# prompts served before in memory. ~1.5 GB/s from disk: 20k tokens of a 1B
# model's KV (640 MiB) take ~0.7 s.
PRELOAD_BEFORE_READY_S = 2.0
WARM_ON_REQUEST_S = 5.0  # warming before ready of a model a request waits for (unless warmup_wait_s)
WARM_AT_SERVER_START_S = 120.0  # of the default model at a server's start: every shape (~15 s on a new H200)


def parameter_layout(model) -> bytes:
    """Names, shapes and dtypes of the weights as loaded, and the backend's tag
    for how their products run: a cast or another arithmetic changes the KV."""
    from mlx.utils import tree_flatten

    layout = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(model.parameters()))
    return repr(layout).encode() + backends.describe(model).layout_tag


def prefill_step_for(device) -> int:
    """Prompt tokens per prefill chunk: the device's backend's (tierlm.backends)."""
    return backends.prefill_step_for(device)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class EngineCore:
    ORPHAN_GRACE_S = 60.0  # a request's reader gone this long: its mailbox is dropped

    def __init__(self, name: str, load: Callable[[], tuple], settings: Settings | None = None,
                 fingerprint: bytes = b"", lockstep: Lockstep | None = None):
        """`load` returns (model, tokenizer); it runs on the engine's worker thread.
        `settings`: resolved for this model (Settings.for_model); `fingerprint`: of
        the weights on disk, for the prefix cache's keys (cache.block_hash).
        `lockstep`: this rank's place when the model runs over several ranks
        (engine/lockstep.py): no warm-up and no speculation there yet."""
        self.name, self._load, self.fingerprint = name, load, fingerprint
        self.lockstep = lockstep
        self.out_of_step: str | None = None  # why the ranks' lockstep broke (then the engine stops)
        self.model = self.tokenizer = None
        self.config = settings or Settings()
        self.profile: ModelProfile | None = None
        self.kv_bits = 16  # what the batch keeps attention KV at, once loaded (`batch_kv_bits`)
        self.kv_half = False  # ... and at 16 bits on a CPU: float16, not float32 as computed (engine.half_kv)
        self.key_scales: list | None = None  # per layer, what quantized keys are divided by (engine.key_scaling)
        # warming before ready, where `warmup_wait_s` is not set: a model loaded on
        # request has one waiting; the default model at a server's start has none,
        # and warms every shape (serving.assembly)
        self.warm_at_start_s = WARM_ON_REQUEST_S
        self.scheduler: Scheduler | None = None
        self._stream = None  # the worker's MLX stream
        self._lent: workers.Worker | None = None  # the worker thread and stream, from start to close
        self._worker = None  # its executor
        self._collectors: dict[str, OutputCollector] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # outputs posted by the worker, in the order it made them, for the loop to
        # route (`_drain`): one channel for those of a burst under way and those of
        # its end, so a reader never gets a later piece before an earlier one
        self._posted: deque[list[RequestOutput]] = deque()
        self._task: asyncio.Task | None = None
        self._warm_jobs: list[warmup.WarmJob] = []  # still to run, while idle
        self._preloading = False  # SSD blocks still to read back into memory, while idle (`ssd_preload`)
        self.warm_seconds = 0.0  # spent warming so far
        self._closed = False
        self._last_log = time.monotonic()
        self._last_generated = 0
        self.bursts = 0
        self.failed_bursts = 0  # in a row; reset by a burst that works
        self.last_failure: str | None = None
        self._burst_started: float | None = None  # when the burst now on the worker began
        self._watchdog: asyncio.Task | None = None
        # set by a pool serving several models: the memory the others hold, and the
        # prefill-eviction hook, called on the worker thread with the bytes a request
        # lacks before it is refused for memory, which unloads idle models and
        # returns whether any went
        self.memory_elsewhere: Callable[[], int] | None = None
        self.on_memory_pressure: Callable[[int], bool] | None = None

    # ---- life cycle -------------------------------------------------------

    async def start(self) -> None:
        """Loads the model on a worker thread lent for this engine's life (kept
        across engines: tierlm.engine.workers); one that fails to load gives
        back what it took."""
        loop = asyncio.get_running_loop()
        self._lent = workers.lend(self.name)
        self._worker = self._lent  # the Executor that runs on it
        try:
            self.scheduler = await loop.run_in_executor(self._worker, self._build_scheduler)
        except BaseException:
            await loop.run_in_executor(self._worker, self._teardown)
            self._give_back_worker()
            raise
        self._wake = asyncio.Event()
        self._loop = loop
        self._task = asyncio.create_task(self._run_loop(), name=f"engine-{self.name}")
        self._task.add_done_callback(self._on_loop_exit)
        self._watchdog = asyncio.create_task(self._watch(), name=f"watchdog-{self.name}")

    def _build_scheduler(self) -> Scheduler:
        """Runs on the worker thread, which owns this engine's model and MLX stream."""
        self._lent.name_thread(self.name)
        stream = self._stream = self._lent.stream
        self.model, self.tokenizer = self._load()
        ownership.claim(self.model, self.name)
        with mx.stream(stream):
            self.kv_bits = self._batch_kv_bits()
            self.kv_half = self._batch_kv_half()
            self.key_scales = self._key_scales()
            self.profile = profile_model(self.model, self.kv_bits, backends.describe(self.model).kv_tail,
                                         self.kv_half)
        draft = self._load_draft()
        limit = self.config.memory_limit_bytes() or default_memory_limit()
        prefill_step = self.config.prefill_step_size or prefill_step_for(mx.default_device())
        guard = MemoryGuard(self.profile, limit, prefill_step, stores_blocks=self.config.prefix_cache)
        sched_config = SchedulerConfig(
            max_running=self.config.max_concurrent_requests,
            prefill_step_size=prefill_step,
            stall_timeout_s=self.config.stall_timeout_s,
            speculative_tokens=self.config.speculative_tokens if self._speculates() else 0,
            draft_model=draft,
            kv_bits=self.kv_bits,
            kv_half=self.kv_half,
            key_scales=self.key_scales,
            kv_tail=backends.describe(self.model).kv_tail,
        )
        log.info(
            "engine %s ready: weights %.0f MiB, KV %.1f KiB/token, memory limit %.0f MiB",
            self.name,
            self.profile.weight_bytes / 2**20,
            self.profile.kv_bytes_per_token / 2**10,
            limit / 2**20,
        )
        cache = self._make_prefix_cache()
        scheduler = Scheduler(self.model, self.tokenizer, sched_config, guard, stream, cache,
                              self._elsewhere, self._relieve, lockstep=self.lockstep)
        # not over several ranks: each would preload its own blocks, in its own time
        self._preloading = cache is not None and cache.ssd is not None and self.config.ssd_preload \
            and self.lockstep is None
        if self._warms(mx.default_device()):
            self._warm_jobs = warmup.warm_shapes(self.config.max_concurrent_requests,
                                                 long_context=self._long_warm_tokens(guard, prefill_step),
                                                 prefill_step=prefill_step)
            self._warm_before_ready(scheduler)
        if self._preloading:
            self._preload_before_ready(cache)
        return scheduler

    def _long_warm_tokens(self, guard: MemoryGuard, prefill_step: int) -> int:
        """The long prompt a GPU warms: within the model's context (and the
        configured limit), and alone within the memory limit. None where the
        batch keeps KV quantized: its attention builds no graphs (backends.gpu)."""
        if self.kv_bits != 16:
            return 0
        context = [n for n in (self._model_context(), self.config.context_limit) if n]

        def fits(tokens: int) -> bool:
            try:
                guard.check_alone(tokens, warmup.DECODE_STEPS)
            except MemoryGuardError:
                return False
            return True

        return warmup.long_context_tokens(min(context, default=None), prefill_step, fits)

    def _model_context(self) -> int | None:
        """The positions the loaded model's arguments say it takes (None: not said)."""
        return getattr(getattr(self.model, "args", None), "max_position_embeddings", None)

    def _speculates(self) -> bool:
        """Whether requests draft tokens (`speculation`). `auto`: where the
        backend's products are batch-invariant (MLX's CPU backend with tierlm's
        AVX-512 or AVX2 kernels), so greedy answers are the same with drafts or
        without; elsewhere verifying several tokens at once moves rounding, and
        on a GPU prompt lookup alone does not pay yet (docs/speculation.md);
        and wherever a draft model is named. Never over several ranks (yet):
        a rank's drafts would have to be every rank's."""
        if self.lockstep is not None:
            return False
        setting = self.config.speculation
        if setting == "auto" and self.config.draft_model:
            return True
        return setting == "prompt-lookup" or (setting == "auto" and backends.describe(self.model).batch_invariant)

    def _batch_kv_bits(self) -> int:
        """Worker thread: the bits the batch keeps attention KV at: `batch_kv_bits`
        where the model's layers allow it (else 16, and the log says why)."""
        bits = self.config.batch_kv_bits
        if bits in (None, 16):
            return 16
        why = "not over several ranks (yet)" if self.lockstep is not None else why_not_quantized(self.model)
        if why:
            log.warning("engine %s: KV kept at 16 bits in the batch, not %d: %s", self.name, bits, why)
            return 16
        log.info("engine %s: KV kept at %d bits in the batch", self.name, bits)
        return bits

    def _batch_kv_half(self) -> bool:
        """Worker thread: whether the batch keeps attention KV at float16 where
        the model computes it at float32 (`batch_kv_bits` 16 on a CPU; on a GPU
        16 bits is as computed). Where it cannot, float32, and the log says why."""
        if self.config.batch_kv_bits != 16 or mx.default_device().type != mx.DeviceType.cpu:
            return False
        why = "not over several ranks (yet)" if self.lockstep is not None else half_kv.why_not_half(self.model)
        if why:
            log.warning("engine %s: KV kept as computed in the batch, not at float16: %s", self.name, why)
            return False
        log.info("engine %s: KV kept at float16 in the batch", self.name)
        return True

    def _key_scales(self) -> list | None:
        """Worker thread: per layer, the factors quantized keys are kept divided
        by (engine.key_scaling), in the batch and in the tiers' blocks, from a
        calibration prompt; None where both keep 16 bits."""
        tiers = self.config.cache_kv_bits if self.config.prefix_cache else 16
        if self.kv_bits == 16 and tiers == 16:
            return None
        tic = time.perf_counter()
        try:
            scales = key_scaling.calibrate(self.model,
                                           key_scaling.calibration_tokens(self.tokenizer, self._model_context()))
        except Exception as e:  # quantized KV still works, unscaled: answers move more
            log.warning("engine %s: key channels not scaled (the calibration prompt failed: %s)", self.name, e)
            return None
        largest = max((float(s.factors.max()) for s in scales if s is not None), default=1.0)
        log.info("engine %s: key channels scaled for quantized KV (largest factor %g), calibrated in %.1f s",
                 self.name, largest, time.perf_counter() - tic)
        return scales

    def _load_draft(self):
        """The draft model (`draft_model`), where one is named and requests
        draft: loaded beside the model, its weights and KV counted in the
        model's profile. A missing one, or one of another tokenizer, fails the
        start with ValueError."""
        if not self.config.draft_model or not self._speculates():
            return None
        draft = load_draft_model(self.config, self.tokenizer)
        with mx.stream(self._stream):
            extra = profile_model(draft)
        self.profile = dataclasses.replace(
            self.profile, weight_bytes=self.profile.weight_bytes + extra.weight_bytes,
            kv_bytes_per_token=self.profile.kv_bytes_per_token + extra.kv_bytes_per_token)
        log.info("engine %s: draft model %s (%.0f MiB)", self.name, self.config.draft_model,
                 extra.weight_bytes / 2**20)
        return draft

    def _warms(self, device) -> bool:
        """Whether batch shapes are warmed (before ready, then while idle): `warmup`,
        by default on a GPU (MLX's CPU backend compiles nothing per shape)."""
        if self.lockstep is not None:  # a warm-up step would have to run on every rank
            return False
        return self.config.warmup if self.config.warmup is not None else device != mx.cpu

    @property
    def warming(self) -> bool:
        """Whether batch shapes are still to be warmed (the engine serves meanwhile)."""
        return bool(self._warm_jobs)

    @property
    def preloading(self) -> bool:
        """Whether blocks are still being read back from SSD while idle (`ssd_preload`)."""
        return self._preloading

    @property
    def shapes_to_warm(self) -> list[warmup.WarmJob]:
        """The warm jobs still to run, in order."""
        return list(self._warm_jobs)

    def _warm_before_ready(self, scheduler: Scheduler) -> None:
        """Worker thread, at start: warm jobs for up to `warmup_wait_s` (a restart
        whose kernels are on disk warms them all in that time), the rest while idle."""
        wait = self.config.warmup_wait_s
        deadline = time.monotonic() + (wait if wait is not None else self.warm_at_start_s)
        while self._warm_jobs and time.monotonic() < deadline:
            self._warm_next(scheduler)
        if self._warm_jobs:
            log.info("engine %s: %d batch shapes left to warm while idle", self.name, len(self._warm_jobs))

    def _warm_next(self, scheduler: Scheduler) -> None:
        """Worker thread: the next warm job; a failing one ends warming (logged).
        `scheduler`: the engine's, whose settings a requests job's own takes."""
        batch, prompt_len, requests, widths = self._warm_jobs.pop(0)
        try:
            if widths:
                seconds = warmup.run_widths(self.model, self._stream, prompt_len)
            elif requests:
                seconds = warmup.run_requests(lambda: self._scratch_scheduler(scheduler), batch, prompt_len)
            else:
                seconds = warmup.run_shape(self.model, self._stream, batch, prompt_len,
                                           scheduler.config.prefill_step_size,
                                           self.config.speculative_tokens if self._speculates() else 0,
                                           self.kv_bits, self.key_scales)
        except Exception:
            log.exception("engine %s: warming batch %d failed; warming stops", self.name, batch)
            self._warm_jobs.clear()
            return
        self.warm_seconds += seconds
        log.debug("engine %s: batch %d warmed in %.2f s", self.name, batch, seconds)
        if not self._warm_jobs:
            log.info("engine %s: batch shapes up to %d warmed in %.1f s", self.name,
                     self.config.max_concurrent_requests, self.warm_seconds)

    def _preload_before_ready(self, cache) -> None:
        """Worker thread, at start, after the warm-up: preload steps for up to
        PRELOAD_BEFORE_READY_S (the rest while idle)."""
        deadline = time.monotonic() + PRELOAD_BEFORE_READY_S
        while self._preloading and time.monotonic() < deadline:
            self._preload_next(cache)

    def _preload_next(self, cache) -> None:
        """Worker thread, at start and then while idle: a preload step
        (PrefixCache.preload_step) of the scheduler's `cache`, filling up to
        PRELOAD_SHARE of the hot tier; a failing one ends preloading."""
        try:
            more = cache.preload_step(int(cache.hot.capacity * PRELOAD_SHARE))
        except Exception:
            log.exception("engine %s: reading blocks back from SSD failed; preloading stops", self.name)
            more = False
        if not more:
            self._preloading = False
            if cache.stats.preloaded_blocks:
                log.info("engine %s: %d blocks (%.0f MiB) read back from SSD into memory", self.name,
                         cache.stats.preloaded_blocks, cache.stats.preloaded_bytes / 2**20)

    def _scratch_scheduler(self, like: Scheduler) -> Scheduler:
        """A scheduler with `like`'s settings and a prefix cache of its own (warm
        jobs): the layout of `like`'s, in memory alone, so nothing it stores
        reaches `like`'s (or its SSD folder)."""
        cache = like.cache and PrefixCache(b"warm-up", like.cache.codecs, like.cache.block_size,
                                           like.cache.hot.capacity, kv_bits=like.cache.kv_bits,
                                           key_scales=self.key_scales)
        return Scheduler(self.model, self.tokenizer, like.config, like.guard, self._stream, cache, self._elsewhere)

    def _elsewhere(self) -> int:
        measure = self.memory_elsewhere
        return 0 if measure is None else measure()

    def _relieve(self, missing: int) -> bool:
        """Worker thread: ask `on_memory_pressure` for `missing` bytes."""
        hook = self.on_memory_pressure
        if hook is None:
            return False
        try:
            return bool(hook(missing))
        except Exception:
            log.exception("engine %s: the memory-pressure hook failed", self.name)
            return False

    def _make_prefix_cache(self) -> PrefixCache | None:
        if not self.config.prefix_cache:
            return None
        layers = make_prompt_cache(self.model)
        codecs = codecs_for(layers)
        if codecs is None:
            kinds = sorted({type(c).__name__ for c in layers})
            log.info("prefix cache off for %s: no codec for cache type(s) %s", self.name, ", ".join(kinds))
            return None
        # blocks of float16 KV (engine.half_kv) are another computation's: keys of their own
        root = hashlib.sha256(self.fingerprint + parameter_layout(self.model)
                              + (b";kv=float16" if self.kv_half else b"")).digest()
        c = self.config
        hot_bytes, (ssd_dir, ssd_bytes) = c.hot_cache_bytes(), c.ssd_tier()
        block = c.cache_block_size or backends.cache_block_for(mx.default_device())
        cache = PrefixCache(root, codecs, block, hot_bytes, ssd_dir, ssd_bytes, c.ssd_write_through,
                            c.cache_kv_bits, self.key_scales)
        ssd = "off" if cache.ssd is None else f"{ssd_dir} ({ssd_bytes / 2**30:.1f} GiB, " + (
            "write-through)" if c.ssd_write_through else "write-back)")
        log.info("prefix cache for %s: blocks of %d tokens, layout %s, hot tier %.0f MiB, SSD tier %s",
                 self.name, cache.block_size, cache.signature, hot_bytes / 2**20, ssd)
        return cache

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def degraded(self) -> str | None:
        """Why the engine cannot be trusted to serve, or None: its steps keep
        failing, or the worker is stuck in one. A supervisor should restart it."""
        if self.failed_bursts >= self.config.degrade_after_failures:
            return f"the last {self.failed_bursts} engine steps failed: {self.last_failure}"
        return self.stuck

    @property
    def stuck(self) -> str | None:
        """Why the worker looks stuck in one step, or None."""
        started = self._burst_started
        if started is None or time.monotonic() - started <= self.config.stall_timeout_s:
            return None
        return f"the engine worker has been in one step for {time.monotonic() - started:.0f} s"

    async def close(self) -> None:
        """Stops the engine and gives back everything it holds: the hot tier is
        written back to the SSD tier (write-back mode: PrefixCache.close); on the
        worker thread the scheduler, the model and the tokenizer are dropped,
        their cycles collected and MLX's buffer cache emptied; the worker thread
        and its stream go back to be lent to the next engine, and the C heap's
        free pages go back to the system. Nothing of this engine keeps the model
        alive after."""
        self._closed = True
        if self._watchdog:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)  # it reads the scheduler
        self.abort_all_requests()
        if self._wake:
            self._wake.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                log.warning("engine %s loop did not stop cleanly", self.name)
                self._task.cancel()  # it must not read the scheduler the teardown drops
        if self._worker is not None:
            # last on the worker: what this engine queued there before has run
            await asyncio.get_running_loop().run_in_executor(self._worker, self._teardown)
            self._give_back_worker()
        self._task = self._watchdog = self._wake = None
        self._collectors.clear()
        freed = await asyncio.to_thread(allocator.trim_heap)
        if freed is not None:
            log.info("engine %s closed: %d MiB of free heap given back", self.name, freed >> 20)

    def _give_back_worker(self) -> None:
        lent, self._lent, self._worker = self._lent, None, None
        if lent is not None:
            workers.give_back(lent)

    def _teardown(self) -> None:
        """Worker thread, last job: close the scheduler (its prefix cache writes
        back), then drop every reference to the model and free what it held here,
        on the thread that owns its arrays. The load function goes too: a caller's
        closure may hold the model."""
        scheduler, model, stream = self.scheduler, self.model, self._stream
        self.scheduler = self.model = self.tokenizer = self._load = self._stream = None
        try:
            if scheduler is not None:
                scheduler.close()
        except Exception:
            log.exception("engine %s: closing the scheduler failed", self.name)
        finally:
            if model is not None:
                ownership.release(model, self.name)
            del scheduler, model
            if stream is not None:
                mx.synchronize(stream)  # a step's arrays in flight are freed once it ends
            gc.collect()  # the tokenizer's and mlx-lm's reference cycles hold arrays too
            mx.clear_cache()
            if self._lent is not None:
                self._lent.name_thread("idle")

    # ---- requests ---------------------------------------------------------

    def add_request(self, request: Request) -> OutputCollector:
        if not self.is_alive:
            raise EngineDeadError(f"engine {self.name} is not running")
        if request.request_id in self._collectors:
            raise ValueError(f"duplicate request id {request.request_id}")
        collector = OutputCollector(self.config.stream_interval)
        self._collectors[request.request_id] = collector
        request.stages.mark("submit")
        self.scheduler.add_request(request)
        self._wake.set()
        return collector

    async def stream_outputs(
        self, request: Request, keepalive_s: float | None = None
    ) -> AsyncIterator[RequestOutput | None]:
        """Yields outputs as they come; None every `keepalive_s` without one.
        Leaving early (the client went away) aborts the request."""
        collector = self.add_request(request)
        finished = False
        try:
            while not finished:
                output = await collector.get(timeout=keepalive_s)
                finished = output is not None and output.finished
                yield output
        finally:
            if not finished:
                self.abort_request(request.request_id)
            self._collectors.pop(request.request_id, None)

    async def generate(self, request: Request) -> RequestOutput:
        """The whole completion as one merged output."""
        result: RequestOutput | None = None
        async for output in self.stream_outputs(request):
            result = output if result is None else result.merge(output)
        return result

    def abort_request(self, request_id: str) -> None:
        if self.scheduler is not None:
            self.scheduler.abort(request_id)
            if self._wake:
                self._wake.set()

    def abort_all_requests(self) -> None:
        for request_id in list(self._collectors):
            self.abort_request(request_id)

    def fail_all_requests(self, message: str, error_type: str = "overloaded") -> int:
        """End every request in flight now with an error (its reader gets it at
        once; the worker stops generating it at its next step); how many. Its
        mailbox leaves the engine with the error in it: what a burst still makes
        for it cannot merge over the error."""
        failed = 0
        for request_id, collector in list(self._collectors.items()):
            if not collector.finished:
                self.abort_request(request_id)
                self._put_error(request_id, message, error_type)
                del self._collectors[request_id]
                failed += 1
        return failed

    async def on_worker(self, fn, *args):
        """Run `fn` on the worker thread, between two bursts."""
        if self._worker is None or self._closed:
            raise EngineDeadError(f"engine {self.name} is not running")
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def cache_stats(self) -> dict | None:
        cache = self.scheduler.cache
        return None if cache is None else await self.on_worker(cache.snapshot_stats)

    async def clear_cache(self, ssd: bool = False) -> int:
        cache = self.scheduler.cache
        return 0 if cache is None else await self.on_worker(cache.clear, ssd)

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # ---- the loop ---------------------------------------------------------

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        ahead: asyncio.Future | None = None  # the next burst, queued behind the running one
        while True:
            if ahead is None:
                if not self.scheduler.has_work():
                    if self._closed:
                        return
                    if self._warm_jobs:  # one at a time: a request waits for one job at most
                        await loop.run_in_executor(self._worker, self._warm_next, self.scheduler)
                        continue
                    if self._preloading:  # likewise, a few files a step
                        await loop.run_in_executor(self._worker, self._preload_next, self.scheduler.cache)
                        continue
                    self._wake.clear()
                    if not self.scheduler.has_work() and not self._closed:
                        await self._wake.wait()  # idle costs nothing
                    continue
                ahead = loop.run_in_executor(self._worker, self._burst)
            # Queue the following burst before waiting for this one: the worker starts
            # it the moment this one ends, instead of idling while this loop wakes up,
            # dispatches and hands it more work (~10 % of a small model's decode on a GPU).
            current = ahead
            ahead = loop.run_in_executor(self._worker, self._burst) if self.scheduler.has_work() else None
            await current
            self._drain()
            self._reap_orphans()
            self._maybe_log()

    def _burst(self) -> None:
        """Worker thread: a burst of steps, its outputs posted (`_post`). A step
        that raises fails what was in flight right here, before any queued burst
        can step the broken batch."""
        if self.out_of_step:
            return
        self._burst_started = time.monotonic()
        try:
            self._steps()
        except Exception as e:
            log.exception("engine %s step failed", self.name)
            self.failed_bursts += 1
            self.last_failure = f"{type(e).__name__}: {e}"
            if self.lockstep is None:
                self.scheduler.fail_running(f"generation failed: {e}")
            else:  # the ranks cannot be brought back in step: the engine stops
                self.out_of_step = self.lockstep.broken = f"the ranks running the model are out of step ({e})"
                log.error("engine %s: %s; it stops, every request in it ends with an error",
                          self.name, self.out_of_step)
                self.scheduler.fail_running(self.out_of_step)
                raise
        finally:
            self._burst_started = None
            self._post(wake=False)  # the loop routes them when the burst's future resolves

    def _steps(self) -> None:
        """Scheduler steps until the time budget is spent, or until something the
        client waits for happens (a first token, a finish). The tokens made so far
        go out every `stream_flush_ms` (per 4 running) without ending the burst."""
        scheduler = self.scheduler
        if not scheduler.has_work():  # a burst queued ahead, after the work ran out
            return
        steps_before = scheduler.counters.steps
        running = len(scheduler.running)
        budget_ms = self.burst_budget_ms(running)
        flush_s = self.flush_interval_ms(running) / 1000
        now = time.perf_counter()
        deadline, next_flush = now + budget_ms / 1000, now + flush_s
        while True:
            scheduler.step()
            now = time.perf_counter()
            if scheduler.urgent or budget_ms <= 0 or now >= deadline or not scheduler.has_work():
                # a hand-off that only stored the last step's blocks ran no model step
                if scheduler.counters.steps > steps_before:
                    self.bursts += 1
                    self.failed_bursts = 0  # a model step worked
                return
            if now >= next_flush:
                # The scheduler keeps one output per request between two posts: the
                # loop's work, and its turns at the GIL that the worker then waits
                # for, grow with the number of posts times the requests running.
                self._post(wake=True)
                next_flush = now + flush_s

    def _post(self, wake: bool) -> None:
        """Worker thread: the outputs made since the last post go to the loop's
        outbox; `wake`: the loop routes them now rather than at the burst's end."""
        outputs = self.scheduler.take_outputs()
        if not outputs:
            return
        self._posted.append(outputs)
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody reads them any more
                pass

    def _drain(self) -> None:
        """Event loop: route every posted output, oldest first."""
        while self._posted:
            self._dispatch(self._posted.popleft())

    def flush_interval_ms(self, running: int) -> float:
        """stream_flush_ms per 4 requests running: the loop's work per post grows
        with the batch, and serialized with the worker's steps by the GIL it slows
        them when they are CPU-bound (a small model on a GPU: the loop's ~150 µs a
        post at 32 running cost ~2 % of the H200 1B's decode when it posted every
        other step)."""
        return self.config.stream_flush_ms * max(1.0, running / 4)

    def burst_budget_ms(self, running: int) -> float:
        """With one request, decode_burst_ms. With several, decode_burst_ms_batched
        per 8 running, up to the larger of the two: the event loop wakes every reader
        once per burst; that work grows with the batch, and the GIL serializes it
        with the worker's steps, which it slows when they are CPU-bound (a small
        model on a GPU)."""
        c = self.config
        if running <= 1:
            return c.decode_burst_ms
        scaled = c.decode_burst_ms_batched * max(1.0, running / 8)
        return min(scaled, max(c.decode_burst_ms, c.decode_burst_ms_batched))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _reap_orphans(self) -> None:
        """Drop mailboxes nobody reads any more (a handler that vanished)."""
        now = time.monotonic()
        for request_id, c in list(self._collectors.items()):
            if not c.reading and now - c.last_read > self.ORPHAN_GRACE_S:
                log.info("reaping orphaned request %s", request_id)
                if not c.finished:
                    self.abort_request(request_id)
                del self._collectors[request_id]

    async def _watch(self) -> None:
        """The watchdog: while the worker is stuck in one step, every waiting reader
        gets an error (and the engine reports degraded); a request the scheduler
        lost ends with an error."""
        interval = min(1.0, self.config.stall_timeout_s / 4)
        search: asyncio.Future | None = None  # find_lost, queued on the worker between bursts
        while not self._closed:
            await asyncio.sleep(interval)
            if reason := self.stuck:
                self._fail_waiting_readers(reason)
                continue
            search = search or asyncio.ensure_future(self.on_worker(self.scheduler.find_lost))
            await asyncio.wait({search}, timeout=interval)
            if not search.done():
                continue  # behind a long step: looked at again next time
            lost, search = search.result(), None
            for request_id in lost:
                log.error("request %s was lost by the engine: ended with an error", request_id)
                self._put_error(request_id, "the engine lost this request")

    def _fail_waiting_readers(self, reason: str) -> None:
        for rid, collector in list(self._collectors.items()):
            if not collector.finished:
                log.error("request %s ended: %s", rid, reason)
                self.abort_request(rid)  # when the worker comes back, it stops generating
                self._put_error(rid, reason)

    def _put_error(self, request_id: str, message: str, error_type: str = "internal") -> None:
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.put(RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR,
                                        error=message, error_type=error_type))

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine %s loop died: %r", self.name, task.exception())
        dead = RequestOutput(
            request_id="", finished=True, finish_reason=FinishReason.ERROR,
            error=self.out_of_step or "engine stopped", error_type="internal",
        )
        for request_id, collector in self._collectors.items():
            collector.put(dataclasses.replace(dead, request_id=request_id))

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.config.log_interval_s:
            return
        generated = self.scheduler.counters.generated_tokens
        if generated != self._last_generated or self.scheduler.has_work():
            rate = (generated - self._last_generated) / (now - self._last_log)
            load = self.scheduler.load
            log.info(
                "%s: running %d (prefilling %d), waiting %d, %.1f tok/s",
                self.name, load["running"], load["prefilling"], load["waiting"], rate,
            )
        self._last_log, self._last_generated = now, generated

    def get_stats(self) -> dict:
        c = self.scheduler.counters
        return {
            "model": self.name,
            **self.scheduler.load,
            "prompt_tokens_total": c.prompt_tokens,
            "generated_tokens_total": c.generated_tokens,
            "finished_requests": c.finished_requests,
            "aborted_requests": c.aborted_requests,
            "failed_requests": c.failed_requests,
            "refused_requests": c.refused_requests,
            "steps": c.steps,
            # the worker's time in those steps (model step and its tokens): per step,
            # compare a served run with `bench engine` to see where serving costs
            "step_seconds_total": c.step_seconds,
            # speculative decoding: draft tokens verified, and kept
            "speculation": {"proposed_tokens": c.proposed_tokens, "accepted_tokens": c.accepted_tokens,
                            "steps": c.speculative_steps, "draft_model": self.config.draft_model,
                            "tok_s_by_batch_size": self.scheduler.speculation_rates()},
            "bursts": self.bursts,
            # where recent requests' time went from arrival to their first token (engine/stages.py)
            "request_stages": self.scheduler.stage_log.summary(),
            "warmup": {"shapes_left": len(self._warm_jobs), "seconds": round(self.warm_seconds, 3)},
            # what the running batch keeps attention KV at, and its bytes a token (batch_kv_bits)
            "kv": {"batch_bits": self.kv_bits, "batch_float16": self.kv_half,
                   "bytes_per_token": self.profile.kv_bytes_per_token,
                   "keys_scaled": self.key_scales is not None},
            # MLX's allocator counters (no array is touched): what the memory guard holds to its limit
            "memory_active_bytes": mx.get_active_memory(),
            "memory_peak_bytes": mx.get_peak_memory(),
            "memory_limit_bytes": self.scheduler.guard.limit,
            "alive": self.is_alive,
            "degraded": self.degraded,
            "backend": backends.describe(self.model).stats(),  # what the backend added, and what of it ran
        }
