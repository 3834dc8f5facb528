"""Where a decode step over a long context goes: ms of one model call of one
token a sequence, after a chunked prefill of `--context` tokens, with the
attention as the model has it and in variants that take a part away (skipped;
over contiguous copies of the cache's keys and values; without the mask; on
tierlm's GPU products), for mlx-lm's single-sequence `KVCache` and for its
`BatchKVCache` of `--batch` rows (what the engine's batch holds). The model
as tierlm loads it, without an engine: "as it is" is its backend's attention
(on a CUDA GPU tierlm.backends.gpu's wrapper, `TIERLM_FEW_QUERY_ATTENTION=off`
for MLX's own), and the variants call that with their inputs. On an H100
(random Llama-3.2-1B shapes) it showed a lone sequence's step over 20k tokens
at 14.9 ms through the wrapper's products, 6.0 through MLX's vector kernel
(docs/prefix-cache.md). With `--tokens 40 53` each call feeds that many
tokens a row instead: a hit remainder's pass over the context.

    python -m bench_lab.decode_step --preset llama-1b --tokenizer TOKENIZER_DIR --context 2000 20000
    python -m bench_lab.decode_step --context 4000 --batch 4          # the default model, e.g. on a CPU
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_lab import add_model_args, lab_parser, model_folder, write_result

STEPS = 8  # timed calls a variant; the first two are left out of the median


def variants(original) -> dict:
    """name -> the attention function a variant puts in the model's module."""
    import mlx.core as mx

    from tierlm.backends import gpu

    c = mx.contiguous

    def skipped(q, k, v, cache, scale, mask, sinks=None):
        return q

    def contiguous(q, k, v, cache, scale, mask, sinks=None):
        return original(q, c(k), c(v), cache, scale=scale, mask=mask, sinks=sinks)

    def unmasked(q, k, v, cache, scale, mask, sinks=None):  # right only where no row is padded
        return original(q, k, v, cache, scale=scale, mask=None, sinks=sinks)

    def contiguous_unmasked(q, k, v, cache, scale, mask, sinks=None):
        return original(q, c(k), c(v), cache, scale=scale, mask=None, sinks=sinks)

    def products(q, k, v, cache, scale, mask, sinks=None):
        return gpu.attention_products(q, k, v, scale, mask)

    return {"as it is": original, "skipped": skipped, "contiguous kv": contiguous, "no mask": unmasked,
            "contiguous kv, no mask": contiguous_unmasked, "products": products,
            "mlx's own": getattr(original, "original", original)}  # under tierlm's GPU wrapper


def prefilled(model, context: int, chunk: int = 2048) -> list:
    """The model's KVCaches after `context` random tokens, a chunk at a time."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(100, 1000, (1, context))
    for start in range(0, context, chunk):
        model(tokens[:, start:start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def step_ms(model, cache: list, rows: int, tokens: int = 1) -> tuple[float, float]:
    """ms of the first model call of `tokens` tokens a row and the median of the
    calls after it, the cache trimmed back after each."""
    import mlx.core as mx

    y = mx.random.randint(100, 1000, (rows, tokens))
    times = []
    for _ in range(STEPS):
        tic = time.perf_counter()
        mx.eval(model(y, cache=cache))
        times.append(time.perf_counter() - tic)
        for c in cache:
            c.trim(tokens)
    return 1000 * times[0], 1000 * statistics.median(times[2:])


def measure(model, module, context: int, batch: int, tokens: list[int] = (1,)) -> list[dict]:
    """Each variant's call of each count of `tokens` a row (1: a decode step;
    more: a hit remainder's pass) over a KVCache and over a BatchKVCache of
    `batch` rows. `first_ms`: the call's first run in the process at that
    shape, after the variants before it (which share its layers' shapes)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    original = module.scaled_dot_product_attention
    single = prefilled(model, context)
    caches = {"KVCache": single, "BatchKVCache": [BatchKVCache.merge([c] * batch) for c in single]}
    mx.eval([c.state for c in caches["BatchKVCache"]])
    rows = []
    try:
        for n, (kind, cache), (name, attention) in itertools.product(tokens, caches.items(),
                                                                    variants(original).items()):
            module.scaled_dot_product_attention = attention
            first, ms = step_ms(model, cache, batch if kind == "BatchKVCache" else 1, n)
            rows.append({"context": context, "tokens": n, "cache": kind, "variant": name, "ms": round(ms, 2),
                         "first_ms": round(first, 2)})
            print(f"context {context} {kind} ({batch if kind == 'BatchKVCache' else 1} rows, {n} tokens each) "
                  f"attention {name}: {ms:.2f} ms a call (first {first:.2f})", flush=True)
    finally:
        module.scaled_dot_product_attention = original
    return rows


def main(argv=None) -> int:
    p = lab_parser("bench_lab.decode_step", __doc__)
    add_model_args(p)
    p.add_argument("--context", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--batch", type=int, default=1, help="rows of the BatchKVCache")
    p.add_argument("--tokens", type=int, nargs="+", default=[1],
                   help="tokens a row each call: 1, a decode step; more, a hit remainder's pass")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tierlm.models.loader import load_model

    model = load_model(model_folder(args, Path(tempfile.mkdtemp(prefix="tierlm-decode-step-"))))[0]
    module = sys.modules[type(model).__module__]  # mlx-lm's module of the model: its attention function
    if not hasattr(module, "scaled_dot_product_attention"):
        p.error(f"{module.__name__} has no scaled_dot_product_attention to vary")
    rows = [r for context in args.context for r in measure(model, module, context, args.batch, args.tokens)]
    write_result(args, p, "decode_step", {"model": args.preset or args.model, "batch": args.batch, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
