"""A hot hit's host work as a timeline: the engine's functions that a hit runs
through (the scheduler's step and its admission, lookup, insert and advance,
the rebuild, mlx-lm's batch construction and steps, MLX's evaluations) each
timed where it is called, with nothing evaluated that the engine would not
evaluate (bench_lab.hit_profile evaluates every call to time it). On a GPU a
hot hit is bound by the host, not the device (a 20k-token hit of a 1B model on
an H100: 6 ms of kernels in a ~20 ms span): this shows where that time goes.

Each round: a cold prompt of `--context` random tokens, then it with new
tokens appended (a hot hit, one token out); odd rounds drop the kept last
sequence first (another request's way), so that the hit is rebuilt from
blocks: `via` says which. The last `--show` rounds' timelines are printed.

    python -m bench_lab.hit_trace --preset llama-1b --tokenizer TOKENIZER_DIR --context 20000
"""

from __future__ import annotations

import functools
import importlib
import random
import threading
import time

from bench_lab import add_model_args, lab_parser, write_result
from bench_lab.hit_profile import drop_kept, round_prompts, warmed_llm

# module:qualified name of what is timed
TRACED = (
    "tierlm.engine.scheduler:Scheduler.step", "tierlm.engine.scheduler:Scheduler._flush_stores",
    "tierlm.engine.scheduler:Scheduler._admit", "tierlm.engine.scheduler:Scheduler._lookup",
    "tierlm.engine.scheduler:Scheduler._insert", "tierlm.engine.scheduler:Scheduler._advance",
    "tierlm.cache.prefix_cache:PrefixCache.rebuild", "tierlm.engine.folded_prompt:FoldingPromptBatch.split",
    "tierlm.engine.folded_prompt:_FirstStep.__call__", "tierlm.engine.first_token:FirstTokensFirst.posting_step",
    "mlx_lm.generate:PromptProcessingBatch.__init__", "mlx_lm.generate:GenerationBatch.__init__",
    "mlx_lm.generate:GenerationBatch._step", "mlx_lm.models.cache:TokenBuffer.__init__",
    "mlx.core:eval", "mlx.core:async_eval",
)


class Timeline:
    """Installs timing wrappers on `TRACED` while entered; `events`: (start,
    end, depth on its thread, name, thread name), perf_counter seconds."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._depth = threading.local()
        self._saved: list[tuple] = []

    def __enter__(self):
        for path in TRACED:
            module, _, qualified = path.partition(":")
            *owners, name = qualified.split(".")
            owner = functools.reduce(getattr, owners, importlib.import_module(module))
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self._timed(getattr(owner, name), qualified))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _timed(self, fn, label: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "d", 0)
            self._depth.d = depth + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.d = depth
                self.events.append((start, time.perf_counter(), depth, label, threading.current_thread().name))

        return timed


def trace(llm, context: int, rounds: int, extra: int = 40, seed: int = 0) -> list[dict]:
    """Rows of one hot hit each: its tokens, `via` (kept/blocks), ms, and its
    timeline as (start ms, ms, depth, name, thread) from the request's start."""
    from tierlm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(seed)
    rows = []
    with Timeline() as timeline:
        for r in range(rounds):
            cold, hot = round_prompts(rng, llm.vocab_size, context, extra, r)
            llm.generate([cold], params, progress=False)
            via = "blocks" if r % 2 else "kept"
            if via == "blocks":
                drop_kept(llm)
            time.sleep(0.3)  # the cold prompt's blocks stored
            timeline.events.clear()
            tic = time.perf_counter()
            llm.generate([hot], params, progress=False)
            ms = (time.perf_counter() - tic) * 1e3
            events = [(round((s - tic) * 1e3, 3), round((e - s) * 1e3, 3), d, name, thread)
                      for s, e, d, name, thread in sorted(timeline.events) if s >= tic]
            rows.append({"prompt_tokens": len(hot), "via": via, "ms": round(ms, 2), "events": events})
    return rows


def show(row: dict) -> str:
    lines = [f"hot {row['prompt_tokens']} via {row['via']}: {row['ms']} ms"]
    lines += [f"  {s:8.2f} {ms:7.2f}  {thread[:14]:14s} {'  ' * d}{name}" for s, ms, d, name, thread in row["events"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = lab_parser("bench_lab.hit_trace", __doc__)
    add_model_args(p)
    p.add_argument("--context", type=int, default=2000, help="tokens of the first round's prompt")
    p.add_argument("--rounds", type=int, default=6, help="hot hits (kept and from blocks in turn)")
    p.add_argument("--show", type=int, default=2, help="timelines printed (the last rounds')")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with warmed_llm(args, "tierlm-hit-trace-") as llm:
        rows = trace(llm, args.context, args.rounds)
    for row in rows[:-args.show] if args.show else rows:
        print(f"hot {row['prompt_tokens']} via {row['via']}: {row['ms']} ms")
    for row in rows[-args.show:] if args.show else []:
        print(show(row))
    write_result(args, p, "hit_trace", {"context": args.context, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
