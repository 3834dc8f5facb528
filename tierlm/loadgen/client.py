"""The load generator: streams a workload's requests to an OpenAI-compatible
server at a concurrency or a request rate and times every output chunk."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from tierlm.loadgen.metrics import RequestRecord
from tierlm.loadgen.workloads import BenchRequest, Workload


@dataclass
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None  # None: the first id the server lists
    concurrency: int | None = None  # sessions in flight at most; None: no limit
    request_rate: float = math.inf  # new sessions per second (Poisson); inf: all at once
    temperature: float = 0.0
    ignore_eos: bool = True  # send `ignore_eos` (vLLM / llama.cpp / tierlm extension)
    ban_token_ids: list[int] = field(default_factory=list)  # logit_bias -100 on these
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0

    @property
    def v1(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"


def request_body(req: BenchRequest, cfg: LoadConfig, model: str) -> tuple[str, dict]:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.ban_token_ids:
        body["logit_bias"] = {str(t): -100 for t in cfg.ban_token_ids}
    body.update(req.extra)
    if req.messages is not None:
        return "/chat/completions", {**body, "messages": req.messages}
    return "/completions", {**body, "prompt": req.prompt}


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        d = c["delta"] or {}
        calls = "".join((t.get("function") or {}).get("arguments") or "" for t in d.get("tool_calls") or [])
        return (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "") + calls
    return c.get("text") or ""


async def send(client: httpx.AsyncClient, cfg: LoadConfig, model: str, req: BenchRequest) -> RequestRecord:
    path, body = request_body(req, cfg, model)
    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", cfg.v1 + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {resp.status_code}: {text}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    break
                if piece := chunk_text(chunk):
                    record.chunk_times.append(time.perf_counter())
                    record.text += piece
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens")
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.end = time.perf_counter()
        if not record.chunk_times and record.error is None:
            record.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


async def served_model_id(client: httpx.AsyncClient, cfg: LoadConfig) -> str:
    if cfg.model:
        return cfg.model
    resp = await client.get(cfg.v1 + "/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def make_client(cfg: LoadConfig, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        headers=headers,
    )


async def run_load(
    workload: Workload, cfg: LoadConfig, warmup: list[BenchRequest] | None = None, on_done=None
) -> tuple[list[RequestRecord], float]:
    """Runs the workload; returns the records (in workload order) and the wall time
    from the first request sent to the last one done. `on_done(record)` is called
    after each request (the progress bar)."""
    n_sessions = len(workload.sessions)
    limit = cfg.concurrency or n_sessions
    async with make_client(cfg, max(limit, len(warmup or [])) + 4) as client:
        model = await served_model_id(client, cfg)
        if warmup:
            await asyncio.gather(*(send(client, cfg, model, r) for r in warmup))
        gate = asyncio.Semaphore(limit)
        rng = random.Random(cfg.seed)
        records: list[list[RequestRecord]] = [[] for _ in range(n_sessions)]

        async def session(i: int, delay: float) -> None:
            await asyncio.sleep(delay)
            async with gate:
                for req in workload.sessions[i]:
                    record = await send(client, cfg, model, req)
                    records[i].append(record)
                    if on_done:
                        on_done(record)

        delays, t = [], 0.0
        for _ in range(n_sessions):
            delays.append(t)
            if math.isfinite(cfg.request_rate):
                t += rng.expovariate(cfg.request_rate)
        t0 = time.perf_counter()
        await asyncio.gather(*(session(i, d) for i, d in enumerate(delays)))
        duration = time.perf_counter() - t0
    return [r for rs in records for r in rs], duration
