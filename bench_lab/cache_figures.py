"""Prefix-cache figures, in process on one model: time to first token for a long
shared prefix (cold, hot-tier hit, SSD hit after a restart) and the decode cost
of the cache's bookkeeping and of the SSD writer.

    python -m bench_lab.cache_figures --model ~/.tierlm/models/SmolLM2-135M-Instruct

Each figure is a median over rounds; the configurations of a round run one after
another in alternating order, so the ratios compare like with like.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_lab import lab_parser
from tierlm.cache.block_hash import model_fingerprint
from tierlm.config import Settings
from tierlm.engine.core import EngineCore
from tierlm.engine.request import Request, SamplingParams
from tierlm.models.loader import load_model


def _tokens(tokenizer, n: int, seed: int) -> list[int]:
    text = " ".join(f"item{seed}-{i} costs {i * 7 % 101} coins;" for i in range(n))
    return tokenizer.encode(text)[:n]


async def _ttft(engine: EngineCore, prompt: list[int]) -> tuple[float, int]:
    tic = time.perf_counter()
    request = Request(engine.new_request_id(), prompt, SamplingParams(max_tokens=1, temperature=0))
    output = await engine.generate(request)
    return time.perf_counter() - tic, output.cached_tokens


def _engine(loaded, path: Path, **config) -> EngineCore:
    settings = Settings(hot_cache_size="8GiB", ssd_cache=False, **config)
    return EngineCore("bench", lambda: loaded, settings, model_fingerprint(path, {}))


def _ssd_at(folder: str) -> dict:
    return dict(ssd_cache=True, ssd_cache_dir=folder, ssd_cache_size="50GiB")


async def ttft_round(loaded, path: Path, prefix_len: int, seed: int) -> dict:
    tokenizer = loaded[1]
    prefix = _tokens(tokenizer, prefix_len, seed)
    suffixes = [tokenizer.encode(f" Question {k}: what does item {k} cost?") for k in range(3)]
    with tempfile.TemporaryDirectory() as ssd:
        engine = _engine(loaded, path, **_ssd_at(ssd))
        await engine.start()
        cold, _ = await _ttft(engine, prefix + suffixes[0])
        hot, hot_cached = await _ttft(engine, prefix + suffixes[1])
        await engine.close()  # flushes the hot tier to SSD
        engine = _engine(loaded, path, **_ssd_at(ssd))
        await engine.start()
        ssd_hit, ssd_cached = await _ttft(engine, prefix + suffixes[2])
        await engine.close()
    return {
        "cold_s": cold,
        "hot_s": hot,
        "ssd_s": ssd_hit,
        "hot_cached": hot_cached,
        "ssd_cached": ssd_cached,
    }


async def _timed(engine: EngineCore, request: Request) -> tuple[float, float, int]:
    """(first token time, finish time, tokens) of one request."""
    first, tokens = None, 0
    async for output in engine.stream_outputs(request):
        tokens = output.completion_tokens
        first = first or time.perf_counter()
    return first, time.perf_counter(), tokens


async def decode_round(loaded, path: Path, mode: str, batch: int, out_len: int, seed: int) -> float:
    """Decode tok/s of `batch` concurrent requests with prompts never seen before,
    counted from the last first token to the last finish (prefill excluded)."""
    config = {"off": dict(prefix_cache=False), "hot": {}}.get(mode)
    ssd = tempfile.TemporaryDirectory()
    if config is None:  # 'ssd': every stored block is also written, while decoding
        config = dict(**_ssd_at(ssd.name), ssd_write_through=True)
    engine = _engine(loaded, path, cache_block_size=64, **config)
    await engine.start()
    prompts = [_tokens(loaded[1], 300, seed * 1000 + i) for i in range(batch)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    timings = await asyncio.gather(
        *[_timed(engine, Request(engine.new_request_id(), p, params)) for p in prompts]
    )
    await engine.close()
    ssd.cleanup()
    start, end = max(t[0] for t in timings), max(t[1] for t in timings)
    return sum(t[2] - 1 for t in timings) / (end - start)


async def main_async(args) -> dict:
    path = Path(args.model).expanduser()
    loaded = load_model(path)
    results: dict = {"model": path.name, "date": time.strftime("%Y-%m-%d"), "ttft": {}, "decode": {}}
    for prefix_len in args.prefix:
        rounds = [await ttft_round(loaded, path, prefix_len, seed) for seed in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        results["ttft"][prefix_len] = med
        print(
            f"prefix {prefix_len}: cold {med['cold_s']:.2f}s, hot hit {med['hot_s']:.3f}s "
            f"({med['cold_s'] / med['hot_s']:.1f}x), SSD hit after restart {med['ssd_s']:.3f}s "
            f"({med['cold_s'] / med['ssd_s']:.1f}x); cached tokens hot {med['hot_cached']:.0f}, "
            f"SSD {med['ssd_cached']:.0f}",
            flush=True,
        )
    if args.skip_decode:
        return results
    modes = ["off", "hot", "ssd"]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else reversed(modes):
            runs[mode].append(await decode_round(loaded, path, mode, args.batch, args.output_len, r))
    med = {m: statistics.median(v) for m, v in runs.items()}
    results["decode"] = {"batch": args.batch, "output_len": args.output_len, "tok_s": med}
    print(
        f"decode, {args.batch} requests x {args.output_len} tokens, 0% hits: cache off {med['off']:.1f} tok/s, "
        f"cache on {med['hot']:.1f} ({med['hot'] / med['off']:.3f}x), cache on + SSD write-through "
        f"{med['ssd']:.1f} ({med['ssd'] / med['off']:.3f}x)",
        flush=True,
    )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = lab_parser("bench_lab.cache_figures", __doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prefix", type=int, nargs="*", default=[2048, 8000], help="prefix lengths; none: skip TTFT")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
