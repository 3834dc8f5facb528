"""Where a long prompt's prefill goes: one sequence, chunk by chunk, in process.

A random-weight model of a preset's shapes (no tokenizer, no weights needed)
prefills random prompts of each `--sizes` length the way mlx-lm's generation
loop and tierlm's batch do (the model over a chunk, then the cache evaluated:
the logits are never computed), for each chunk size and each way of running
attention:

- cudnn: MLX's own (on CUDA: a cuDNN graph per shape of queries and keys);
- products: tierlm's `backends.gpu.attention_products` for every chunk
  (two matmuls around a float32 softmax, in pieces of 256 MB of scores);
- batchcache: mlx-lm's batch KV cache in place of the plain one, with its
  array masks; batchcache-causal: that cache, its masks told as "causal";
  batchcache-clear: and MLX's buffer cache emptied after each chunk (as
  mlx-lm's batch does);
- batch: mlx-lm's BatchGenerator given the one prompt, to its first token;
- engine: tierlm's engine as a server keeps it (prefix cache on, cleared
  before each run), to its first token; needs `--tokenizer` (a model folder),
  whose vocabulary the model then takes.

Each (variant, chunk size, length) runs `--rounds` times on new tokens; the
first is reported apart (it builds what a shape needs). Per run: the total
seconds, tokens a second, and each chunk's seconds (the first chunk meets few
keys, so the growth after it is what attention costs). Run it again with
MLX_CUDA_USE_CUDNN_SDPA=0 (and `--label`) for MLX's kernels without cuDNN.

    python -m bench_lab.prefill --preset llama-1b --sizes 2000 20000 --steps 2048 4096 8192
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from bench_lab import lab_parser, write_result
from tierlm.bench.report import markdown_table

VARIANTS = ("cudnn", "products", "batchcache", "batchcache-causal", "batchcache-clear", "batch", "engine")
VOCAB = 128256  # Llama 3's: the presets take theirs from a tokenizer


def build(preset: str, dtype: str, vocab: int = VOCAB):
    """The preset's model with random weights, evaluated."""
    import mlx.core as mx

    from tierlm.models.random_model import PRESETS, build_model, random_weights

    model = build_model({"vocab_size": vocab, **PRESETS[preset]})
    model.load_weights(list(random_weights(model, dtype).items()))
    mx.eval(model(mx.array([[0]])))  # and what is not a parameter (RoPE's frequencies), on this thread
    return model


def prefill(model, tokens: list[int], step: int, batch_cache: str = "", clear: bool = False) -> list[float]:
    """Seconds each chunk of `tokens` took, the cache evaluated after each.
    `batch_cache`: "array" (mlx-lm's BatchKVCache and its array masks) or
    "causal" (that cache, masks told as "causal"); else mlx-lm's KVCache.
    `clear`: MLX's buffer cache emptied after each chunk, as mlx-lm's batch does."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    class ArrayMasked(BatchKVCache):
        """mlx-lm's batch cache by another name: backends.gpu tells only its own
        class's unpadded masks to cuDNN as "causal"."""

    cache = make_prompt_cache(model)
    if batch_cache:
        cache = [(ArrayMasked if batch_cache == "array" else BatchKVCache)([0]) for _ in cache]
        if batch_cache == "causal":
            for c in cache:
                c.make_mask = lambda n, **kw: "causal"
    times = []
    for start in range(0, len(tokens), step):
        chunk = mx.array(tokens[start : start + step])[None]
        mx.synchronize()
        tic = time.perf_counter()
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
        if clear:
            mx.clear_cache()
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    del cache
    mx.clear_cache()
    return times


def batch_prefill(model, tokens: list[int], step: int) -> list[float]:
    """Seconds mlx-lm's BatchGenerator takes from the prompt to its first token."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=1, prefill_step_size=step)
    mx.synchronize()
    tic = time.perf_counter()
    gen.insert([tokens])
    while not any(r.token is not None for r in gen.next()[1]):
        pass
    seconds = time.perf_counter() - tic
    del gen
    mx.clear_cache()
    return [seconds]


class EnginePrefill:
    """tierlm's engine, one per chunk size, each run's time to the first token."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.runners = model, tokenizer, {}

    def __call__(self, tokens: list[int], step: int) -> list[float]:
        from tierlm.bench.engine_overhead import EngineRunner

        if step not in self.runners:
            self.runners[step] = EngineRunner(self.model, self.tokenizer, 1, step)
        return [self.runners[step].run([tokens], 1).mean_ttft_s]

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()


