"""Side by side: each server started here on the same weights, the same workload
at each concurrency, one server up at a time, the order alternating each round
(A B C, then C B A, ...). Medians over rounds; ratios of tierlm to each peer."""

from __future__ import annotations

from pathlib import Path

from tierlm.bench import runs, servers
from tierlm.bench.report import console, ms, num, print_table, ratio, write_json
from tierlm.loadgen.metrics import median

MEDIAN_KEYS = {
    "output_tok_s": lambda s: s["output_tok_s"],
    "requests_s": lambda s: s["requests_s"],
    "ttft_p50": lambda s: s["ttft_s"]["p50"],
    "ttft_p99": lambda s: s["ttft_s"]["p99"],
    "tpot_p50": lambda s: s["tpot_s"]["p50"],
    "itl_p50": lambda s: s["itl_s"]["p50"],
    "e2e_p50": lambda s: s["e2e_s"]["p50"],
    "mean_output_tokens": lambda s: s["mean_output_tokens"],
    "failed": lambda s: s["failed"],
}


def server_specs(args, concurrencies: list[int]) -> list:
    model = Path(args.model).expanduser() if args.model else servers.default_model_folder()
    top = max(max(concurrencies), 1)
    ctx = args.input_len + args.output_len + 64
    if args.workload == "shared-prefix":
        ctx = args.prefix_len + args.suffix_len + args.output_len + 64
    elif args.workload == "multi-turn":
        ctx = args.system_len + args.turns * (args.input_len + args.output_len) + 128
    specs = []
    for name in args.servers.split(","):
        name = name.strip()
        if name == "tierlm":
            specs.append(servers.tierlm_server(model, top, args.tierlm_args.split()))
        elif name in ("mlx_lm", "mlx_lm.server"):
            specs.append(servers.mlx_lm_server(model, top))
        elif name in ("llama", "llama.cpp", "llama-server"):
            gguf = Path(args.gguf).expanduser() if args.gguf else servers.default_gguf()
            binary = Path(args.llama_server) if args.llama_server else servers.LLAMA_SERVER
            if not binary.is_file():
                raise SystemExit(f"no llama-server at {binary}: run scripts/build_llama_server.sh")
            specs.append(servers.llama_server(gguf, top, ctx, args.threads, binary))
        else:
            raise SystemExit(f"unknown server {name!r}")
    return specs


def run_compare(args, command: str) -> int:
    """`tierlm bench compare`; `command`: the command line, for the result file."""
    concurrencies = runs.concurrencies(args.concurrency)
    specs = server_specs(args, concurrencies)
    tokenizer = runs.default_tokenizer(args)
    results: list[dict] = []
    for rnd in range(args.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        for spec in order:
            console.print(f"round {rnd + 1}/{args.rounds}: starting {spec.name}")
            args.model_id = spec.model_id
            with servers.RunningServer(spec) as server:
                for c in concurrencies:
                    run = runs.run_one(args, server.base_url, tokenizer, c, label=spec.name)
                    run.update(server=spec.name, round=rnd)
                    results.append(run)
                    s = run["summary"]
                    console.print(
                        f"  {spec.name} c={c}: {s['output_tok_s']:.1f} out tok/s, "
                        f"TTFT p50 {ms(s['ttft_s']['p50'])} ms, failed {s['failed']}"
                    )
    names = [s.name for s in specs]
    table = medians(results, names, concurrencies)
    print_compare(table, names, concurrencies, args)
    if args.json:
        write_json(
            args.json,
            "compare",
            {
                "servers": [{"name": s.name, "cmd": s.cmd} for s in specs],
                "concurrencies": concurrencies,
                "rounds": args.rounds,
                "workload": args.workload,
                "medians": table,
                "runs": results,
            },
            command,
        )
    return 0


def medians(results: list[dict], names: list[str], concurrencies: list[int]) -> dict:
    out: dict = {}
    for name in names:
        for c in concurrencies:
            mine = [r["summary"] for r in results if r["server"] == name and r["concurrency"] == c]
            out[f"{name}@{c}"] = {k: median([f(s) for s in mine]) for k, f in MEDIAN_KEYS.items()}
    return out


def compare_rows(table: dict, names: list[str], concurrencies: list[int]):
    header = [
        "concurrency",
        "server",
        "out tok/s",
        "req/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "E2E p50",
        "out/req",
        "fail",
    ]
    rows = []
    for c in concurrencies:
        for name in names:
            m = table[f"{name}@{c}"]
            rows.append(
                [
                    str(c),
                    name,
                    num(m["output_tok_s"]),
                    num(m["requests_s"], 2),
                    ms(m["ttft_p50"]),
                    ms(m["ttft_p99"]),
                    ms(m["tpot_p50"]),
                    ms(m["itl_p50"]),
                    ms(m["e2e_p50"]),
                    num(m["mean_output_tokens"]),
                    num(m["failed"], 0),
                ]
            )
    base = names[0]
    peers = names[1:]
    rheader = ["concurrency"]
    for p in peers:
        rheader += [f"tok/s {base} ÷ {p}", f"TTFT p50 {base} ÷ {p}"]
    rrows = []
    for c in concurrencies:
        row = [str(c)]
        b = table[f"{base}@{c}"]
        for p in peers:
            o = table[f"{p}@{c}"]
            row += [
                num(ratio(b["output_tok_s"], o["output_tok_s"]), 2),
                num(ratio(b["ttft_p50"], o["ttft_p50"]), 2),
            ]
        rrows.append(row)
    return (header, rows), (rheader, rrows)


def print_compare(table: dict, names: list[str], concurrencies: list[int], args) -> None:
    (h, rows), (rh, rrows) = compare_rows(table, names, concurrencies)
    print_table(f"{args.workload} workload, medians of {args.rounds} rounds (times in ms)", h, rows)
    if len(names) > 1:
        print_table("ratios (tok/s: higher is better for the first; TTFT: lower is)", rh, rrows)
