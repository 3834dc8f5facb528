"""Greedy answers with the running batch's KV at 8 and 4 bits (`--bits`)
against 16, on a fixed prompt set, in process: how many answers stay the same, where the others
leave, and how far the chosen tokens' log-probabilities move while they agree.

Every prompt is asked alone (batch 1) and all of them together (one batch), so
that rows of different lengths share the quantized batch; each answer ends at
the model's end of turn or at --max-tokens. "16" is the KV as computed (float32
on the CPU, bfloat16 on a GPU); `--bits 16` on a CPU measures the batch's KV
kept at float16 (engine.half_kv) against it.

`--tiers`: the cache tiers' bits instead (`cache_kv_bits`), the batch's KV as
computed. Every prompt comes after one long system message (a ~1,500-token
source file, as an agent's system prompt and context), stored by a first
request; each prompt then takes it from the hot tier's blocks (64 tokens a
block), alone.

    python -m bench_lab.kv_quality                      # the default model
    python -m bench_lab.kv_quality --model ~/.tierlm/models/qwen2.5-coder-0.5b-instruct [--tiers]
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench_lab import lab_parser, write_result

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of Japan? Answer in one sentence.",
    "Explain what a hash table is to a new programmer.",
    "List five prime numbers greater than 100.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a haiku about the sea.",
    "What does HTTP status code 404 mean?",
    "Give three tips for writing readable code.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a SQL query that counts the rows of a table named users.",
    "Why is the sky blue? Answer briefly.",
    "Convert 72 degrees Fahrenheit to Celsius and show the steps.",
    "Write a bash command that finds every .py file under the current folder.",
    "What is the difference between a list and a tuple in Python?",
    "Name the planets of the solar system in order.",
    "Write a short email asking a colleague to review a pull request.",
]


def title(result: dict) -> str:
    where = "a hit's blocks in the tiers after a shared system message" if result.get("tiers") else "the batch's KV"
    kept = " and ".join("16 (float16)" if b == "16" else b for b in result["bits"])
    return f"Greedy answers with {where} at {kept} bits against 16: {Path(result['model']).name}"


def system_message() -> str:
    """The shared system message of `--tiers`: a standard-library source file."""
    import inspect
    import json.decoder

    return "You are a coding assistant. The user's project has this file:\n\n" + inspect.getsource(json.decoder)[:6000]


def table(result: dict) -> str:
    rows = ["| KV bits | answers equal to 16-bit (alone / batched) | median first difference (tokens) "
            "| largest log-prob move while equal |", "|---|---|---|---|"]
    for bits, r in result["bits"].items():
        batched = "-" if r["equal_batched"] is None else f"{r['equal_batched']}/{r['prompts']}"
        rows.append(f"| {bits} | {r['equal_alone']}/{r['prompts']} / {batched} "
                    f"| {r['median_first_difference']} | {r['max_logprob_move']:.3f} |")
    broken = {bits: r["degenerate"] for bits, r in result["bits"].items() if r.get("degenerate")}
    if broken or result.get("degenerate_16_bit"):
        rows.append(f"\n**Degenerate answers (one token repeated):** {result.get('degenerate_16_bit', 0)} at 16 bits, "
                    + ", ".join(f"{n} at {bits}" for bits, n in broken.items()) + ": the attention is broken, "
                    "not merely rounded.")
    if result.get("tiers"):
        rows.append(f"\nEach prompt took {result['cached_tokens']} tokens or more from the tiers (asked alone only).")
    return "\n".join(rows)


async def _answers(loaded, bits: int | None, max_tokens: int, tiers: bool = False) -> tuple[list, list]:
    """Each prompt's answer alone and all in one batch, with KV at `bits` (None: as computed)."""
    from tierlm.config import Settings
    from tierlm.engine.core import EngineCore
    from tierlm.engine.request import Request, SamplingParams

    settings = Settings(ssd_cache=False, cache_kv_bits=bits or 16, cache_block_size=64) if tiers else \
        Settings(ssd_cache=False, prefix_cache=False, batch_kv_bits=bits)
    engine = EngineCore(f"kv-quality-{bits}", lambda: loaded, settings)
    await engine.start()
    tokenizer = loaded[1]
    system = [{"role": "system", "content": system_message()}] if tiers else []

    def request(text: str, tokens: int = max_tokens) -> Request:
        ids = tokenizer.apply_chat_template(system + [{"role": "user", "content": text}], add_generation_prompt=True)
        return Request(engine.new_request_id(), ids, SamplingParams(max_tokens=tokens, temperature=0, logprobs=0))

    try:
        if tiers:  # the system message's blocks stored, then each prompt a hit on them
            await engine.generate(request("Hello.", 1))
            return [await engine.generate(request(p)) for p in PROMPTS], []
        alone = [await engine.generate(request(p)) for p in PROMPTS]
        batched = await asyncio.gather(*(engine.generate(request(p)) for p in PROMPTS))
    finally:
        await engine.close()
    return alone, list(batched)


