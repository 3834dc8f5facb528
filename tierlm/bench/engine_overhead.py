"""In-process engine overhead: tierlm's EngineCore against a bare mlx-lm
BatchGenerator loop, on the same loaded model and the same prompts.

Both decode greedily with no stop tokens, so both do exactly the same model work;
what differs is everything tierlm adds around it (the asyncio loop, the worker
thread hand-offs, per-request samplers, detokenizing, collectors). Runs
alternate (bare, engine, engine, bare, ...) and the medians are compared.

MLX, mlx-lm and the engine are imported inside the functions that run models:
bench_lab.docs imports this module for pair_ratios and step_ratios only,
and renders the docs without loading any of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierlm.bench.step_timing import full_decode_steps, step_accounted_ratio, time_next
from tierlm.loadgen.metrics import geometric_mean_se, median, steady_decode_rate


@dataclass
class OverheadResult:
    batch: int
    runner: str  # "bare" | "engine"
    decode_tok_s: float  # full-batch window, see metrics.steady_decode_rate
    total_tok_s: float  # all output tokens / (submit -> last token)
    mean_ttft_s: float
    wall_s: float
    # µs per full-batch decode step (step_timing.full_decode_steps); the engine's
    # also has main_cpu, its event loop thread's CPU per scheduler step
    steps: dict = field(default_factory=dict)


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


def _result(batch: int, runner: str, start: float, times: list[list[float]]) -> OverheadResult:
    end = max(t[-1] for t in times)
    n = sum(len(t) for t in times)
    return OverheadResult(
        batch,
        runner,
        steady_decode_rate(times),
        n / (end - start),
        sum(t[0] - start for t in times) / len(times),
        end - start,
    )


def run_bare(
    model, prompts: list[list[int]], max_tokens: int, prefill_step_size: int, stream, batch: int = 0
) -> OverheadResult:
    """All prompts inserted at once; at most `batch` (default: all) decode together,
    BatchGenerator admitting the next as one finishes."""
    from mlx_lm.generate import BatchGenerator

    batch = batch or len(prompts)
    gen = BatchGenerator(
        model,
        completion_batch_size=batch,
        prefill_batch_size=min(8, batch),
        prefill_step_size=prefill_step_size,
        stream=stream,
    )
    records: list[tuple] = []
    time_next(gen, records)
    try:
        start = time.perf_counter()
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        index = {uid: i for i, uid in enumerate(uids)}
        times: list[list[float]] = [[] for _ in prompts]
        pending = set(uids)
        while pending:
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                times[index[r.uid]].append(now)
                if r.finish_reason is not None:
                    pending.discard(r.uid)
    finally:
        gen.close()
    result = _result(batch, "bare" if batch >= len(prompts) else "bare-queue", start, times)
    result.steps = full_decode_steps(records, batch)
    return result


def server_event_loop() -> asyncio.AbstractEventLoop:
    """The kind of loop `tierlm serve` runs its engines on: uvicorn's default picks
    uvloop where it is installed. Its hand-offs cost the event loop thread about
    half of asyncio's, and that thread shares the GIL with the engine's worker."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EngineRunner:
    """One long-lived EngineCore, as a server keeps, driven from synchronous code,
    on the server's kind of event loop.

    A fresh engine per run would be unfair to it: on MLX's CUDA backend each new
    stream starts with empty caches of captured graphs, and the bare loop keeps its
    stream for the whole benchmark. The prefix cache is cleared before each run, so
    the rounds repeat the same work (the engine still stores every block)."""

    def __init__(self, model, tokenizer, batch: int, prefill_step_size: int, **config):
        """`config`: more settings (diagnostics: prefix_cache=False)."""
        from tierlm.config import Settings
        from tierlm.engine.core import EngineCore

        self.batch, self.runs = batch, 0
        self.generated: list[int] = []  # tokens each request of the last run generated
        self.loop = server_event_loop()
        config = Settings(max_concurrent_requests=batch, prefill_step_size=prefill_step_size, ssd_cache=False,
                          **config)
        self.engine = EngineCore("bench", lambda: (model, tokenizer), config)
        self.loop.run_until_complete(self.engine.start())
        self.records: list[tuple] = []  # the engine's next() calls in the current run

    def run(self, prompts: list[list[int]], max_tokens: int) -> OverheadResult:
        scheduler = self.engine.scheduler
        time_next(scheduler._gen, self.records)  # the scheduler's own generator, timed in place
        self.records.clear()
        steps, cpu = scheduler.counters.steps, time.thread_time()
        result = self.loop.run_until_complete(self._run(prompts, max_tokens))
        steps, cpu = scheduler.counters.steps - steps, time.thread_time() - cpu
        result.steps = full_decode_steps(self.records, self.batch)
        if result.steps and steps:
            result.steps["main_cpu"] = cpu / steps * 1e6
        return result

    async def _run(self, prompts, max_tokens) -> OverheadResult:
        from tierlm.engine.request import Request

        await self.engine.clear_cache()
        self.runs += 1
        times: list[list[float]] = [[] for _ in prompts]
        errors: list[str] = []

        async def consume(i: int, request: Request) -> None:
            async for out in self.engine.stream_outputs(request):
                if out is not None and out.token_ids:
                    times[i].extend([time.perf_counter()] * len(out.token_ids))
                if out is not None and out.error:
                    errors.append(f"request {i}: {out.error}")

        requests = [Request(f"bench-{self.runs}-{i}", p, self.params(i, max_tokens)) for i, p in enumerate(prompts)]
        start = time.perf_counter()  # what params() builds (a grammar) is made before the timed part
        await asyncio.gather(*(consume(i, r) for i, r in enumerate(requests)))
        if errors:  # a failed request has no token times: say why, not what the rates make of it
            raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed; {errors[0]}")
        self.generated = [len(t) for t in times]
        return _result(self.batch, "engine" if self.batch >= len(prompts) else "engine-queue", start, times)

    def params(self, i: int, max_tokens: int):
        """Request i's sampling: greedy, to max_tokens whatever it says."""
        from tierlm.engine.request import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def run_overhead(
    model_path: str,
    batches: list[int],
    prompt_len: int,
    max_tokens: int,
    rounds: int,
    prefill_step_size: int = 2048,
    seed: int = 0,
    on_progress=None,
    queue_factor: int = 0,
    bare_in_thread: bool = False,
    save=None,
    cpus: list[int] | None = None,
) -> dict:
    """Per batch B: `rounds` alternating bare/engine runs of B requests (decode
    overhead); with `queue_factor` K, one more of each with K*B requests, B at a
    time (the served benchmark's workload, in process). `bare_in_thread` runs the
    bare loop on a worker thread of its own, as the engine runs its steps: it tells
    a cost of running MLX off the main thread from a cost of the engine. `save`
    gets the result so far after each batch size, so a run cut short (a time
    limit on a lent machine) still leaves the batch sizes it finished. `cpus`: the
    CPUs the process was pinned to (`pin_to_cpus`), recorded with the result."""
    import mlx.core as mx

    from tierlm.models.loader import load_model, usable_vocab_size

    model, tokenizer = load_model(model_path)
    vocab = usable_vocab_size(tokenizer, model)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bare") if bare_in_thread else None

    def on_bare_thread(fn, *args):
        return worker.submit(fn, *args).result() if worker else fn(*args)

    stream = on_bare_thread(mx.new_stream, mx.default_device())
    warm = random_prompts(vocab, 2, min(prompt_len, 32), seed + 999)
    on_bare_thread(run_bare, model, warm, 4, prefill_step_size, stream)
    runs: list[OverheadResult] = []
    event_loop = "asyncio"

    def result(complete: bool) -> dict:
        return {
            "model": str(model_path),
            "batches": batches,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "queue_factor": queue_factor,
            "bare_in_thread": bare_in_thread,
            "event_loop": event_loop,
            "cpus": cpus,
            "engine_per_batch": True,  # one EngineRunner per batch size (older files: one engine per run)
            "device": str(mx.default_device()),
            "runs": [r.__dict__ for r in runs],
            "summary": summarize_overhead(runs),
            "complete": complete,  # False: saved after a batch size, more were to come
        }

    def record(run: OverheadResult) -> None:
        runs.append(run)
        if on_progress:
            on_progress(run)

    for batch in batches:
        prompts = random_prompts(vocab, batch, prompt_len, seed + batch)
        engine = EngineRunner(model, tokenizer, batch, prefill_step_size)
        event_loop = type(engine.loop).__module__.split(".")[0]  # "uvloop" or "asyncio"
        engine.run(warm, 4)
        for rnd in range(rounds):
            order = ("bare", "engine") if rnd % 2 == 0 else ("engine", "bare")
            for runner in order:
                if runner == "bare":
                    record(on_bare_thread(run_bare, model, prompts, max_tokens, prefill_step_size, stream))
                else:
                    record(engine.run(prompts, max_tokens))
        if queue_factor > 1:
            queued = random_prompts(vocab, queue_factor * batch, prompt_len, seed + 7 * batch)
            record(on_bare_thread(run_bare, model, queued, max_tokens, prefill_step_size, stream, batch))
            record(engine.run(queued, max_tokens))
        engine.close()
        if save:
            save(result(complete=False))
    if worker:
        worker.shutdown()
    return result(complete=True)


