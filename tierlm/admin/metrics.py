"""GET /metrics: Prometheus text, names under `tierlm:` in vLLM's style, each
with a `model` label.

Nothing is counted on the hot path for it: a scrape reads what the engines, their
prefix caches and the pool already count (`TierlmCollector`). Three things are
recorded here because nothing else keeps them:
- the latency histograms, once per request as it leaves the batch (the
  scheduler's `on_request_end`, on the engine's worker thread);
- model loads and their time, through the pool's factory;
- evictions, through the pool's `evict_idle`.
Counters of a model survive its unloads: an engine's counter objects (plain
numbers, no MLX array) are kept from its load and folded into the model's
totals once it is gone.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "tierlm:"
# vLLM's buckets for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    """Cumulative buckets, written from a worker thread, read by a scrape; `weight`
    counts one value several times in O(1) (a request's mean gap between tokens,
    once per gap)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, weight: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += weight
            self.total += value * weight

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> tuple[list[tuple[str, int]], float]:
        with self._lock:
            counts, total = list(self.counts), self.total
        running, out = 0, []
        for bound, n in zip((*map(str, self.bounds), "+Inf"), counts):
            running += n
            out.append((bound, running))
        return out, total


@dataclass
class ModelRecord:
    """What /metrics keeps of one model across its loads."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    load_seconds: Histogram = field(default_factory=lambda: Histogram(LOAD_BUCKETS))
    load_failures: int = 0
    unloads: int = 0
    evictions: int = 0
    retired: dict = field(default_factory=lambda: defaultdict(float))  # counters of engines gone
    high: dict = field(default_factory=dict)  # counters' highest values shown (never shown going down)


@dataclass
class EngineRecord:
    """One loaded engine's counter objects, taken at its load."""

    model: str
    engine: weakref.ref
    counters: object  # the scheduler's SchedulerCounters
    cache_stats: object | None  # PrefixCacheStats
    hot_stats: object | None  # HotTierStats
    ssd_stats: object | None  # SSDStats


def _engine_counters(rec: EngineRecord) -> dict[str, float]:
    """The monotonic counters of one engine, by metric key."""
    c = rec.counters
    out = {
        "prompt_tokens": c.prompt_tokens, "generation_tokens": c.generated_tokens,
        "requests|finished": c.finished_requests, "requests|aborted": c.aborted_requests,
        "requests|failed": c.failed_requests, "requests|refused": c.refused_requests,
        "draft_tokens": c.proposed_tokens, "accepted_draft_tokens": c.accepted_tokens,
    }
    if rec.cache_stats is not None:
        s = rec.cache_stats
        out.update({"cache_queries": s.lookup_tokens, "cache_hits|hot": max(0, s.hit_tokens - s.ssd_hit_tokens),
                    "cache_hits|ssd": s.ssd_hit_tokens, "cache_requests": s.lookups, "cache_stored": s.stored_blocks,
                    "cache_evictions|hot": rec.hot_stats.evictions, "cache_preloaded": s.preloaded_blocks})
    if rec.ssd_stats is not None:
        s = rec.ssd_stats
        out.update({"ssd_writes": s.writes, "ssd_write_bytes": s.write_bytes, "ssd_write_drops": s.write_drops,
                    "ssd_errors": s.errors, "ssd_reads": s.reads, "ssd_read_bytes": s.read_bytes,
                    "ssd_read_seconds": s.read_seconds, "ssd_write_seconds": s.write_seconds,
                    "cache_evictions|ssd": s.evictions})
    return out


