"""A random-weight model folder with real shapes (tierlm.models.random_model),
for machines without weights (scripts/gpu_bench.sh's GPU runs)."""

from __future__ import annotations

from pathlib import Path

from bench_lab import lab_parser


def main(argv: list[str] | None = None) -> int:
    p = lab_parser("bench_lab.make_model", __doc__)
    p.add_argument("preset", help="llama-1b | llama-8b | tiny, or a tiny llama | gemma3_text | qwen3_next")
    p.add_argument("out")
    p.add_argument("--tokenizer", default=None, help="model folder whose tokenizer files to copy")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    from tierlm.bench import runs
    from tierlm.models.random_model import make_random_model

    tokenizer = args.tokenizer or runs.default_tokenizer(args)
    print(make_random_model(args.preset, Path(args.out), Path(tokenizer), args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