def parse_cpu_list(spec: str) -> list[int]:
    """CPU numbers from a list as taskset takes it: "2-5", "0,2,4", "0-1,8"."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"not a CPU list: {spec!r} (like 2-5 or 0,2,4)")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def pin_to_cpus(cpus: list[int]) -> list[int]:
    """Pins this process, and every thread it starts after (MLX's, the engine's),
    to these CPUs; returns them. On the H200's host the scheduler moving threads
    between CPUs made a run's speed vary twice as much from one run to the next
    (docs/streaming.md): pinned, fewer pairs reach the same standard error."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpus needs Linux (sched_setaffinity)")
    os.sched_setaffinity(0, cpus)
    return cpus


def merge_results(docs: list[dict]) -> dict:
    """Results of several `bench engine` calls of the same model, prompts and
    machine as one (a lent machine's call limit fits one batch size, or fewer
    rounds than the standard error needs): runs in the order of `docs`, each file's
    rounds kept whole, the summary computed again over all of them."""
    same = ("model", "prompt_len", "max_tokens", "device", "event_loop", "engine_per_batch", "bare_in_thread",
            "cpus")
    first = docs[0]
    for doc in docs[1:]:
        differs = [k for k in same if doc.get(k) != first.get(k)]
        differs += [f"machine {k}" for k in ("cpu", "gpu") if doc["machine"].get(k) != first["machine"].get(k)]
        if differs:
            raise ValueError(f"results differ in {', '.join(differs)}: not one benchmark")
    runs = [run for doc in docs for run in doc["runs"]]
    batches = sorted({b for doc in docs for b in doc["batches"]})
    fields = {f.name for f in dataclasses.fields(OverheadResult)}
    results = [OverheadResult(**{k: v for k, v in run.items() if k in fields}) for run in runs]
    rounds = {b: len(round_pairs(runs, b)) for b in batches}
    merged = {k: v for k, v in first.items() if k not in ("kind", "command")}  # its machine stays
    merged.update(
        date=max(d.get("date", "") for d in docs),
        batches=batches,
        rounds=min(rounds.values()),
        rounds_per_batch=rounds,
        runs=runs,
        summary=summarize_overhead(results),
        complete=all(d.get("complete", True) for d in docs),
        merged_from=[{k: d.get(k) for k in ("date", "command", "machine")} for d in docs],
    )
    return merged


