"""Speculative decoding in the batch, in process: mlx-lm's BatchGenerator
against tierlm's SpeculativeGenerator on the same model and prompts, decode
tokens a second once every sequence is decoding, and whether both wrote the
same tokens. `python -m bench_lab.speculation_batch --model FOLDER`.

The HTTP benchmark users run is `tierlm bench speculation`; this one needs
nothing but MLX and mlx-lm (a GPU machine with neither a server's packages
nor a network), and shows the batch alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from bench_lab import lab_parser, write_result
from tierlm.engine import warmup
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.loadgen.edits import WORKLOADS


def load(folder: Path):
    """The model as the server loads it, with what tierlm's backend adds (its CPU
    kernels; on a CUDA GPU, attention of a few queries as products)."""
    from tierlm.models.loader import load_model

    return load_model(folder)


def workload_prompts(tokenizer, workload) -> list[list[int]]:
    """Each session's first request as the chat template renders it, tools included."""
    return [tokenizer.apply_chat_template(s[0].messages, tools=s[0].extra.get("tools"), add_generation_prompt=True)
            for s in workload.sessions]


def insert(generator, prompts: list[list[int]], max_tokens: int, drafts: int) -> list[int]:
    """The prompts into `generator`, each drafting up to `drafts` tokens a step
    where it is a SpeculativeGenerator; their uids."""
    uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    if isinstance(generator, SpeculativeGenerator):
        for uid in uids:
            generator.speculation.limits[uid] = drafts
    return uids


def running(generator) -> bool:
    """A sequence is still waiting, prefilling or decoding."""
    return bool(generator._unprocessed_sequences or len(generator._prompt_batch) or len(generator._generation_batch))


def decode(generator, prompts: list[list[int]], max_tokens: int, eos: list[int], drafts: int) -> tuple:
    """Tokens of each sequence, and decode tokens a second while all decode."""
    uids = insert(generator, prompts, max_tokens, drafts)
    out, counted, start = {uid: [] for uid in uids}, 0, None
    while running(generator):
        responses = generator.next()[1]
        if start is None and len(generator._generation_batch) == len(prompts):
            start, counted = time.perf_counter(), 0
        for r in responses:
            out[r.uid].append(r.token)
        counted += len(responses)
    seconds = time.perf_counter() - start if start else float("nan")
    return [out[u] for u in uids], counted / seconds


def main() -> None:
    p = lab_parser("bench_lab.speculation_batch", __doc__)
    p.add_argument("--model", required=True, help="a model folder")
    p.add_argument("--workloads", default="code-edit,prose")
    p.add_argument("--batch", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--drafts", type=int, default=7, help="draft tokens a step at most")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first steps too (a GPU compiles kernels in them)")
    args = p.parse_args()
    model, tokenizer = load(Path(args.model))
    eos = sorted(tokenizer.eos_token_ids)
    if args.warmup:  # as the server warms a GPU: kernels compiled before anything is timed
        sizes = {len(WORKLOADS[name](batch, 1).sessions)  # a workload has so many prompts
                 for name in args.workloads.split(",") for batch in map(int, args.batch.split(","))}
        for size in sorted(sizes):
            warmup.run_shape(model, mx.default_stream(mx.default_device()), size, 16, 2048, args.drafts)
    rows = []
    for name in args.workloads.split(","):
        for batch in map(int, args.batch.split(",")):
            workload = WORKLOADS[name](batch, args.max_tokens)
            prompts = workload_prompts(tokenizer, workload)
            for rnd in range(args.rounds):
                row = {"workload": name, "batch": batch, "round": rnd}
                for kind in (("plain", "speculative") if rnd % 2 == 0 else ("speculative", "plain")):
                    cls = SpeculativeGenerator if kind == "speculative" else BatchGenerator
                    gen = cls(model, stop_tokens=[[t] for t in eos], completion_batch_size=batch,
                              prefill_batch_size=batch)
                    tokens, rate = decode(gen, prompts, args.max_tokens, eos, args.drafts)
                    row[kind] = {"decode_tok_s": rate, "tokens": tokens}
                    if kind == "speculative":
                        row["counters"] = vars(gen.speculation.counters)
                        switch = gen.speculation.switch
                        row["switch"] = {"rates": {f"{'drafting' if d else 'plain'}@{r}": v
                                                   for (d, r), v in switch.rates.items()},
                                         "windows": [list(w) for w in switch.recent]}
                row["ratio"] = row["speculative"]["decode_tok_s"] / row["plain"]["decode_tok_s"]
                row["same_tokens"] = row["speculative"]["tokens"] == row["plain"]["tokens"]
                rows.append(row)
                print(f"{name} batch {batch}: plain {row['plain']['decode_tok_s']:.1f}, speculative "
                      f"{row['speculative']['decode_tok_s']:.1f} tok/s ({row['ratio']:.2f}x), same tokens "
                      f"{row['same_tokens']}, {row['counters']}, switch {row['switch']['rates']}", flush=True)
    for row in rows:  # the tokens were for the comparison
        row["plain"].pop("tokens"), row["speculative"].pop("tokens")
    write_result(args, p, "speculation-batch", {"device": str(mx.default_device()), "model": args.model,
                                                "rows": rows})


if __name__ == "__main__":
    main()
