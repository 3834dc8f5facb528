"""Where a prefix-cache hit's time goes in the engine, in process: a prompt
of `--context` random tokens (cold), then the same prompt with `--extra` new
tokens (a hot hit), each through `tierlm.LLM` with one token out; every model
call and the rebuild of the hit's blocks evaluated at once and timed. The hot
hit takes the cold prompt's KV as the batch left it (engine/last_sequence.py;
no rebuild), or with `--via blocks` is rebuilt from the cached blocks (that KV
dropped first, as another request would). Rounds
of new lengths first (each round a context 37 tokens longer and 13 more new
tokens: shapes the process has not run, as an agent's every turn), then the
same lengths again (shapes it has run). On an H100 (random Llama-3.2-1B
shapes, 20k tokens) it split a hot hit into the rebuild (~2 ms), the
remainder's pass and the first decode step, and showed the pass's first run
at a new length costing 2-4x a repeat (docs/prefix-cache.md).

    python -m bench_lab.hit_profile --preset llama-1b --tokenizer TOKENIZER_DIR --context 20000 --extra 40
    python -m bench_lab.hit_profile --context 2000 --extra 40       # the default model, e.g. on a CPU

`--kernels` adds each hot hit's GPU kernels (bench_lab.gpu_kernels: torch's
profiler sees MLX's kernels too); on an H100 it found mlx-lm's move of a
sequence from prefill to generation gathering its whole KV (~5 ms of a 20k
token hit's ~24 ms of GPU work).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from bench_lab import add_model_args, gpu_kernels, lab_parser, model_folder, write_result


class CallTimer:
    """Times each call of the model and of the prefix cache's rebuild while
    installed (`with`): ("model", input shape, build ms, run ms) or
    ("rebuild", blocks, ms)."""

    def __init__(self, model, cache) -> None:
        self.model_class, self.cache, self.calls = type(model), cache, []

    def __enter__(self):
        import mlx.core as mx

        model_call, rebuild = self.model_class.__call__, self.cache.rebuild

        def timed_call(model, inputs, *a, **k):
            t0 = time.perf_counter()
            out = model_call(model, inputs, *a, **k)
            t1 = time.perf_counter()
            mx.eval(out)
            self.calls.append(("model", list(inputs.shape), _ms(t1 - t0), _ms(time.perf_counter() - t1)))
            return out

        def timed_rebuild(blocks, *a):
            t0 = time.perf_counter()
            caches = rebuild(blocks, *a)
            mx.eval([c.state for c in caches])
            self.calls.append(("rebuild", len(blocks), _ms(time.perf_counter() - t0)))
            return caches

        self._saved = model_call
        self.model_class.__call__ = timed_call
        self.cache.rebuild = timed_rebuild
        return self

    def __exit__(self, *exc) -> None:
        self.model_class.__call__ = self._saved
        del self.cache.rebuild  # the instance attribute: the class's method again


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def round_prompts(rng: random.Random, vocab: int, context: int, extra: int, r: int) -> tuple[list, list]:
    """Round r's cold prompt (`context` + 37 r random tokens) and its hot hit (it
    and `extra` + 13 r more): lengths no earlier round ran, as an agent's turns."""
    cold = [rng.randrange(100, vocab - 100) for _ in range(context + 37 * r)]
    return cold, cold + [rng.randrange(100, vocab - 100) for _ in range(extra + 13 * r)]


def drop_kept(llm) -> None:
    """Drop the last sequence's kept KV, as another request would: the next hit
    is rebuilt from blocks (the engine is idle between requests)."""
    llm.engine.scheduler.cache.last = None


@contextmanager
def warmed_llm(args, prefix: str, **options):
    """tierlm.LLM on --model (or --preset's random weights, written under a
    temporary folder), the hot tier only (blocks an earlier run left on the SSD
    would make a cold prompt a hit), once it has warmed its shapes (a GPU's:
    they are not what is timed); closed after."""
    from tierlm import LLM

    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        llm = LLM(str(model_folder(args, Path(work))), prefix_cache=True, ssd_cache=False, max_concurrent_requests=4,
                  **options)
        try:
            tic = time.perf_counter()
            while llm.engine.warming:
                time.sleep(0.2)
            print(f"warmed in {time.perf_counter() - tic:.1f} s more", flush=True)
            yield llm
        finally:
            llm.close()


def profile(llm, context: int, extra: int, rounds: int, seed: int = 0, kernels: bool = False,
            via: str = "kept") -> list[dict]:
    """Rows of one request each: phase (new/repeat), kind (cold/hot), prompt
    tokens, ms to its end, and the calls timed; with `kernels`, a hot hit's GPU
    kernels too (bench_lab.gpu_kernels). `via`: "kept" (the engine's way) or
    "blocks" (the kept KV dropped before each hot hit)."""
    from tierlm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(seed)
    vocab = llm.vocab_size
    rows = []
    timer = CallTimer(llm.engine.model, llm.engine.scheduler.cache)
    with timer:
        for phase in ("new", "repeat"):
            for r in range(rounds):
                for kind, tokens in zip(("cold", "hot"), round_prompts(rng, vocab, context, extra, r)):
                    if kind == "hot" and via == "blocks":
                        drop_kept(llm)
                    timer.calls.clear()
                    found: list = []
                    with gpu_kernels.recorded(found) if kernels and kind == "hot" else nullcontext():
                        tic = time.perf_counter()
                        llm.generate([tokens], params, progress=False)
                        ms = _ms(time.perf_counter() - tic)
                    rows.append({"phase": phase, "kind": kind, "prompt_tokens": len(tokens),
                                 "ms": ms, "calls": list(timer.calls)} | ({"kernels": found[0]} if found else {}))
                    print(f"{kind} {phase} {len(tokens)} tokens: {rows[-1]['ms']} ms"
                          + (f"  {rows[-1]['calls']}" if kind == "hot" else "")
                          + (f"\n  GPU kernels: {found[0]}" if found else ""), flush=True)
    return rows


def medians(rows: list[dict]) -> dict:
    """ms to the end, median by kind and phase."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(f"{row['kind']}_{row['phase']}", []).append(row["ms"])
    return {name: statistics.median(values) for name, values in groups.items()}


def main(argv=None) -> int:
    p = lab_parser("bench_lab.hit_profile", __doc__)
    add_model_args(p)
    p.add_argument("--context", type=int, default=2000, help="tokens of the first round's prompt")
    p.add_argument("--extra", type=int, default=40, help="new tokens of the first round's hit")
    p.add_argument("--rounds", type=int, default=3, help="rounds of new lengths (then as many repeated)")
    p.add_argument("--memory-limit", default=None, help="tierlm's memory budget (default: its own)")
    p.add_argument("--kernels", action="store_true",
                   help="each hot hit's GPU kernels from torch's profiler (needs torch with CUDA)")
    p.add_argument("--via", choices=("kept", "blocks"), default="kept",
                   help="the hot hit from the last sequence's KV as kept (the engine's way) or from blocks")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.kernels and (why := gpu_kernels.available()):
        p.error(f"--kernels: {why}")
    options = {"memory_limit": args.memory_limit} if args.memory_limit else {}
    with warmed_llm(args, "tierlm-hit-profile-", **options) as llm:
        rows = profile(llm, args.context, args.extra, args.rounds, kernels=args.kernels, via=args.via)
    result = {"model": str(args.model or args.preset or "default"), "context": args.context, "extra": args.extra,
              "rounds": args.rounds, "via": args.via, "medians_ms": medians(rows), "rows": rows}
    print({k: round(v, 1) for k, v in result["medians_ms"].items()})
    write_result(args, p, "hit_profile", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