def round_pairs(runs: list[dict], batch: int) -> list[tuple[dict, dict]]:
    """(bare, engine) of each round of a result's `runs`: the two runs of a round
    are made back to back."""
    mine = [r for r in runs if r["batch"] == batch]
    bare = [r for r in mine if r["runner"] == "bare"]
    engine = [r for r in mine if r["runner"] == "engine"]
    return list(zip(bare, engine))


def pair_ratios(runs: list[dict], batch: int) -> list[float]:
    """Engine ÷ bare decode tok/s of each round."""
    rates = [(b["decode_tok_s"], e["decode_tok_s"]) for b, e in round_pairs(runs, batch)]
    return [e / b for b, e in rates if b > 0 and not math.isnan(b) and not math.isnan(e)]


def step_ratios(runs: list[dict], batch: int) -> list[float]:
    """Each round's step-accounted engine ÷ bare ratio (step_timing), for results
    that have step timings."""
    steps = [(b.get("steps"), e.get("steps")) for b, e in round_pairs(runs, batch)]
    return [step_accounted_ratio(b, e) for b, e in steps if b and e and "main_cpu" in e]


def summarize_overhead(runs: list[OverheadResult]) -> list[dict]:
    out = []
    for batch in sorted({r.batch for r in runs}):
        row: dict = {"batch": batch}
        for runner in ("bare", "engine"):
            mine = [r for r in runs if r.batch == batch and r.runner == runner]
            row[runner] = {
                k: median([getattr(r, k) for r in mine])
                for k in ("decode_tok_s", "total_tok_s", "mean_ttft_s")
            }
        row["decode_ratio"] = row["engine"]["decode_tok_s"] / row["bare"]["decode_tok_s"]
        row["total_ratio"] = row["engine"]["total_tok_s"] / row["bare"]["total_tok_s"]
        row["step_ratio"], row["step_ratio_se"] = geometric_mean_se(step_ratios([r.__dict__ for r in runs], batch))
        for runner in ("bare-queue", "engine-queue"):
            mine = [r.total_tok_s for r in runs if r.batch == batch and r.runner == runner]
            if mine:
                row[runner] = {"total_tok_s": median(mine)}
        out.append(row)
    return out
