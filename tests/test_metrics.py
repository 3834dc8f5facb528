"""GET /metrics through a real server, read with prometheus_client's own parser:
its counters move as requests run and agree with /stats and /v1/cache/stats;
the latency histograms count each request; loads and unloads are counted per
model across them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from conftest import start_server, stop_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tierlm.admin.metrics import ServerMetrics
from tierlm.engine.scheduler import SchedulerCounters

pytestmark = pytest.mark.slow  # a server of its own

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Repeat after me, word for word: " + "the quick brown fox jumps over the lazy dog " * 12


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    """Small cache blocks written through to SSD (so a short prompt fills a few of
    each tier), and a second model: the default one's folder again, by a symlink,
    its running batch's KV at 8 bits (its settings-file section)."""
    root = tmp_path_factory.mktemp("metrics")
    (root / "models").mkdir()
    (root / "models" / "second").symlink_to(model_path)
    (root / "settings.toml").write_text('[models."second"]\nbatch_kv_bits = 8\n')
    server = start_server(model_path, root / "server.log", "--cache-block-size", "32", "--ssd-write-through",
                          "--no-hf-cache", "--config", str(root / "settings.toml"))
    yield server
    stop_server(server)


def scrape(srv) -> dict:
    """{(name, sorted labels): value} of every sample."""
    r = httpx.get(srv.base_url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"model": MODEL, **labels}.items())))]


def chat(srv, max_tokens: int = 5) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_names_and_types(srv):
    r = httpx.get(srv.base_url + "/metrics", timeout=30)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    ours = {n for n in families if n.startswith("tierlm:")}
    assert not {n for n in families if n not in ours and not n.startswith("process_")}
    for name, kind in [("tierlm:prompt_tokens", "counter"), ("tierlm:generation_tokens", "counter"),
                       ("tierlm:num_requests_running", "gauge"), ("tierlm:num_requests_waiting", "gauge"),
                       ("tierlm:time_to_first_token_seconds", "histogram"),
                       ("tierlm:inter_token_latency_seconds", "histogram"),
                       ("tierlm:e2e_request_latency_seconds", "histogram"),
                       ("tierlm:prefix_cache_queries", "counter"), ("tierlm:prefix_cache_hits", "counter"),
                       ("tierlm:prefix_cache_bytes", "gauge"), ("tierlm:prefix_cache_blocks", "gauge"),
                       ("tierlm:prefix_cache_preloaded_blocks", "counter"),
                       ("tierlm:ssd_writes", "counter"), ("tierlm:ssd_write_drops", "counter"),
                       ("tierlm:ssd_errors", "counter"), ("tierlm:ssd_read_seconds", "counter"),
                       ("tierlm:ssd_write_seconds", "counter"), ("tierlm:model_loads", "counter"),
                       ("tierlm:model_unloads", "counter"), ("tierlm:model_evictions", "counter"),
                       ("tierlm:model_load_seconds", "histogram"), ("tierlm:process_memory_bytes", "gauge"),
                       ("tierlm:model_memory_budget_bytes", "gauge")]:
        assert families[name].type == kind, name
    whole_process = ("tierlm:model_memory_budget_bytes", "tierlm:model_memory_used_bytes",
                     "tierlm:memory_soft_mark_bytes", "tierlm:memory_hard_mark_bytes",
                     "tierlm:process_memory_bytes", "tierlm:requests_paused",
                     "tierlm:requests_waiting_for_memory")
    for name in ours - set(whole_process):  # a model label on each sample of the others
        assert all("model" in s.labels for s in families[name].samples), name


