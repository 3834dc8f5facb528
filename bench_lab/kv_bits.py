"""Decode speed with the running batch's KV at 16 bits and at 8 (or 4):
`batch_kv_bits`, in process, side by side in one run.

Per context length, one long-lived engine per bit width (as a server keeps),
each given the same `--batch` greedy requests of random prompts of that many
tokens, `--tokens` new tokens each; the engines take turns, round by round.
Both decode without drafts by default (`--speculation off`): drafts accepted
measure the prompts as much as the KV (on an x86 CPU both draft with `auto`).
The figure is the steady decode rate while the whole batch runs
(loadgen.metrics.steady_decode_rate), medians over rounds; the ratio is each
round's quantized over its 16-bit run. No prefix cache: every run prefills.

    python -m bench_lab.kv_bits --preset llama-1b --tokenizer TOKENIZER_DIR --batch 32 --context 2048 8192
    python -m bench_lab.kv_bits --batch 8 --context 1024          # the default model, e.g. on a CPU
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench_lab import add_model_args, lab_parser, model_folder, write_result


def title(result: dict) -> str:
    model = f"random weights of {result['preset']}'s shapes" if result.get("preset") else Path(result["model"]).name
    return f"Decode with the batch's KV at {result['bits']} bits against 16, batch {result['batch']}: {model}"


def table(result: dict) -> str:
    rows = ["| context | 16-bit tok/s | quantized tok/s | ratio (median of rounds) |", "|---|---|---|---|"]
    for c in result["contexts"]:
        rows.append(f"| {c['context']} | {c['median_tok_s']['16']:.0f} | {c['median_tok_s'][str(result['bits'])]:.0f}"
                    f" | {c['ratio']:.2f} |")
    return "\n".join(rows)


def measure(model, tokenizer, batch: int, context: int, tokens: int, bits: int, rounds: int, vocab: int,
            speculation: str = "off") -> dict:
    from tierlm.bench.engine_overhead import EngineRunner, random_prompts

    prompts = random_prompts(vocab, batch, context, seed=context)
    runners = {b: EngineRunner(model, tokenizer, batch, 2048, batch_kv_bits=None if b == 16 else b,  # 16: as computed
                               prefix_cache=False, speculation=speculation) for b in (16, bits)}
    try:
        assert runners[bits].engine.kv_bits == bits, "the model's KV cannot be quantized (see the log)"
        for runner in runners.values():  # compiles, and the first allocation of this size
            runner.run(prompts, 4)
        rates: dict[str, list[float]] = {"16": [], str(bits): []}
        for rnd in range(rounds):
            for b in ((16, bits) if rnd % 2 == 0 else (bits, 16)):
                rates[str(b)].append(runners[b].run(prompts, tokens).decode_tok_s)
                print(f"context {context} round {rnd} {b}-bit: {rates[str(b)][-1]:.0f} tok/s", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
    ratios = [q / f for q, f in zip(rates[str(bits)], rates["16"])]
    return {"context": context, "tok_s": rates, "median_tok_s": {k: statistics.median(v) for k, v in rates.items()},
            "ratios": ratios, "ratio": statistics.median(ratios)}


def main(argv=None) -> int:
    p = lab_parser("bench_lab.kv_bits", __doc__)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, nargs="+", default=[2048])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--bits", type=int, default=8, choices=(8, 4))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speculation", default="off",
                   help="both engines' setting (`auto` drafts on x86 CPUs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import mlx.core as mx

    from tierlm.models.loader import load_model, usable_vocab_size

    path = model_folder(args, Path(tempfile.mkdtemp(prefix="tierlm-kv-bits-")))
    model, tokenizer = load_model(path)
    vocab = usable_vocab_size(tokenizer, model)
    result = {"model": str(path), "preset": args.preset, "batch": args.batch, "bits": args.bits,
              "tokens": args.tokens, "rounds": args.rounds, "device": str(mx.default_device()),
              "speculation": args.speculation,
              "contexts": [measure(model, tokenizer, args.batch, c, args.tokens, args.bits, args.rounds, vocab,
                                   args.speculation) for c in args.context]}
    print(title(result))
    print(table(result))
    write_result(args, p, "kv_bits", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
