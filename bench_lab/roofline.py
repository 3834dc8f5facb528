"""The decode roofline: weight bytes read per decode step over the measured
device copy bandwidth. (Random-weight model folders with real shapes, for
machines without weights: tierlm.models.random_model.)"""

from __future__ import annotations

import time

from bench_lab import lab_parser, write_result


def copy_bandwidth(gib: float = 2.0, iters: int = 10) -> float:
    """Bytes read + written per second by an elementwise copy of `gib` GiB."""
    import mlx.core as mx

    n = int(gib * 2**30) // 2
    x = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(x)
    for _ in range(3):
        mx.eval(x + 1)
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(iters):
        y = x + 1
        mx.eval(y)
    mx.synchronize()
    elapsed = time.perf_counter() - tic
    return 2 * x.nbytes * iters / elapsed


def roofline(model_path: str, batches: list[int], context: int) -> dict:
    """The decode step reads every weight once, plus each sequence's KV; at the
    copy bandwidth that bounds the step time and so the tokens/s of a batch."""
    import mlx.core as mx

    from tierlm.engine.memory_guard import profile_model
    from tierlm.models.loader import load_model

    model, _ = load_model(model_path)
    profile = profile_model(model)
    bw = copy_bandwidth()
    rows = []
    for b in batches:
        step_bytes = profile.weight_bytes + b * context * profile.kv_bytes_per_token
        step_s = step_bytes / bw
        rows.append(
            {
                "batch": b,
                "step_bytes": step_bytes,
                "min_step_s": step_s,
                "max_tok_s": b / step_s,
                "max_tok_s_weights_only": b * bw / profile.weight_bytes,
            }
        )
    return {
        "model": str(model_path),
        "device": str(mx.default_device()),
        "copy_bytes_s": bw,
        "weight_bytes": profile.weight_bytes,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "context": context,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = lab_parser("bench_lab.roofline", __doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence for the KV term")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tierlm.bench import runs

    result = roofline(args.model or runs.default_tokenizer(args), runs.concurrencies(args.batch), args.context)
    print(result)
    write_result(args, p, "roofline", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