# metric key -> (name, help, extra label or None)
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "prompt tokens admitted (cached ones included)", None),
    "generation_tokens": ("generation_tokens", "tokens generated", None),
    "requests": ("requests", "requests that left the engine, by outcome (finished, aborted, failed, refused)",
                 "outcome"),
    "draft_tokens": ("spec_decode_draft_tokens", "draft tokens verified (speculative decoding)", None),
    "accepted_draft_tokens": ("spec_decode_accepted_tokens", "draft tokens accepted (speculative decoding)",
                              None),
    "cache_queries": ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", None),
    "cache_hits": ("prefix_cache_hits", "prompt tokens found in the prefix cache, by the tier they came from",
                   "tier"),
    "cache_requests": ("prefix_cache_lookups", "requests that looked up the prefix cache", None),
    "cache_stored": ("prefix_cache_stored_blocks", "blocks stored in the hot tier", None),
    "cache_evictions": ("prefix_cache_evictions", "blocks evicted, by tier (hot: to the SSD tier or dropped)",
                        "tier"),
    "cache_preloaded": ("prefix_cache_preloaded_blocks", "blocks read back from the SSD tier into memory after a "
                        "start, before a prompt asked (ssd_preload)", None),
    "ssd_writes": ("ssd_writes", "blocks written to the SSD tier", None),
    "ssd_write_bytes": ("ssd_write_bytes", "bytes written to the SSD tier", None),
    "ssd_write_drops": ("ssd_write_drops", "blocks not written to the SSD tier (queue full, disk nearly full)",
                        None),
    "ssd_errors": ("ssd_errors", "SSD tier files that failed to write or to load", None),
    "ssd_reads": ("ssd_reads", "blocks read from the SSD tier", None),
    "ssd_read_bytes": ("ssd_read_bytes", "bytes read from the SSD tier", None),
    # bytes over seconds: the tiers' rates (a restore, read-ahead waits included; the writer's own time)
    "ssd_read_seconds": ("ssd_read_seconds", "engine time spent restoring blocks from the SSD tier", None),
    "ssd_write_seconds": ("ssd_write_seconds", "the SSD writer's time writing blocks (fsync included)", None),
}


class ServerMetrics:
    """What /metrics records beside the engines' own counters, and the collector
    that reads them all at a scrape."""

    def __init__(self, pool, enforcer=None):
        self.pool, self.enforcer = pool, enforcer
        self.models: dict[str, ModelRecord] = defaultdict(ModelRecord)
        self.engines: list[EngineRecord] = []
        self._failed_hook = False

    # ---- wiring ---------------------------------------------------------------

    def watch(self) -> None:
        """Counts the pool's loads (through its factory) and evictions (through
        `evict_idle`); hooks each new engine's request ends."""
        pool, factory, evict_idle = self.pool, self.pool.factory, self.pool.evict_idle

        async def loading(entry):
            tic = time.monotonic()
            try:
                served = await factory(entry)
            except BaseException:
                self.models[entry.name].load_failures += 1
                raise
            self.models[entry.name].load_seconds.observe(time.monotonic() - tic)
            self.engine_loaded(entry.name, served.engine)
            return served

        async def evicting(needed: int, why: str, spare=None) -> int:
            before = {n for n, s in pool.slots.items() if s.served is not None}
            unloaded = await evict_idle(needed, why, spare)
            for name in before - {n for n, s in pool.slots.items() if s.served is not None}:
                self.models[name].evictions += 1
            return unloaded

        pool.factory, pool.evict_idle = loading, evicting

    def engine_loaded(self, model: str, engine) -> None:
        scheduler = engine.scheduler
        if scheduler is None:  # an encoder: no generation to count
            return
        cache = scheduler.cache
        self.engines.append(EngineRecord(
            model, weakref.ref(engine), scheduler.counters,
            None if cache is None else cache.stats, None if cache is None else cache.hot.stats,
            None if cache is None or cache.ssd is None else cache.ssd.stats))
        scheduler.on_request_end = self._request_end_hook(self.models[model])

    def _request_end_hook(self, record: ModelRecord):
        def ended(request, first_token_time: float | None, tokens: int, completed: bool) -> None:
            try:
                now = time.monotonic()
                record.e2e.observe(now - request.arrival_time)
                if first_token_time is not None:
                    record.ttft.observe(first_token_time - request.arrival_time)
                    if completed and tokens > 1:  # each gap between its tokens, at the request's mean gap
                        record.itl.observe((now - first_token_time) / (tokens - 1), tokens - 1)
            except Exception:  # never fail a request for its metrics
                if not self._failed_hook:
                    self._failed_hook = True
                    log.exception("recording a request's latencies failed")

        return ended

    # ---- reading ----------------------------------------------------------------

    def _live(self, rec: EngineRecord):
        """The engine if it is still the one its model serves, else None."""
        engine = rec.engine()
        slot = self.pool.slots.get(rec.model)
        served = None if slot is None else slot.served
        return engine if engine is not None and served is not None and served.engine is engine else None

    def counters(self) -> dict[str, dict[str, float]]:
        """Every model's counters, engines gone folded in; none ever shown lower
        than before."""
        totals: dict[str, dict[str, float]] = {}
        kept = []
        for rec in self.engines:
            values = _engine_counters(rec)
            model = self.models[rec.model]
            if self._live(rec) is None:  # unloaded: its last counts join the model's
                model.unloads += 1
                for k, v in values.items():
                    model.retired[k] += v
                continue
            kept.append(rec)
            mine = totals.setdefault(rec.model, {})
            for k, v in values.items():
                mine[k] = mine.get(k, 0) + v
        self.engines = kept
        for name, model in self.models.items():
            mine = totals.setdefault(name, {})
            for k, v in model.retired.items():
                mine[k] = mine.get(k, 0) + v
            for k, v in mine.items():
                mine[k] = model.high[k] = max(v, model.high.get(k, 0))
        return totals

    def collector(self) -> Collector:
        return TierlmCollector(self)


