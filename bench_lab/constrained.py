"""Constrained decoding's cost, in process: a batch where one request carries a
JSON-schema grammar (llguidance) against the same batch with none, and one
constrained request alone against one free request alone.

Every request gets the same chat prompt and decodes greedily; the free ones
ignore EOS, and the schema's language is longer than `max_tokens` (an array of
at least 40 non-empty strings), so the constrained request runs to the same
length as the others and both arms do the same model work. What differs is the
mask: llguidance computing it on the engine's worker thread while the model's
step runs, the sync on the token it needs, and mlx-lm's per-row logits path.

Arms alternate (free, constrained, constrained, free, ...) on one engine per
batch size; the ratio is constrained ÷ free decode throughput, from the median
time of a full-batch decode step (step_timing), and from the tokens that arrived
while the whole batch decoded (metrics.steady_decode_rate) as a cross-check.

MLX, mlx-lm and the engine are imported inside the functions that run models.
"""

from __future__ import annotations

from pathlib import Path

from bench_lab import lab_parser, write_result
from tierlm.bench.engine_overhead import EngineRunner, OverheadResult
from tierlm.bench.report import cpu_flags
from tierlm.loadgen.metrics import median

SCHEMA = {
    "type": "object",
    "properties": {
        "fruits": {
            "type": "array",
            "items": {"type": "string", "minLength": 3, "maxLength": 24},
            "minItems": 40,
            "maxItems": 60,
        }
    },
    "required": ["fruits"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": 'List fifty fruits as JSON: {"fruits": [...]}.'}]
ARMS = ("free", "constrained")


class ConstrainedRunner(EngineRunner):
    """EngineRunner whose runs may make some of their requests constrained."""

    def __init__(self, model, tokenizer, batch: int, prefill_step_size: int, make_constraint):
        """`make_constraint()`: a fresh TokenConstraint for one request."""
        super().__init__(model, tokenizer, batch, prefill_step_size)
        self.make_constraint = make_constraint
        self.constrained = 0  # how many of the next run's requests carry the grammar

    def run_arm(self, prompts: list[list[int]], max_tokens: int, constrained: int) -> OverheadResult:
        self.constrained = constrained
        result = self.run(prompts, max_tokens)
        result.runner = ARMS[bool(constrained)]
        return result

    def params(self, i: int, max_tokens: int):
        """The first `constrained` requests of a run carry the grammar, each its own."""
        params = super().params(i, max_tokens)
        params.constraint = self.make_constraint() if i < self.constrained else None
        return params


def step_tok_s(result: dict) -> float:
    """Decode tok/s from the median full-batch step: the model step (next) plus
    the engine's time between two steps."""
    s = result.get("steps") or {}
    if not s:
        return float("nan")
    return result["batch"] * 1e6 / (s["next_median"] + s["between_median"])


def run_constrained(
    model_path: str,
    batches: list[int],
    max_tokens: int,
    repeats: int,
    prefill_step_size: int = 2048,
    on_progress=None,
) -> dict:
    """Per batch B: `repeats` rounds of a free run and a constrained run (one of
    the B requests constrained), order alternating each round."""
    import mlx.core as mx

    from tierlm.models.loader import load_model
    from tierlm.structured.grammar import ModelGrammars, json_schema_grammar

    model, tokenizer = load_model(model_path)
    grammars = ModelGrammars(tokenizer)
    grammar = json_schema_grammar(SCHEMA)
    grammars.constraint(grammar)  # llguidance's tokenizer view, built once, outside the timing
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    runs: list[dict] = []
    for batch in batches:
        runner = ConstrainedRunner(
            model, tokenizer, batch, prefill_step_size, lambda: grammars.constraint(grammar)
        )
        try:
            prompts = [list(prompt) for _ in range(batch)]
            runner.run_arm(prompts, min(max_tokens, 8), 0)  # warm-up, both arms
            runner.run_arm(prompts, min(max_tokens, 8), 1)
            for rnd in range(repeats):
                for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
                    result = runner.run_arm(prompts, max_tokens, int(arm == "constrained"))
                    row = dict(result.__dict__, round=rnd, generated=list(runner.generated))
                    row["step_tok_s"] = step_tok_s(row)
                    runs.append(row)
                    if on_progress:
                        on_progress(row)
        finally:
            runner.close()
    return {
        "model": str(model_path),
        "batches": batches,
        "prompt_len": len(prompt),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "schema": SCHEMA,
        "device": str(mx.default_device()),
        "cpu_flags": cpu_flags(),
        "runs": runs,
        "summary": summarize(runs),
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per batch: each arm's medians and constrained ÷ free of them."""
    out = []
    for batch in sorted({r["batch"] for r in runs}):
        row: dict = {"batch": batch}
        for arm in ARMS:
            mine = [r for r in runs if r["batch"] == batch and r["runner"] == arm]
            row[arm] = {
                "step_us": median(
                    [r["steps"]["next_median"] + r["steps"]["between_median"] for r in mine if r.get("steps")]
                ),
                "step_tok_s": median([r["step_tok_s"] for r in mine]),
                "decode_tok_s": median([r["decode_tok_s"] for r in mine]),
                "generated": median([sum(r["generated"]) for r in mine]),
                # request 0 is the constrained one in the constrained arm
                "first_request_tokens": min(r["generated"][0] for r in mine),
            }
        row["step_ratio"] = row["constrained"]["step_tok_s"] / row["free"]["step_tok_s"]
        row["decode_ratio"] = row["constrained"]["decode_tok_s"] / row["free"]["decode_tok_s"]
        out.append(row)
    return out


TARGETS = {1: 0.8, 8: 0.9}  # from the issue "constraints in a batch"

HEADER = [
    "batch",
    "free step µs",
    "constrained step µs",
    "step ratio",
    "target",
    "free decode tok/s",
    "constrained decode tok/s",
    "decode ratio",
    "constrained request's tokens",
]


def table_rows(result: dict) -> list[list[str]]:
    from tierlm.bench.report import num

    rows = []
    for s in result["summary"]:
        free, con = s["free"], s["constrained"]
        target = TARGETS.get(s["batch"])
        rows.append(
            [
                str(s["batch"]),
                num(free["step_us"], 0),
                num(con["step_us"], 0),
                num(s["step_ratio"], 3),
                "-" if target is None else f"≥ {target}",
                num(free["decode_tok_s"]),
                num(con["decode_tok_s"]),
                num(s["decode_ratio"], 3),
                f"{con['first_request_tokens']} of {result['max_tokens']}",
            ]
        )
    return rows


def title(doc: dict) -> str:
    return f"Constrained decoding: `{Path(doc['model']).name}` on {doc['device']}"


def markdown(doc: dict) -> str:
    """A result file's table and what it measured, for docs/benchmarks.md (the
    renderer there adds the heading's provenance)."""
    from tierlm.bench.report import markdown_table

    return "\n".join(
        [
            (
                f"CPU flags: {doc.get('cpu_flags', '?')}. {doc['repeats']} rounds per batch, arms alternating; "
                f"one chat prompt of {doc['prompt_len']} tokens for every request, {doc['max_tokens']} greedy "
                "tokens each; in the constrained arm request 0 carries a JSON schema (an array of 40 to 60 "
                "strings: longer than the run). *step*: the median full-batch decode step (model step + the "
                "engine's time between steps); *decode*: tokens while the whole batch decoded, over that "
                "window. Ratios: constrained ÷ free throughput.\n"
            ),
            markdown_table(HEADER, table_rows(doc)),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = lab_parser("bench_lab.constrained", __doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    p.add_argument("--repeats", type=int, default=4, help="rounds per batch; the arms alternate each round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    from tierlm.bench import runs
    from tierlm.bench.report import console, machine_info, num, print_table

    result = run_constrained(
        args.model or runs.default_tokenizer(args),
        runs.concurrencies(args.batch),
        args.max_tokens,
        args.repeats,
        args.prefill_step_size,
        on_progress=lambda r: console.print(
            f"  batch {r['batch']:3d} {r['runner']:11s} step {num(r['step_tok_s'])} tok/s, "
            f"decode {num(r['decode_tok_s'])} tok/s, tokens {r['generated']}"
        ),
    )
    cpu = machine_info().get("cpu", "?")
    print_table(
        f"constrained decoding on {result['device']}, {cpu} ({result['cpu_flags']}); "
        f"medians of {args.repeats} rounds",
        HEADER,
        table_rows(result),
    )
    write_result(args, p, "constrained", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
