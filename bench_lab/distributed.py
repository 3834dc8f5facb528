"""One model over several ranks against one, in process: decode tokens a second at
each batch size and the time to first token of a long prompt (cold, then a hit
of the prefix cache), on random weights of a preset's shapes.

Run it once alone (one rank), then under MLX's launcher with the same arguments
(every rank runs it; rank 0 drives the requests and prints, the others follow):

    python -m bench_lab.distributed --preset llama-8b --tokenizer TOKENIZER_DIR --json one.json
    mlx.launch -n 2 --backend nccl -- python -m bench_lab.distributed --preset llama-8b \\
        --tokenizer TOKENIZER_DIR --json two.json

Decode: B requests of --input random tokens at once, --output tokens each
(ignoring end of sequence); tokens a second = B / the median time per output
token after the first. Each batch size and the long prompt run once untimed
first (kernels compile per shape on a GPU).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_lab import lab_parser, write_result


def load(folder: Path, dtype: str, lockstep):
    """The random model of `folder`'s config (this rank's shard of it), set up for
    the device as tierlm loads any model, and its tokenizer."""
    import mlx.core as mx

    from tierlm import backends
    from tierlm.config import total_memory
    from tierlm.models.loader import load_tokenizer, shard_model
    from tierlm.models.random_model import build_model, random_weights

    model = build_model(json.loads((folder / "config.json").read_text()))
    model.load_weights(list(random_weights(model, dtype).items()))
    if lockstep is not None:
        shard_model(model, lockstep.group)
    backends.prepare(model, memory_bytes=total_memory())
    mx.eval(model.parameters())
    return model, load_tokenizer(folder)


async def timed(engine, prompt: list[int], max_tokens: int) -> tuple[float, float, float, int]:
    """(start, first token, end, tokens) of one request."""
    from tierlm.engine.request import Request, SamplingParams

    request = Request(engine.new_request_id(), prompt,
                      SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    start, first, tokens = time.perf_counter(), None, 0
    async for output in engine.stream_outputs(request):
        if output is None:
            continue
        if output.error:
            raise RuntimeError(output.error)
        if output.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(output.token_ids)
    return start, first, time.perf_counter(), tokens


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def decode_round(engine, rng: random.Random, batch: int, n_in: int, n_out: int) -> float:
    """Tokens a second of `batch` sequences decoding together (batch / median TPOT)."""
    runs = await asyncio.gather(*(timed(engine, prompt(rng, n_in), n_out) for _ in range(batch)))
    tpots = [(end - first) / (tokens - 1) for _, first, end, tokens in runs if tokens > 1]
    return batch / statistics.median(tpots)


async def lead(engine, args) -> dict:
    rng = random.Random(0)
    for batch in args.batch:  # untimed: every shape once
        await decode_round(engine, rng, batch, args.input, 8)
    await timed(engine, prompt(rng, args.prompt_tokens), 1)
    result: dict = {"decode_tok_s": {}, "ttft_s": {}}
    for batch in args.batch:
        rates = [await decode_round(engine, rng, batch, args.input, args.output) for _ in range(args.rounds)]
        result["decode_tok_s"][str(batch)] = statistics.median(rates)
        print(f"batch {batch}: {statistics.median(rates):.1f} decode tok/s ({', '.join(f'{r:.1f}' for r in rates)})",
              flush=True)
    cold, hot = [], []
    for _ in range(args.rounds):
        long = prompt(rng, args.prompt_tokens)
        start, first, _, _ = await timed(engine, long, 1)
        cold.append(first - start)
        start, first, _, _ = await timed(engine, long[:-8] + prompt(rng, 8), 1)  # the same prefix, a new end
        hot.append(first - start)
    result["ttft_s"] = {"cold": statistics.median(cold), "prefix_hit": statistics.median(hot)}
    print(f"{args.prompt_tokens}-token prompt: TTFT cold {result['ttft_s']['cold']:.3f} s, "
          f"prefix hit {result['ttft_s']['prefix_hit']:.3f} s", flush=True)
    return result


async def run(args, lockstep) -> dict | None:
    from tierlm.cache.block_hash import model_fingerprint
    from tierlm.config import Settings
    from tierlm.distributed.follower import follow_steps
    from tierlm.engine.core import EngineCore
    from tierlm.engine.lockstep import fingerprint_key
    from tierlm.models.random_model import make_random_model

    folder = make_random_model(args.preset, Path(tempfile.mkdtemp(prefix="tierlm-dist-")), Path(args.tokenizer),
                               args.dtype, write_weights=False)
    settings = Settings(hot_cache_size="16GiB", ssd_cache=False, max_concurrent_requests=max(args.batch))
    engine = EngineCore(args.preset, lambda: load(folder, args.dtype, lockstep), settings,
                        model_fingerprint(folder, fingerprint_key(lockstep)), lockstep=lockstep)
    await engine.start()
    try:
        if lockstep is not None and not lockstep.leader:
            await engine.on_worker(follow_steps, engine.scheduler, lockstep)
            return None
        return await lead(engine, args)
    finally:
        await engine.close()


def main(argv=None) -> int:
    p = lab_parser("bench_lab.distributed", __doc__)
    p.add_argument("--preset", default="llama-8b")
    p.add_argument("--tokenizer", required=True, help="a model folder whose tokenizer the random model takes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--input", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import mlx.core as mx

    from tierlm.distributed import ranks

    lockstep = ranks.join()
    result = asyncio.run(run(args, lockstep))
    if result is not None:
        result.update(ranks=lockstep.size if lockstep else 1, device=str(mx.default_device()), preset=args.preset)
        write_result(args, p, "distributed", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
