"""Where the engine's worker time goes, per scheduler step, against a bare loop.

    python scripts/profile_engine_steps.py MODEL_DIR [BATCHES] [--steps-only] [--no-prefix-cache | --both] [--json OUT]

For each batch size (default 1,8,32): three runs of 512-token random prompts and
256 greedy tokens on one long-lived engine (tierlm.bench.engine_overhead's
EngineRunner), then a bare mlx-lm BatchGenerator timed per `next()`. It prints
microseconds per step of each timed part:

- next / next_cpu: BatchGenerator.next inside the engine, wall and thread CPU
  time (CPU close to wall: the worker is CPU-bound and the device waits for it);
- step, _advance, _on_token, ...: the scheduler's own parts around it;
- burst, dispatch(main): the worker's hand-offs and the event loop's share;
  main_cpu: the event loop thread's CPU time, per step;
- full_*: the steps that decoded the whole batch and prefilled nothing, in the
  engine and in a bare loop (bare_full_*): next's wall, median, CPU, and
  `between`, the time from one next() to the next (the engine's whole cost
  outside the model step). Like for like: the engine's overhead per decode step
  is full_next + full_between - bare_full_next - bare_full_between.

The timers around the parts cost a few microseconds per call and so inflate
`between` (on the H200 at batch 32, ~2x): `--steps-only` times only next() for
the like-for-like figures. `--no-prefix-cache` runs the engine without it;
`--both` runs one engine with it and one without, alternating within each round.
`gc` is the garbage collector's time per step (any thread), `full_between_*`
splits the engine's between into steps inside a burst and the hand-offs.

This is how the deferred prefix-cache stores and the per-burst outputs were
found (README, Benchmarks). It wraps private methods, so it is a diagnostic,
not part of the package.
"""

from __future__ import annotations

import tierlm  # noqa: F401  first: it loads the CPU fast path's BLAS, which must precede mlx.core

# isort: split
import argparse
import gc
import json
import statistics
import time
from collections import Counter

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from tierlm.bench.engine_overhead import EngineRunner, random_prompts
from tierlm.engine import core, scheduler
from tierlm.models.loader import load_model, usable_vocab_size

SCHEDULER_PARTS = ("step", "_apply_aborts", "_admit", "_advance", "_on_token", "_publish_load", "_flush_stores")
ENGINE_PARTS = {"_dispatch": "dispatch(main)", "_burst": "burst"}

totals: Counter = Counter()  # seconds per part, and calls under "<part>#"
engine_nexts: list[tuple] = []  # TimedNext records of the engine's generators


def time_method(cls, name: str, key: str) -> None:
    method = getattr(cls, name)

    def timed(self, *args, **kwargs):
        tic = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - tic
            totals[key + "#"] += 1

    setattr(cls, name, timed)


class TimedNext:
    """A BatchGenerator's next(), recording per call (wall, thread CPU, time since
    the previous call ended, prompt responses, generated tokens, whether it is the
    first call of an engine burst)."""

    def __init__(self, step, records: list):
        self.step, self.records, self.last_end = step, records, None
        self.new_burst = False  # set by the engine's _burst wrapper, see time_generator_next

    def __call__(self):
        tic, cpu = time.perf_counter(), time.thread_time()
        result = self.step()
        wall, cpu = time.perf_counter() - tic, time.thread_time() - cpu
        between = tic - self.last_end if self.last_end is not None else 0.0
        self.records.append((wall, cpu, between, len(result[0]), len(result[1]), self.new_burst))
        self.last_end, self.new_burst = time.perf_counter(), False
        return result


def time_generator_next() -> None:
    """BatchGenerator.next of every generator the scheduler makes, into engine_nexts;
    the first next() of each burst is marked."""
    make, burst = scheduler.Scheduler._new_generator, core.EngineCore._burst

    def new_generator(self):
        gen = make(self)
        gen.next = TimedNext(gen.next, engine_nexts)
        return gen

    def marked_burst(self):
        self.scheduler._gen.next.new_burst = True
        return burst(self)

    scheduler.Scheduler._new_generator = new_generator
    core.EngineCore._burst = marked_burst


def bare_step_times(model, prompts, max_tokens: int, stream) -> dict:
    """Per-next() wall and CPU time of a bare BatchGenerator, and the loop's time
    between two next() calls, on full-batch decode steps (no prefill in them)."""
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=min(8, len(prompts)),
                         prefill_step_size=2048, stream=stream)
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    nexts, done = [], 0
    step = TimedNext(gen.next, nexts)
    while done < len(prompts):
        _, responses = step()
        done += sum(1 for r in responses if r.finish_reason)
    gen.close()
    return {"bare_full_" + k: v for k, v in full_decode_steps(nexts, len(prompts)).items()}