def degenerate(outputs: list) -> int:
    """Answers of one token repeated (or none at all): what a broken attention
    gives (the GPU's 8-bit batch answered end-of-text tokens until 971b91f),
    counted so that such a run cannot pass for a quality figure."""
    return sum(len(set(o.token_ids)) <= 1 and len(o.token_ids) != 1 for o in outputs)


def compare(quantized: list, full: list) -> dict:
    equal, firsts, moves = 0, [], []
    for q, f in zip(quantized, full):
        same = next((i for i, (a, b) in enumerate(zip(q.token_ids, f.token_ids)) if a != b), None)
        if same is None and len(q.token_ids) != len(f.token_ids):  # one ended where the other went on
            same = min(len(q.token_ids), len(f.token_ids))
        if same is None:
            equal += 1
        else:
            firsts.append(same)
        agree = len(q.token_ids) if same is None else same
        scored = min(agree, len(q.logprobs or ()), len(f.logprobs or ()))  # an end of turn has none
        moves += [abs(q.logprobs[i][1] - f.logprobs[i][1]) for i in range(scored)]
    return {"equal": equal, "first_differences": firsts, "max_logprob_move": max(moves, default=0.0),
            "degenerate": degenerate(quantized)}


def main(argv=None) -> int:
    p = lab_parser("bench_lab.kv_quality", __doc__)
    p.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tiers", action="store_true", help="the cache tiers' bits, on hits of a shared system message")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=(16, 8, 4),
                   help="the KV widths compared with the KV as computed (16: float16, a CPU's batch only)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import statistics

    from tierlm.bench.servers import default_model_folder
    from tierlm.models.loader import load_model

    path = Path(args.model).expanduser() if args.model else default_model_folder()
    loaded = load_model(path)
    if args.tiers and 16 in args.bits:
        p.error("--bits 16 is the batch's (the tiers keep 16-bit KV as computed)")
    full = asyncio.run(_answers(loaded, None, args.max_tokens, args.tiers))
    result = {"model": str(path), "max_tokens": args.max_tokens, "prompts": PROMPTS, "tiers": args.tiers,
              "bits": {}}
    for bits in args.bits:
        alone, batched = asyncio.run(_answers(loaded, bits, args.max_tokens, args.tiers))
        a, b = compare(alone, full[0]), compare(batched, full[1])
        firsts = a["first_differences"] + b["first_differences"]
        result["cached_tokens"] = min(o.cached_tokens for o in alone)
        result["bits"][str(bits)] = {
            "prompts": len(PROMPTS), "equal_alone": a["equal"], "equal_batched": None if args.tiers else b["equal"],
            "first_differences": firsts, "median_first_difference": statistics.median(firsts) if firsts else None,
            "max_logprob_move": max(a["max_logprob_move"], b["max_logprob_move"]),
            "degenerate": a["degenerate"] + b["degenerate"]}
    result["degenerate_16_bit"] = degenerate(full[0]) + degenerate(full[1])
    print(title(result))
    print(table(result))
    write_result(args, p, "kv_quality", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