class TierlmCollector(Collector):
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        m, pool = self.m, self.m.pool
        totals = m.counters()
        families = {}
        for key, (name, help_text, extra) in COUNTERS.items():
            families[key] = CounterMetricFamily(PREFIX + name, help_text,
                                                labels=["model"] + ([extra] if extra else []))
        for model, values in sorted(totals.items()):
            for k, v in values.items():
                key, _, label = k.partition("|")
                families[key].add_metric([model, label] if label else [model], v)
        yield from families.values()
        yield from self._engines(pool)
        yield from self._pool(pool)
        yield from self._histograms()

    def _engines(self, pool):
        running = GaugeMetricFamily(PREFIX + "num_requests_running", "requests in the batch (prefilling or "
                                    "decoding)", labels=["model"])
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "requests queued for the batch",
                                    labels=["model"])
        blocks = GaugeMetricFamily(PREFIX + "prefix_cache_blocks", "blocks in the prefix cache, by tier",
                                   labels=["model", "tier"])
        size = GaugeMetricFamily(PREFIX + "prefix_cache_bytes", "bytes of the prefix cache, by tier",
                                 labels=["model", "tier"])
        capacity = GaugeMetricFamily(PREFIX + "prefix_cache_capacity_bytes", "the prefix cache's size "
                                     "limit, by tier", labels=["model", "tier"])
        for name, slot in sorted(pool.slots.items()):
            served = slot.served
            scheduler = None if served is None else served.engine.scheduler
            if scheduler is None:
                continue
            load = scheduler.load
            running.add_metric([name], load.get("running", 0))
            waiting.add_metric([name], load.get("waiting", 0))
            cache = scheduler.cache
            if cache is None:
                continue
            blocks.add_metric([name, "hot"], len(cache.hot))
            size.add_metric([name, "hot"], cache.hot.nbytes)
            capacity.add_metric([name, "hot"], cache.hot.capacity)
            if cache.ssd is not None:
                ssd = cache.ssd.snapshot_stats()
                blocks.add_metric([name, "ssd"], ssd["files"])
                size.add_metric([name, "ssd"], ssd["bytes"])
                capacity.add_metric([name, "ssd"], ssd["capacity_bytes"])
        yield from (running, waiting, blocks, size, capacity)

    def _pool(self, pool):
        labels = ["model"]
        loaded = GaugeMetricFamily(PREFIX + "model_loaded", "1 while the model is loaded", labels=labels)
        memory = GaugeMetricFamily(PREFIX + "model_memory_bytes", "memory a loaded model took to load "
                                   "(weights and what loading allocated)", labels=labels)
        loads = CounterMetricFamily(PREFIX + "model_loads", "model loads", labels=labels)
        failures = CounterMetricFamily(PREFIX + "model_load_failures", "model loads that failed", labels=labels)
        unloads = CounterMetricFamily(PREFIX + "model_unloads", "model unloads, for any reason", labels=labels)
        evictions = CounterMetricFamily(PREFIX + "model_evictions", "unloads of idle models to make room for "
                                        "another or under memory pressure", labels=labels)
        for name, slot in sorted(pool.slots.items()):
            loaded.add_metric([name], 1 if slot.served is not None else 0)
            if slot.served is not None:
                memory.add_metric([name], slot.memory_bytes)
        for name, rec in sorted(self.m.models.items()):
            loads.add_metric([name], rec.load_seconds.count)
            failures.add_metric([name], rec.load_failures)
            unloads.add_metric([name], rec.unloads)
            evictions.add_metric([name], rec.evictions)
        yield from (loaded, memory, loads, failures, unloads, evictions)
        yield GaugeMetricFamily(PREFIX + "model_memory_budget_bytes", "memory all loaded models may take "
                                "(max_model_memory)", value=pool.budget_bytes)
        yield GaugeMetricFamily(PREFIX + "model_memory_used_bytes", "memory the loaded models took",
                                value=pool.used_bytes())
        yield GaugeMetricFamily(PREFIX + "requests_paused", "1 while new requests wait for memory "
                                "(above the soft mark)", value=1 if pool.paused else 0)
        yield GaugeMetricFamily(PREFIX + "requests_waiting_for_memory", "new requests waiting now for "
                                "memory to drop under the soft mark", value=pool.waiting_for_memory)
        enforcer = self.m.enforcer
        if enforcer is not None:
            soft, hard = pool.current.settings.memory_marks_bytes()
            yield GaugeMetricFamily(PREFIX + "process_memory_bytes", "the process's resident memory, as the "
                                    "memory enforcer reads it", value=enforcer.read_memory())
            yield GaugeMetricFamily(PREFIX + "memory_soft_mark_bytes", "process memory above which new "
                                    "requests wait and idle models unload", value=soft)
            yield GaugeMetricFamily(PREFIX + "memory_hard_mark_bytes", "process memory above which the "
                                    "largest model's requests are aborted", value=hard)

    def _histograms(self):
        specs = [("ttft", "time_to_first_token_seconds",
                  "from a request's arrival at the engine to its first token"),
                 ("itl", "inter_token_latency_seconds",
                  "time between a request's tokens (each request's mean gap, counted once per gap)"),
                 ("e2e", "e2e_request_latency_seconds", "from a request's arrival at the engine to its end"),
                 ("load_seconds", "model_load_seconds", "time to load a model (weights, engine start)")]
        for attr, name, help_text in specs:
            family = HistogramMetricFamily(PREFIX + name, help_text, labels=["model"])
            for model, rec in sorted(self.m.models.items()):
                buckets, total = getattr(rec, attr).buckets()
                family.add_metric([model], buckets, total)
            yield family


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(http: HTTPRequest) -> Response:
    registry: CollectorRegistry = http.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def make_registry(metrics: ServerMetrics) -> CollectorRegistry:
    """tierlm's metrics and the process's (CPU time, resident memory, open files)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.collector())
    ProcessCollector(registry=registry)
    return registry
