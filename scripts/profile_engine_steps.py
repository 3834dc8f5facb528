"""Where the engine's worker time goes, per scheduler step, against a bare loop.

    python scripts/profile_engine_steps.py MODEL_DIR [BATCHES] [--json OUT]

For each batch size (default 1,8,32): three runs of 512-token random prompts and
256 greedy tokens on one long-lived engine (tierlm.bench.engine_overhead's
EngineRunner), then a bare mlx-lm BatchGenerator timed per `next()`. It prints
microseconds per step of each timed part:

- next / next_cpu: BatchGenerator.next inside the engine, wall and thread CPU
  time (CPU close to wall: the worker is CPU-bound and the device waits for it);
- step, _advance, _on_token, ...: the scheduler's own parts around it;
- burst, dispatch(main): the worker's hand-offs and the event loop's share;
- bare_next*: the bare loop's next(), the same model work with nothing around it.

The engine's overhead per step is roughly step - next; this is how the deferred
prefix-cache stores and the per-burst outputs were found (README, Benchmarks).
It wraps private methods, so it is a diagnostic, not part of the package.
"""

from __future__ import annotations

import tierlm  # noqa: F401  first: it loads the CPU fast path's BLAS, which must precede mlx.core

# isort: split
import argparse
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


def time_generator_next() -> None:
    """BatchGenerator.next of every generator the scheduler makes, wall and CPU."""
    make = scheduler.Scheduler._new_generator

    def new_generator(self):
        gen = make(self)
        step = gen.next

        def timed():
            tic, cpu = time.perf_counter(), time.thread_time()
            result = step()
            totals["next"] += time.perf_counter() - tic
            totals["next_cpu"] += time.thread_time() - cpu
            return result

        gen.next = timed
        return gen

    scheduler.Scheduler._new_generator = new_generator


def bare_step_times(model, prompts, max_tokens: int, stream) -> dict:
    """Per-next() wall and CPU time of a bare BatchGenerator, past the prefills."""
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=min(8, len(prompts)),
                         prefill_step_size=2048, stream=stream)
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    wall, cpu, done = [], [], 0
    while done < len(prompts):
        tic, c = time.perf_counter(), time.thread_time()
        _, responses = gen.next()
        wall.append(time.perf_counter() - tic)
        cpu.append(time.thread_time() - c)
        done += sum(1 for r in responses if r.finish_reason)
    gen.close()
    wall, cpu = wall[len(wall) // 4 :], cpu[len(cpu) // 4 :]
    return {"bare_next": statistics.mean(wall) * 1e6, "bare_next_cpu": statistics.mean(cpu) * 1e6,
            "bare_next_median": statistics.median(wall) * 1e6}


def profile(model_dir: str, batches: list[int], rounds: int = 3, max_tokens: int = 256) -> dict:
    model, tokenizer = load_model(model_dir)
    vocab = usable_vocab_size(tokenizer, model)
    stream = mx.new_stream(mx.default_device())
    rows = {}
    for batch in batches:
        prompts = random_prompts(vocab, batch, 512, batch)
        engine = EngineRunner(model, tokenizer, batch, 2048)
        engine.run(prompts[:2], 8)  # warm the engine's stream
        bare_step_times(model, prompts[:2], 8, stream)
        for rnd in range(rounds):
            totals.clear()
            result = engine.run(prompts, max_tokens)
            steps = totals["step#"]
            row = {k: v / steps * 1e6 for k, v in totals.items() if not k.endswith("#")}
            row |= {"steps": steps, "bursts": totals["burst#"], "engine_decode_tok_s": result.decode_tok_s}
            row |= bare_step_times(model, prompts, max_tokens, stream)
            rows[f"batch {batch} round {rnd}"] = row
            print(f"batch {batch} round {rnd}:", json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
        engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("batches", nargs="?", default="1,8,32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for name in SCHEDULER_PARTS:
        time_method(scheduler.Scheduler, name, name)
    for name, key in ENGINE_PARTS.items():
        time_method(core.EngineCore, name, key)
    time_generator_next()
    rows = profile(args.model, [int(b) for b in args.batches.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
