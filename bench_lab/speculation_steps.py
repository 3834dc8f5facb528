"""One step of the speculative batch against one of mlx-lm's BatchGenerator,
in process: milliseconds a step (medians over repeats taken in turn) of

- `bg`: mlx-lm's BatchGenerator, plain steps;
- `aligned`: the speculative batch's plain steps, its rows ending together (no
  draft verified yet);
- `ragged`: its plain steps with rows ending at different places (as after
  verifications: here each row gives back 0-3 tokens first);
- `realigned`: the same, each plain step first moving the rows to one end
  (`align_plain`, where the tree has it);
- `verify`: verifications at the widest width (drafts of the last token
  repeated), as the tokens they feed a row.

`python -m bench_lab.speculation_steps --model FOLDER`. Where the speculative
batch's plain steps lost to BatchGenerator's on the H200 (#34), this says which
part of the step it is. The tokens written do not matter here.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from bench_lab import lab_parser, write_result
from bench_lab.speculation_batch import insert, workload_prompts
from tierlm.engine import warmup
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.loadgen.edits import WORKLOADS

KINDS = ("bg", "aligned", "ragged", "realigned", "verify")


def generator(model, kind: str, prompts: list[list[int]], drafts: int):
    """A generator of `kind` with every prompt decoding, its first steps taken."""
    batch = len(prompts)
    options = dict(completion_batch_size=batch, prefill_batch_size=batch)
    if kind == "bg":
        gen = BatchGenerator(model, **options)
    else:
        gen = SpeculativeGenerator(model, lookup=warmup.RepeatDrafts, **options)
    insert(gen, prompts, 100_000, drafts if kind == "verify" else 0)
    if kind == "verify":
        gen.speculation.draft_always()
    while len(gen._generation_batch) < batch:
        gen.next()
    for _ in range(3):
        gen.next()
    if kind in ("ragged", "realigned"):
        spec = gen.speculation
        for c in spec.prompt_cache:
            c.drop([i % 4 for i in range(batch)])
        if kind == "realigned":
            if not hasattr(spec, "align_plain"):  # a tree before it
                return None
            spec.align_plain = True
    return gen


def time_steps(gen, steps: int) -> float:
    """Milliseconds a step over `steps` steps (the first one after a pause not counted)."""
    gen.next()
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(steps):
        gen.next()
    mx.synchronize()
    return (time.perf_counter() - tic) / steps * 1e3


def uploads_ms(count: int, repeats: int = 50) -> dict:
    """`count` small arrays made from lists and added on the device, against
    `count` additions of arrays already there: what an upload a layer costs."""
    there = [mx.array([i] * 8) for i in range(count)]
    mx.eval(there)
    out = {}
    for name, make in (("uploaded", lambda i: mx.array([i] * 8)), ("on_device", lambda i: there[i])):
        times = []
        for _ in range(repeats):
            tic = time.perf_counter()
            x = mx.zeros((8,), dtype=mx.int32)
            for i in range(count):
                x = x + make(i)
            mx.eval(x)
            times.append((time.perf_counter() - tic) * 1e3)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    p = lab_parser("bench_lab.speculation_steps", __doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="8")
    p.add_argument("--workload", default="prose")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from tierlm.models.loader import load_model

    model, tokenizer = load_model(Path(args.model))
    kinds = args.kinds.split(",")
    rows = []
    for batch in map(int, args.batch.split(",")):
        warmup.run_shape(model, mx.default_stream(mx.default_device()), batch, 16, 2048, args.drafts)
        prompts = workload_prompts(tokenizer, WORKLOADS[args.workload](batch, 1))
        times = {k: [] for k in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                gen = generator(model, kind, prompts, args.drafts)
                if gen is not None:
                    times[kind].append(time_steps(gen, args.steps))
                    gen.close()
        row = {"batch": len(prompts), "ms_a_step": {k: statistics.median(v) for k, v in times.items() if v},
               "all": times}
        rows.append(row)
        print(f"batch {len(prompts)}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ms_a_step"].items())
              + " ms a step", flush=True)
    uploads = uploads_ms(60)
    print(f"60 uploads added: {uploads['uploaded']:.2f} ms, "
          f"60 device arrays added: {uploads['on_device']:.2f} ms")
    write_result(args, p, "speculation-steps",
                 {"device": str(mx.default_device()), "model": args.model, "rows": rows, "uploads_ms": uploads})


if __name__ == "__main__":
    main()
