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
  is full_next + full_between - bare_full_next - bare_full_between, but the two
  runs differ by the host's drift too; `step_ratio` is the same pair measured
  inside the engine's run (tierlm.bench.step_timing.step_accounted_ratio).

The timers around the parts cost a few microseconds per call and so inflate
`between` (on the H200 at batch 32, ~2x): `--steps-only` times only next() for
the like-for-like figures. `--no-prefix-cache` runs the engine without it;
`--both` runs one engine with it and one without, alternating within each round.
`gc` is the garbage collector's time per step (any thread); `full_between_median`
and `_max` show whether the between is spread or one pause, and
`full_between_in_bursts` + `full_between_handoffs` (= `full_between`) split it into
the steps inside a burst and the first steps of bursts.

This is how the deferred prefix-cache stores, the per-burst outputs and the
end-of-prompt extraction were found (README, Benchmarks). It wraps private
methods, so it is a diagnostic, not part of the package.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from collections import Counter

import mlx.core as mx

from tierlm.bench.engine_overhead import EngineRunner, random_prompts, run_bare
from tierlm.bench.step_timing import TimedNext, step_accounted_ratio
from tierlm.engine import core, scheduler
from tierlm.models.loader import load_model, usable_vocab_size

SCHEDULER_PARTS = ("step", "_apply_aborts", "_admit", "_advance", "_on_token", "_emit", "take_outputs",
                   "_publish_load", "_flush_stores")
ENGINE_PARTS = {"_dispatch": "dispatch(main)", "_burst": "burst"}

totals: Counter = Counter()  # seconds per part, and calls under "<part>#"


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


def mark_bursts() -> None:
    """Marks the first next() of each engine burst (step_timing.TimedNext.new_burst)."""
    burst = core.EngineCore._burst

    def marked_burst(self):
        timed = self.scheduler._gen.next
        if isinstance(timed, TimedNext):  # not yet, before the first run times it
            timed.new_burst = True
        return burst(self)

    core.EngineCore._burst = marked_burst


def gc_timer() -> dict:
    """Seconds spent in the garbage collector and its full (generation 2)
    collections, counted from now on, on every thread."""
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
    """`configs`: named settings overrides; each gets its own engine, and their
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
        run_bare(model, prompts, 8, 2048, stream)
        for rnd in range(rounds):
            for name, engine in engines.items():
                row, steps = profile_run(engine, prompts, max_tokens, gc_spent)
                bare = run_bare(model, prompts, max_tokens, 2048, stream).steps
                row |= {"bare_full_" + k: v for k, v in bare.items()}
                row["step_ratio"] = step_accounted_ratio(bare, steps) if bare and steps else math.nan
                key = f"batch {batch} round {rnd}" + (f" {name}" if len(engines) > 1 else "")
                rows[key] = row
                print(f"{key}:", json.dumps({k: round(v, 3 if k == "step_ratio" else 1) for k, v in row.items()}),
                      flush=True)
        for engine in engines.values():
            engine.close()
    return rows


def profile_run(engine: EngineRunner, prompts, max_tokens: int, gc_spent: dict) -> tuple[dict, dict]:
    """The row of one engine run, and its full-step timings."""
    totals.clear()
    counters = engine.engine.scheduler.counters
    steps, bursts = counters.steps, engine.engine.bursts
    gc_s, gc_full = gc_spent["gc_s"], gc_spent["gc_full"]
    result = engine.run(prompts, max_tokens)
    steps, bursts = counters.steps - steps, engine.engine.bursts - bursts
    row = {k: v / steps * 1e6 for k, v in totals.items() if not k.endswith("#")}
    row |= {"next": sum(n[0] for n in engine.records) / steps * 1e6,
            "next_cpu": sum(n[1] for n in engine.records) / steps * 1e6,
            "steps": steps, "bursts": bursts, "engine_decode_tok_s": result.decode_tok_s,
            "main_cpu": result.steps.get("main_cpu", math.nan),  # the runner's count, per step
            "gc": (gc_spent["gc_s"] - gc_s) / steps * 1e6, "gc_full": gc_spent["gc_full"] - gc_full}
    return row | {"full_" + k: v for k, v in result.steps.items() if k != "main_cpu"}, result.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("batches", nargs="?", default="1,8,32")
    p.add_argument("--steps-only", action="store_true", help="time next() only, not the parts")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--no-prefix-cache", action="store_true")
    cache.add_argument("--both", action="store_true", help="engines with and without the prefix cache, alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not args.steps_only:
        for name in SCHEDULER_PARTS:
            time_method(scheduler.Scheduler, name, name)
        for name, key in ENGINE_PARTS.items():
            time_method(core.EngineCore, name, key)
    mark_bursts()
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