def test_counters_move_with_requests_and_match_stats(srv):
    before = scrape(srv)
    first, second = chat(srv), chat(srv)
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    stats = srv.stats()
    cache = httpx.get(srv.v1 + "/cache/stats", timeout=30).json()["prefix_cache"]
    wait_until(lambda: value(scrape(srv), "tierlm:ssd_writes_total") > 0)
    after = scrape(srv)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("tierlm:generation_tokens_total") == 10
    assert moved("tierlm:prompt_tokens_total") == first["prompt_tokens"] + second["prompt_tokens"]
    assert moved("tierlm:requests_total", outcome="finished") == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"tierlm:{name}_count") == 2
        assert moved(f"tierlm:{name}_sum") > 0
    assert moved("tierlm:inter_token_latency_seconds_count") == 8  # 4 gaps in each 5-token answer
    assert moved("tierlm:prefix_cache_hits_total", tier="hot") == second["prompt_tokens_details"]["cached_tokens"]

    # the same numbers as /stats and /v1/cache/stats
    assert value(after, "tierlm:prompt_tokens_total") == stats["prompt_tokens_total"]
    assert value(after, "tierlm:generation_tokens_total") == stats["generated_tokens_total"]
    for outcome in ("finished", "aborted", "failed", "refused"):
        assert value(after, "tierlm:requests_total", outcome=outcome) == stats[f"{outcome}_requests"]
    assert value(after, "tierlm:num_requests_running") == stats["running"] == 0
    assert value(after, "tierlm:num_requests_waiting") == stats["waiting"] == 0
    assert value(after, "tierlm:prefix_cache_lookups_total") == cache["lookups"]
    assert value(after, "tierlm:prefix_cache_hits_total", tier="hot") == cache["hot_hit_tokens"]
    assert value(after, "tierlm:prefix_cache_hits_total", tier="ssd") == cache["ssd_hit_tokens"]
    assert value(after, "tierlm:prefix_cache_blocks", tier="hot") == cache["blocks"]
    assert value(after, "tierlm:prefix_cache_bytes", tier="hot") == cache["bytes"] > 0
    assert value(after, "tierlm:ssd_writes_total") >= 1
    assert value(after, "tierlm:ssd_write_seconds_total") > 0  # the writer's rate: bytes over these
    assert value(after, "tierlm:prefix_cache_blocks", tier="ssd") >= 1
    whole = httpx.get(srv.base_url + "/stats", timeout=30).json()
    assert after[("tierlm:model_memory_budget_bytes", ())] == whole["budget_bytes"]
    assert after[("tierlm:model_memory_used_bytes", ())] == whole["used_bytes"]
    assert after[("tierlm:process_memory_bytes", ())] > 0


def test_loads_and_unloads_are_counted_per_model(srv):
    samples = scrape(srv)
    assert value(samples, "tierlm:model_loads_total") == 1  # the default model, at start
    assert value(samples, "tierlm:model_load_seconds_count") == 1
    assert value(samples, "tierlm:model_loaded") == 1
    assert httpx.post(srv.v1 + "/models/second/load", timeout=120).json()["state"] == "loaded"
    samples = scrape(srv)
    assert value(samples, "tierlm:model_loads_total", model="second") == 1
    assert value(samples, "tierlm:model_loaded", model="second") == 1
    assert value(samples, "tierlm:generation_tokens_total", model="second") == 0
    # /stats: the second model's batch keeps 8-bit KV (3.5x fewer bytes a token than
    # the CPU's float32), its keys scaled per channel, and it answers with it
    kv = {e["model"]: e["kv"] for e in httpx.get(srv.base_url + "/stats", timeout=30).json()["engines"]}
    second = kv.pop("second")
    (default,) = kv.values()
    assert (second["batch_bits"], default["batch_bits"]) == (8, 16)
    assert (second["keys_scaled"], default["keys_scaled"]) == (True, False)
    assert default["bytes_per_token"] / second["bytes_per_token"] >= 3.5
    answer = srv.client().chat.completions.create(model="second", max_tokens=8, temperature=0,
                                                  messages=[{"role": "user", "content": "Say hello."}])
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    assert httpx.post(srv.v1 + "/models/second/unload", timeout=120).json()["state"] == "available"
    samples = scrape(srv)
    assert value(samples, "tierlm:model_unloads_total", model="second") == 1
    assert value(samples, "tierlm:model_loaded", model="second") == 0
    assert value(samples, "tierlm:model_evictions_total", model="second") == 0
    assert value(samples, "tierlm:model_unloads_total") == 0


def test_evictions_and_counts_outlive_an_unload():
    """Without a server: the pool's evictions are told from its other unloads,
    and what an unloaded engine counted stays in its model's totals."""
    class Engine:  # what /metrics reads of one
        def __init__(self):
            counters = SchedulerCounters(prompt_tokens=7, generated_tokens=3, finished_requests=1)
            self.scheduler = SimpleNamespace(counters=counters, cache=None)

    class Pool:
        def __init__(self):
            self.slots = {"a": SimpleNamespace(served=None), "b": SimpleNamespace(served=None)}

        async def factory(self, entry):
            return SimpleNamespace(engine=Engine())

        async def evict_idle(self, needed, why, spare=None):
            self.slots["a"].served = None
            return 1

    pool = Pool()
    metrics = ServerMetrics(pool)
    metrics.watch()

    async def run():
        for name in ("a", "b"):
            pool.slots[name].served = await pool.factory(SimpleNamespace(name=name))
        assert metrics.counters()["a"]["generation_tokens"] == 3
        assert await pool.evict_idle(1, "room") == 1

    asyncio.run(run())
    totals = metrics.counters()
    assert totals["a"]["generation_tokens"] == 3 and totals["a"]["prompt_tokens"] == 7  # kept after it went
    assert (metrics.models["a"].evictions, metrics.models["a"].unloads) == (1, 1)
    assert (metrics.models["b"].evictions, metrics.models["b"].unloads) == (0, 0)
    assert metrics.models["a"].load_seconds.count == 1
