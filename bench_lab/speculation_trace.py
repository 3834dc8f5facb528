"""Every step of a run, and the kernels a GPU compiled in it: mlx-lm's
BatchGenerator against the speculative batch, in process, on one workload.

Each `next()` of each generator is timed with the rows it ran and whether it
verified drafts; after each slow step (and every 16th) the folder MLX's CUDA
backend keeps compiled kernels in (`MLX_PTX_CACHE_DIR`, a fresh one unless
set) is listed, and the kernels new since the last look are printed beside
the step that compiled them. Rounds alternate which generator goes first.

`python -m bench_lab.speculation_trace --model FOLDER --batch 4`. Kept for
the compile on an H100 that this found (#34): a gather of 3.7 s at the first
plain step after a verification, which warm-up did not run then. On a CPU
nothing is compiled per shape, and only the step times mean anything.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

SLOW_S = 0.2  # a step this long is listed with what it compiled


def kernel_files(folder: str) -> set[str]:
    return {os.path.join(root, f) for root, _, files in os.walk(folder) for f in files}


def trace(gen, prompts: list[list[int]], max_tokens: int, drafts: int, folder: str) -> list[dict]:
    """Each step's rows, tokens, milliseconds, whether it verified drafts, and
    the kernel files that appeared while it ran (where looked)."""
    from bench_lab.speculation_batch import insert, running
    from tierlm.engine.speculative_batch import SpeculativeGenerator

    speculative = isinstance(gen, SpeculativeGenerator)
    insert(gen, prompts, max_tokens, drafts)
    steps, seen = [], kernel_files(folder)
    while running(gen):
        rows = len(gen._generation_batch)
        verified = gen.speculation.counters.speculative_steps if speculative else 0
        tic = time.perf_counter()
        tokens = len(gen.next()[1])
        seconds = time.perf_counter() - tic
        step = {"rows": rows, "tokens": tokens, "ms": round(seconds * 1e3, 2),
                "verified": speculative and gen.speculation.counters.speculative_steps > verified}
        if seconds > SLOW_S or len(steps) % 16 == 0:
            now = kernel_files(folder)
            step["compiled"] = sorted(os.path.basename(f) for f in now - seen)
            seen = now
        steps.append(step)
    return steps


def summary(steps: list[dict]) -> str:
    by: dict[tuple[int, bool], list[float]] = {}
    for s in steps:
        entry = by.setdefault((s["rows"], s["verified"]), [0, 0.0])
        entry[0] += s["tokens"]
        entry[1] += s["ms"]
    parts = [f"{rows} rows{' verifying' if v else ''}: {n} tokens in {ms:.0f} ms"
             for (rows, v), (n, ms) in sorted(by.items())]
    slow = [f"step {i} {s['ms']:.0f} ms {s.get('compiled', [])}"
            for i, s in enumerate(steps, 1) if s["ms"] > SLOW_S * 1e3]
    return "; ".join(parts) + ("\n  slow: " + "; ".join(slow) if slow else "")


def warm_jobs(warm: str) -> list[tuple[int, int]]:
    """(batch, prompt length) of each warm job: short prompts at each size given, or
    `server:N` the jobs a server at --max-concurrent-requests N runs (its long
    prompts too, without the long-context one and its requests job, which needs
    an engine)."""
    from tierlm.engine import warmup

    if warm.startswith("server:"):
        return [(job.batch, job.prompt_len) for job in warmup.warm_shapes(int(warm.split(":")[1]), compiles=True)
                if not job.requests]
    return [(int(size), warmup.SHORT_PROMPT) for size in warm.split(",")]


def main() -> None:
    from bench_lab import lab_parser, write_result
    from bench_lab.speculation_batch import workload_prompts

    parser = lab_parser("bench_lab.speculation_trace", __doc__)
    parser.add_argument("--model", required=True, help="a model folder")
    parser.add_argument("--workload", default="prose", help="code-edit, agent-edit or prose")
    parser.add_argument("--batch", type=int, default=4, help="sequences at once (the workload's prompts)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--drafts", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", default=None, help="comma list of batch sizes to warm first (default: --batch), "
                                                     "or server:N, a server's warm-up at N requests at most")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = os.environ.setdefault("MLX_PTX_CACHE_DIR", tempfile.mkdtemp(prefix="kernels-"))  # before MLX compiles

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from tierlm.engine import warmup
    from tierlm.engine.speculative_batch import SpeculativeGenerator
    from tierlm.loadgen.edits import WORKLOADS
    from tierlm.models.loader import load_model

    model, tokenizer = load_model(Path(args.model))
    eos = sorted(tokenizer.eos_token_ids)
    tic = time.perf_counter()
    for size, prompt_len in warm_jobs(args.warm or str(args.batch)):
        warmup.run_shape(model, mx.default_stream(mx.default_device()), size, prompt_len, 2048, args.drafts)
    print(f"warm-up {time.perf_counter() - tic:.1f} s; kernels in {folder}", flush=True)
    prompts = workload_prompts(tokenizer, WORKLOADS[args.workload](args.batch, args.max_tokens))
    runs = []
    for rnd in range(args.rounds):
        for kind in (("plain", "speculative") if rnd % 2 == 0 else ("speculative", "plain")):
            cls = SpeculativeGenerator if kind == "speculative" else BatchGenerator
            gen = cls(model, stop_tokens=[[t] for t in eos], completion_batch_size=args.batch,
                      prefill_batch_size=args.batch)
            steps = trace(gen, prompts, args.max_tokens, args.drafts, folder)
            gen.close()
            print(f"round {rnd + 1} {kind}: {summary(steps)}", flush=True)
            runs.append({"round": rnd, "kind": kind, "steps": steps})
    write_result(args, parser, "speculation-trace", {"model": args.model, "workload": args.workload,
                                                     "batch": args.batch, "runs": runs})


if __name__ == "__main__":
    main()
