"""Side by side: each server started here on the same weights, the same workload
at each concurrency, one server up at a time, the order alternating each round
(A B C, then C B A, ...). Medians over rounds; ratios of tierlm to each peer.

With each start it records the server's resident memory after load and at the
end, its compute threads (tierlm's and llama-server's the same, `--threads`),
tierlm's CPU backend as /stats reports it, and, with `--ttft-prompt-len`, the
time to first token of long prompts no server has seen (after the concurrency
runs); the machine's CPU and its vector features go with every result file
(report.machine_info)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

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


def context_per_request(args) -> int:
    """The context one request needs: its prompt, its output, room for a chat template."""
    ctx = args.input_len + args.output_len + 64
    if args.workload == "shared-prefix":
        ctx = args.prefix_len + args.suffix_len + args.output_len + 64
    elif args.workload == "multi-turn":
        ctx = args.system_len + args.turns * (args.input_len + args.output_len) + 128
    if getattr(args, "ttft_prompt_len", 0):
        ctx = max(ctx, args.ttft_prompt_len + args.ttft_output_len + 64)
    return ctx


def server_specs(args, concurrencies: list[int]) -> list:
    """The servers of `--servers`, on `args.model` (a folder: run_compare resolves
    it) and, for llama-server, `--gguf` or the GGUF the folder was imported from.
    tierlm and llama-server compute with the same number of threads."""
    model = servers.model_folder(args.model)
    top = max(max(concurrencies), 1)
    threads = args.threads or servers.cpu_count()
    specs = []
    for name in args.servers.split(","):
        name = name.strip()
        if name == "tierlm":
            specs.append(servers.tierlm_server(model, top, args.tierlm_args.split(), threads=threads))
        elif name in ("mlx_lm", "mlx_lm.server"):
            specs.append(servers.mlx_lm_server(model, top))
        elif name in ("llama", "llama.cpp", "llama-server"):
            binary = Path(args.llama_server) if args.llama_server else servers.LLAMA_SERVER
            if not binary.is_file():
                raise SystemExit(f"no llama-server at {binary}: run scripts/build_llama_server.sh")
            gguf = Path(args.gguf).expanduser() if args.gguf else servers.gguf_for(model)
            if not gguf.is_file():
                raise SystemExit(f"no GGUF at {gguf}")
            extra = getattr(args, "llama_args", "").split()
            specs.append(servers.llama_server(gguf, top, context_per_request(args), threads, binary, extra))
        else:
            raise SystemExit(f"unknown server {name!r}")
    return specs


def describe_server(spec) -> dict:
    """What the result file says of a server: its command, environment, threads,
    and for llama-server the GGUF and the instruction sets it was built for."""
    out = {"name": spec.name, "cmd": spec.cmd, "env": spec.env, "threads": spec.threads}
    if spec.name == "llama-server":
        gguf = Path(spec.cmd[spec.cmd.index("-m") + 1])
        out["gguf"] = {"path": str(gguf), "bytes": gguf.stat().st_size if gguf.is_file() else None}
        out["build"] = servers.llama_build(Path(spec.cmd[0]))
    return out


def server_report(spec, base_url: str) -> dict:
    """After a start's runs: tierlm's /stats of its engine (the CPU backend's whole
    dict, what ran of it, MLX's memory counters); llama-server's /props (its build,
    the GGUF's type, its slots)."""
    try:
        with httpx.Client(timeout=10) as client:
            if spec.name == "tierlm":
                engines = client.get(base_url + "/stats").json().get("engines", [])
                return {
                    e.get("model", "?"): {
                        "backend": e.get("backend"),
                        "memory_active_bytes": e.get("memory_active_bytes"),
                        "memory_peak_bytes": e.get("memory_peak_bytes"),
                    }
                    for e in engines
                }
            if spec.name == "llama-server":
                props = client.get(base_url + "/props").json()
                keep = ("build_info", "model_ftype", "total_slots")
                return {k: props.get(k) for k in keep}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {}


def tierlm_backend(start: dict) -> dict | None:
    """The CPU backend dict of the benchmarked model's engine in a tierlm start."""
    engine = start.get("report", {}).get(start.get("model_id"))
    return engine.get("backend") if isinstance(engine, dict) else None


def _measured(args, server, tokenizer, spec, rnd: int, results: list[dict], concurrency: int, phase: str,
              **run_args) -> dict:
    """One workload run against a started server, kept in `results`; its summary."""
    run = runs.run_one(args, server.base_url, tokenizer, concurrency, **run_args)
    run.update(server=spec.name, round=rnd, phase=phase)
    results.append(run)
    return run["summary"]


def run_compare(args, command: str) -> int:
    """`tierlm bench compare`; `command`: the command line, for the result file."""
    concurrencies = runs.concurrencies(args.concurrency)
    args.model = str(servers.model_folder(args.model))  # a name (pulled first) or a folder: its folder
    specs = server_specs(args, concurrencies)
    tokenizer = runs.default_tokenizer(args)
    long_prompts = runs.long_prompt_workload(args, tokenizer) if args.ttft_prompt_len else None
    results: list[dict] = []
    starts: list[dict] = []
    for rnd in range(args.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        for spec in order:
            console.print(f"round {rnd + 1}/{args.rounds}: starting {spec.name} ({spec.threads} threads)")
            with servers.RunningServer(spec) as server:
                args.model_id = server.served_model_id()
                start = {"server": spec.name, "round": rnd, "model_id": args.model_id,
                         "warming_s": server.wait_warm()}
                start["memory_after_load"] = server.memory()
                for c in concurrencies:
                    s = _measured(args, server, tokenizer, spec, rnd, results, c, "streams", label=spec.name)
                    console.print(
                        f"  {spec.name} c={c}: {s['output_tok_s']:.1f} out tok/s, "
                        f"TTFT p50 {ms(s['ttft_s']['p50'])} ms, ITL p50 {ms(s['itl_s']['p50'])} ms, "
                        f"failed {s['failed']}"
                    )
                if long_prompts is not None:
                    s = _measured(args, server, tokenizer, spec, rnd, results, 1, "long-prompt",
                                  label=f"{spec.name} long prompts", workload=long_prompts)
                    console.print(
                        f"  {spec.name} {args.ttft_prompt_len}-token prompts: "
                        f"TTFT p50 {ms(s['ttft_s']['p50'])} ms, "
                        f"cached prompt tokens {s['cached_tokens']}, failed {s['failed']}"
                    )
                start["memory_end"] = server.memory()
                start["report"] = server_report(spec, server.base_url)
                starts.append(start)
                mem = start["memory_end"]
                console.print(
                    f"  {spec.name} RSS after load {mib(start['memory_after_load'].get('rss_bytes'))} MiB, "
                    f"at the end {mib(mem.get('rss_bytes'))} MiB"
                )
    names = [s.name for s in specs]
    table = medians(results, names, concurrencies)
    long_table = long_prompt_medians(results, names) if long_prompts is not None else None
    memory = memory_medians(starts, names)
    backend = next((tierlm_backend(s) for s in reversed(starts) if s["server"] == "tierlm"), None)
    print_compare(table, names, concurrencies, args)
    if long_table:
        print_table(
            f"time to first token of {args.ttft_prompt_len}-token chat prompts, each new to the server, "
            f"one at a time, medians of {args.rounds} rounds (times in ms)",
            *long_prompt_rows(long_table, names),
        )
    print_table("resident memory of each server (MiB), medians of its starts", *memory_rows(memory, names))
    for label, text in setup_rows(specs, backend):
        console.print(f"{label}: {text}", soft_wrap=True)
    if args.json:
        write_json(
            args.json,
            "compare",
            {
                "model": args.model,
                "model_config": model_config(Path(args.model)),
                "servers": [describe_server(s) for s in specs],
                "concurrencies": concurrencies,
                "rounds": args.rounds,
                "workload": args.workload,
                "medians": table,
                "long_prompt": None if long_prompts is None else {
                    "prompt_len": args.ttft_prompt_len, "requests": args.ttft_requests,
                    "output_len": args.ttft_output_len, "workload_params": long_prompts.params,
                    "medians": long_table,
                },
                "memory": memory,
                "tierlm_backend": backend,
                "starts": starts,
                "runs": results,
            },
            command,
        )
    return 0


def model_config(model: Path) -> dict:
    """What the served folder's config.json says of its weights: their quantization,
    and the GGUF it was imported from (file, tensor types)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in ("model_type", "quantization", "gguf") if k in config}


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def _streams(r: dict) -> bool:
    return r.get("phase", "streams") == "streams"  # files before the long-prompt runs had no phase


def medians(results: list[dict], names: list[str], concurrencies: list[int]) -> dict:
    out: dict = {}
    for name in names:
        for c in concurrencies:
            mine = [
                r["summary"] for r in results if r["server"] == name and r["concurrency"] == c and _streams(r)
            ]
            out[f"{name}@{c}"] = {k: median([f(s) for s in mine]) for k, f in MEDIAN_KEYS.items()}
    return out


LONG_PROMPT_KEYS = {
    "ttft_p50": lambda s: s["ttft_s"]["p50"],
    "ttft_p90": lambda s: s["ttft_s"]["p90"],
    "mean_prompt_tokens": lambda s: _per_request(s, "prompt_tokens"),
    # what the server said it read from its cache (llama-server: from a slot's last prompt)
    "mean_cached_tokens": lambda s: _per_request(s, "cached_tokens"),
    "failed": lambda s: s["failed"],
}


def _per_request(summary: dict, key: str) -> float | None:
    done = summary.get("completed")
    return summary[key] / done if done and key in summary else None


def long_prompt_medians(results: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        mine = [r["summary"] for r in results if r["server"] == name and r.get("phase") == "long-prompt"]
        out[name] = {
            k: median([v for s in mine if (v := f(s)) is not None]) for k, f in LONG_PROMPT_KEYS.items()
        }
    return out


def long_prompt_rows(table: dict, names: list[str]):
    base = names[0]
    header = ["server", "prompt tokens", "TTFT p50", "TTFT p90", "cached tokens", "fail",
              f"TTFT p50 {base} ÷ this"]
    rows = [
        [
            name,
            num(m["mean_prompt_tokens"], 0),
            ms(m["ttft_p50"]),
            ms(m["ttft_p90"]),
            num(m["mean_cached_tokens"], 0),
            num(m["failed"], 0),
            "" if name == base else num(ratio(table[base]["ttft_p50"], m["ttft_p50"]), 2),
        ]
        for name in names
        if (m := table.get(name)) is not None
    ]
    return header, rows


MEMORY_KEYS = {"after_load": ("memory_after_load", "rss_bytes"), "end": ("memory_end", "rss_bytes"),
               "end_anon": ("memory_end", "rss_anon_bytes"), "end_file": ("memory_end", "rss_file_bytes"),
               "peak": ("memory_end", "peak_rss_bytes")}


def memory_medians(starts: list[dict], names: list[str]) -> dict:
    """Per server, the median over its starts of each MEMORY_KEYS figure (bytes)."""
    out = {}
    for name in names:
        mine = [s for s in starts if s["server"] == name]
        out[name] = {
            k: median([v for s in mine if (v := s.get(when, {}).get(field)) is not None])
            for k, (when, field) in MEMORY_KEYS.items()
        }
        out[name] = {k: (None if v != v else v) for k, v in out[name].items()}  # nan: not measured
    return out


def memory_rows(memory: dict, names: list[str]):
    header = ["server", "RSS after load", "RSS at the end", "of it anonymous", "of it file-backed",
              "peak RSS"]
    rows = [
        [name] + [mib(memory[name].get(k)) for k in ("after_load", "end", "end_anon", "end_file", "peak")]
        for name in names
        if name in memory
    ]
    return header, rows


def setup_rows(specs: list, backend: dict | None) -> list[tuple[str, str]]:
    """The machine's CPU, its vector features, each server's threads, tierlm's CPU
    backend: (label, text) lines."""
    from tierlm.bench.report import cpu_features, machine_info

    info = machine_info()
    features = cpu_features()
    have = " ".join(f for f, on in features.items() if on and f != "hypervisor") or "?"
    lacks = " ".join(f for f, on in features.items() if not on and f != "hypervisor") or "-"
    rows = [
        ("CPU", f"{info.get('cpu', '?')} ({info.get('cpu_id', '?')}), {info.get('cpus')} CPUs"
                + (", under a hypervisor" if features.get("hypervisor") else "")),
        ("CPU features present", have),
        ("CPU features absent", lacks),
    ]
    if info.get("max_cpu_isa"):
        rows.append(("tierlm's kernels capped at", f"TIERLM_MAX_CPU_ISA={info['max_cpu_isa']}"))
    rows += [(f"{s.name} threads", str(s.threads) if s.threads else "its default") for s in specs]
    if backend is not None:
        rows.append(("tierlm CPU backend (/stats)", json.dumps(backend)))
    return rows


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