def full_decode_steps(nexts: list[tuple], batch: int) -> dict:
    """Means in microseconds over the steps that decoded the whole batch and
    prefilled nothing: the same model work in the engine and in the bare loop."""
    full = [n for n in nexts[1:] if n[3] == 0 and n[4] == batch]
    if not full:
        return {}
    wall, cpu, between = ([n[i] * 1e6 for n in full] for i in range(3))
    row = {"steps": len(full), "next": statistics.mean(wall), "next_median": statistics.median(wall),
           "next_cpu": statistics.mean(cpu), "between": statistics.mean(between),
           "between_median": statistics.median(between), "between_max": max(between)}
    # The engine's between, split: inside a burst, and at the first step of a burst
    # (the hand-off), as a share of the mean per step
    inside = [n[2] * 1e6 for n in full if len(n) > 5 and not n[5]]
    if inside and len(inside) < len(full):
        row["between_in_burst"] = statistics.mean(inside)
        row["between_handoffs"] = (sum(between) - sum(inside)) / len(full)
    return row


def gc_timer() -> dict:
    """Seconds spent in the garbage collector, by generation (while installed)."""
    spent = {"gc_s": 0.0, "gc_full": 0}
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent["gc_s"] += time.perf_counter() - started[0]
            spent["gc_full"] += info["generation"] == 2

    gc.callbacks.append(callback)
    return spent


def profile(model_dir: str, batches: list[int], configs: dict[str, dict], rounds: int = 3,
            max_tokens: int = 256) -> dict:
    """`configs`: named EngineConfig overrides; each gets its own engine, and their
    runs alternate within each round (the host's speed drifts between processes)."""
    model, tokenizer = load_model(model_dir)
    vocab = usable_vocab_size(tokenizer, model)
    stream = mx.new_stream(mx.default_device())
    gc_spent = gc_timer()
    rows = {}
    for batch in batches:
        prompts = random_prompts(vocab, batch, 512, batch)
        engines = {name: EngineRunner(model, tokenizer, batch, 2048, **config) for name, config in configs.items()}
        for engine in engines.values():
            engine.run(prompts, 8)  # warm both streams at this batch size (CUDA graphs)
        bare_step_times(model, prompts, 8, stream)
        for rnd in range(rounds):
            for name, engine in engines.items():
                row = profile_run(engine, prompts, max_tokens, gc_spent)
                row |= bare_step_times(model, prompts, max_tokens, stream)
                key = f"batch {batch} round {rnd}" + (f" {name}" if len(engines) > 1 else "")
                rows[key] = row
                print(f"{key}:", json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
        for engine in engines.values():
            engine.close()
    return rows


def profile_run(engine: EngineRunner, prompts, max_tokens: int, gc_spent: dict) -> dict:
    totals.clear()
    engine_nexts.clear()
    counters = engine.engine.scheduler.counters
    steps, bursts = counters.steps, engine.engine.bursts
    gc_s, gc_full = gc_spent["gc_s"], gc_spent["gc_full"]
    main_cpu = time.thread_time()
    result = engine.run(prompts, max_tokens)
    main_cpu = time.thread_time() - main_cpu
    steps, bursts = counters.steps - steps, engine.engine.bursts - bursts
    row = {k: v / steps * 1e6 for k, v in totals.items() if not k.endswith("#")}
    row |= {"next": sum(n[0] for n in engine_nexts) / steps * 1e6,
            "next_cpu": sum(n[1] for n in engine_nexts) / steps * 1e6,
            "steps": steps, "bursts": bursts, "engine_decode_tok_s": result.decode_tok_s,
            "main_cpu": main_cpu / steps * 1e6,
            "gc": (gc_spent["gc_s"] - gc_s) / steps * 1e6, "gc_full": gc_spent["gc_full"] - gc_full}
    return row | {"full_" + k: v for k, v in full_decode_steps(engine_nexts, engine.batch).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("batches", nargs="?", default="1,8,32")
    p.add_argument("--steps-only", action="store_true", help="time next() only, not the parts")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--both", action="store_true", help="engines with and without the prefix cache, alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not args.steps_only:
        for name in SCHEDULER_PARTS:
            time_method(scheduler.Scheduler, name, name)
        for name, key in ENGINE_PARTS.items():
            time_method(core.EngineCore, name, key)
    time_generator_next()
    if args.both:
        configs = {"cache": {}, "nocache": {"prefix_cache": False}}
    else:
        configs = {"nocache": {"prefix_cache": False}} if args.no_prefix_cache else {"cache": {}}
    rows = profile(args.model, [int(b) for b in args.batches.split(",")], configs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