def use_variant(variant: str) -> None:
    """Which attention the chunks get (gpu.install's wrapper reads MAX_QUERIES per call)."""
    from tierlm.backends import gpu

    gpu.MAX_QUERIES = 10**9 if variant == "products" else 256


def measure(run, size: int, step: int, variant: str, rounds: int, vocab: int, seed: int) -> dict:
    """`run(tokens, step)`: each chunk's seconds (one figure where chunks are not seen)."""
    use_variant(variant)
    rng = random.Random(seed)
    runs = []
    for _ in range(rounds):
        chunks = run([rng.randrange(100, vocab) for _ in range(size)], step)
        runs.append({"seconds": sum(chunks), "chunks": chunks})
        print(f"{variant} step {step} size {size}: {sum(chunks):.3f} s "
              f"(chunks {', '.join(f'{c * 1000:.0f}' for c in chunks)} ms)", flush=True)
    later = [r["seconds"] for r in runs[1:]] or [runs[0]["seconds"]]
    return {"variant": variant, "step": step, "size": size, "first_s": runs[0]["seconds"],
            "median_s": statistics.median(later), "tok_s": size / statistics.median(later), "runs": runs}


def title(result: dict) -> str:
    variants = ", ".join(dict.fromkeys(m["variant"] for m in result["measurements"]))
    return f"Prefill of one long prompt, {result['preset']}: {variants} ({result['label']})"


def table(result: dict) -> str:
    header = ["variant", "chunk", "tokens", "first run s", "later runs s (median)", "tok/s"]
    return markdown_table(header, [[m["variant"], str(m["step"]), str(m["size"]), f"{m['first_s']:.3f}",
                                    f"{m['median_s']:.3f}", f"{m['tok_s']:.0f}"] for m in result["measurements"]])


def main(argv=None) -> int:
    p = lab_parser("bench_lab.prefill", __doc__)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--steps", type=int, nargs="+", default=[2048])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokenizer", default=None, help="a model folder: its tokenizer, for the engine variant")
    p.add_argument("--label", default="MLX as installed", help="what this run's environment is, for the table")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import mlx.core as mx

    from tierlm.backends import gpu

    tokenizer = None
    if args.tokenizer:
        from mlx_lm.utils import load_tokenizer

        from tierlm.models.random_model import tokenizer_vocab_size

        tokenizer = load_tokenizer(Path(args.tokenizer))
    elif "engine" in args.variants:
        p.error("the engine variant needs --tokenizer")
    model = build(args.preset, args.dtype, tokenizer_vocab_size(Path(args.tokenizer)) if tokenizer else VOCAB)
    gpu.install(model)
    vocab = model.args.vocab_size if tokenizer is None else len(tokenizer.vocab)
    engine = EnginePrefill(model, tokenizer)
    runs = {"cudnn": lambda t, s: prefill(model, t, s), "products": lambda t, s: prefill(model, t, s),
            "batchcache": lambda t, s: prefill(model, t, s, "array"),
            "batchcache-causal": lambda t, s: prefill(model, t, s, "causal"),
            "batchcache-clear": lambda t, s: prefill(model, t, s, "causal", clear=True),
            "batch": lambda t, s: batch_prefill(model, t, s), "engine": engine}
    try:
        measurements = [measure(runs[variant], size, step, variant, args.rounds, vocab, seed=size * 7 + step)
                        for step in args.steps for size in args.sizes for variant in args.variants]
    finally:
        engine.close()
    result = {"preset": args.preset, "dtype": args.dtype, "label": args.label, "device": str(mx.default_device()),
              "measurements": measurements}
    print(title(result))
    print(table(result))
    write_result(args, p, "prefill", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
