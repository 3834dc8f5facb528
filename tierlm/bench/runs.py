"""One load run against a server (a workload at one concurrency, timed), and the
pieces of the command line the subcommands share. cli.py, compare.py and
soak.py import it; it imports none of them."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from tierlm.bench.report import progress_bar, run_environment
from tierlm.bench.servers import default_model_folder
from tierlm.loadgen.client import LoadConfig, run_load
from tierlm.loadgen.metrics import summarize
from tierlm.loadgen.workloads import (
    BenchRequest,
    TokenSoup,
    Workload,
    chat_workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)


def concurrencies(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def command_line(prog: str = "tierlm") -> str:
    """This process's command line, as `tierlm ...` (or `prog ...`), for the result
    files, after the MLX and tierlm variables it ran with (`run_environment`)."""
    settings = [f"{name}={shlex.quote(value)}" for name, value in run_environment().items()]
    return " ".join([*settings, prog, *(shlex.quote(a) for a in sys.argv[1:])])


def default_tokenizer(args) -> str:
    """--tokenizer, else --model when it is a folder, else the default model's folder."""
    if getattr(args, "tokenizer", None):
        return args.tokenizer
    model = getattr(args, "model", None)
    return model if model and Path(model).expanduser().is_dir() else str(default_model_folder())


def build_workload(args, tokenizer: str, concurrency: int) -> Workload:
    soup = TokenSoup(tokenizer, seed=args.seed * 1000 + concurrency)
    n = args.num_prompts or max(args.min_prompts, args.prompts_per_concurrency * max(concurrency, 1))
    if args.workload == "random":
        return random_workload(soup, n, args.input_len, args.output_len, args.range_ratio)
    if args.workload == "chat":
        return chat_workload(soup, n, args.input_len, args.output_len, args.range_ratio)
    if args.workload == "shared-prefix":
        per = max(1, math.ceil(n / args.num_prefixes))
        return shared_prefix_workload(
            soup, args.num_prefixes, args.prefix_len, per, args.suffix_len, args.output_len
        )
    conversations = args.num_prompts or max(1, n // max(args.turns, 1), max(concurrency, 1))
    return multi_turn_workload(
        soup, conversations, args.turns, args.system_len, args.input_len, args.output_len
    )


# The long-prompt runs' soup seed, apart from every concurrency's (seed * 1000 + c)
LONG_PROMPT_SEED = 999


def long_prompt_workload(args, tokenizer: str) -> Workload:
    """`--ttft-requests` chat prompts of `--ttft-prompt-len` soup tokens, each its
    own from the first tokens on (chat_workload), `--ttft-output-len` tokens out:
    time to first token of a long prompt that no server has seen."""
    soup = TokenSoup(tokenizer, seed=args.seed * 1000 + LONG_PROMPT_SEED)
    return chat_workload(soup, args.ttft_requests, args.ttft_prompt_len, args.ttft_output_len)


def warmup_requests(args, tokenizer: str) -> list[BenchRequest]:
    soup = TokenSoup(tokenizer, seed=10**6 + args.seed)
    return [BenchRequest(8, prompt=soup.text(32), input_tokens=32) for _ in range(args.warmup)]


def eos_ids(tokenizer: str) -> list[int]:
    """The EOS ids of a model folder's config.json and generation_config.json."""
    path = Path(tokenizer).expanduser()
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return sorted(ids)


def load_config(args, base_url: str, concurrency: int, model: str | None = None) -> LoadConfig:
    return LoadConfig(
        base_url=base_url,
        model=model,
        concurrency=concurrency or None,
        request_rate=args.request_rate,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        ban_token_ids=eos_ids(default_tokenizer(args)) if args.ban_eos else [],
        api_key=getattr(args, "api_key", None),
        seed=args.seed,
    )


def run_one(args, base_url: str, tokenizer: str, concurrency: int, label: str = "",
            workload: Workload | None = None) -> dict:
    """The workload of `args` (or `workload`) at `concurrency` against `base_url`:
    its summary and each request's times."""
    workload = workload or build_workload(args, tokenizer, concurrency)
    cfg = load_config(args, base_url, concurrency, getattr(args, "model_id", None))
    desc = f"{label} {workload.name} c={concurrency}".strip()
    with progress_bar(workload.num_requests, desc, args.progress) as done:
        load = os.getloadavg()[0]
        cpu = time.process_time()
        records, duration = asyncio.run(run_load(workload, cfg, warmup_requests(args, tokenizer), done))
        cpu = time.process_time() - cpu
    summary = summarize(records, duration)
    # near 1.0 the load generator itself, not the server, may be the bottleneck
    summary["client_cpu_frac"] = cpu / duration if duration > 0 else math.nan
    summary["loadavg_1m_before"] = load  # other work on the machine shows here
    per_request = [
        {
            "ttft": r.ttft if r.ok else None,
            "tpot": r.tpot if r.ok else None,
            "e2e": r.e2e if r.ok else None,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": r.n_output,
            "error": r.error,
        }
        for r in records
    ]
    return {
        "concurrency": concurrency,
        "workload": workload.name,
        "workload_params": workload.params,
        "summary": summary,
        "per_request": per_request,
    }
