"""Prompts of lengths a server has not seen yet: `python -m bench_lab.new_lengths`.

A chat's prompts are nearly all of lengths new to the server, and on a CUDA GPU
a prefill whose attention shape is new to the process waits for cuDNN to build
a graph for it (backends/gpu.py pads the queries to buckets against that). For
each setting (`--setting NAME` or `NAME:VAR=VALUE,...`: environment variables
for that server, e.g. `unbucketed:TIERLM_QUERY_BUCKET=0`), a fresh `tierlm
serve` on an empty kernel folder, warmed; then one chat prompt of random words
per length in `--words`, one at a time, one token out each: the time to the
answer at the client, and the server's prefill stage (its Server-Timing).

    python -m bench_lab.new_lengths --preset llama-1b --tokenizer TOKENIZER_DIR \\
        --setting bucketed --setting unbucketed:TIERLM_QUERY_BUCKET=0
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench_lab import add_model_args, lab_parser, model_folder, write_result
from tierlm.bench.report import markdown_table
from tierlm.bench.servers import RunningServer, tierlm_server

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
# words a prompt has: SmolLM2's tokenizer makes ~1.3 tokens of each, so one chunk (2,048 tokens) holds every
# length here but the sixth, which takes two
DEFAULT_WORDS = [450, 480, 700, 1000, 1300, 1900, 470, 990, 333, 1500, 600, 460]


def setting(text: str) -> tuple[str, dict]:
    """`NAME` or `NAME:VAR=VALUE,...` -> (name, environment)."""
    name, _, assignments = text.partition(":")
    return name, dict(a.split("=", 1) for a in assignments.split(",") if a)


def server_timing(header: str) -> dict[str, float]:
    """A Server-Timing header's stages, in ms."""
    stages = {}
    for entry in header.split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if duration:
            stages[name] = float(duration)
    return stages


def prompt(words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(words))


def one_setting(model: Path, name: str, env: dict, words: list[int], work: Path) -> dict:
    spec = tierlm_server(model, 8)
    spec.env = {**env, "MLX_PTX_CACHE_DIR": tempfile.mkdtemp(prefix="kernels-", dir=work)}
    tic = time.monotonic()
    with RunningServer(spec, log_dir=work) as server:
        server.wait_warm()
        ready_s = time.monotonic() - tic
        client = httpx.Client(base_url=server.base_url, timeout=600)
        rows = []
        for seed, n in enumerate(words):
            body = {"messages": [{"role": "user", "content": prompt(n, seed)}], "max_tokens": 1, "temperature": 0}
            tic = time.perf_counter()
            resp = client.post("/v1/chat/completions", json=body)
            resp.raise_for_status()
            rows.append({"prompt_tokens": resp.json()["usage"]["prompt_tokens"],
                         "total_ms": (time.perf_counter() - tic) * 1000,
                         "prefill_ms": server_timing(resp.headers.get("server-timing", "")).get("prefill")})
        client.close()
    print(f"{name}: " + " ".join(f"{r['prompt_tokens']}/{r['total_ms']:.0f}/{r['prefill_ms']:.0f}" for r in rows),
          flush=True)
    later = rows[1:]  # the first request of a process pays more of its own
    return {"name": name, "env": env, "ready_s": ready_s, "requests": rows,
            "median_total_ms": statistics.median(r["total_ms"] for r in later),
            "median_prefill_ms": statistics.median(r["prefill_ms"] for r in later)}


def title(result: dict) -> str:
    model = f"random weights of {result['preset']}'s shapes" if result.get("preset") else Path(result["model"]).name
    return f"Prompts of lengths new to the server, {model}: {len(result['words'])} prompts, one token out"


def table(result: dict) -> str:
    header = ["setting", "first request: tokens, ms to the answer (prefill)", "later ones: median ms (prefill)"]
    rows = []
    for s in result["settings"]:
        first = s["requests"][0]
        rows.append([s["name"], f"{first['prompt_tokens']}, {first['total_ms']:.0f} ({first['prefill_ms']:.0f})",
                     f"{s['median_total_ms']:.0f} ({s['median_prefill_ms']:.0f})"])
    return markdown_table(header, rows)


def main(argv=None) -> int:
    p = lab_parser("bench_lab.new_lengths", __doc__)
    add_model_args(p)
    p.add_argument("--setting", action="append", default=[], help="NAME or NAME:VAR=VALUE,... (repeatable)")
    p.add_argument("--words", type=int, nargs="+", default=DEFAULT_WORDS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tierlm-new-lengths-"))
    model = model_folder(args, work)
    result = {"model": str(model), "preset": args.preset, "words": args.words,
              "settings": [one_setting(model, *setting(s), args.words, work) for s in args.setting or ["this"]]}
    print(title(result))
    print(table(result))
    write_result(args, p, "new_lengths", result)
    shutil.rmtree(work, ignore_errors=True)  # a preset's weights (2.5 GB for llama-1b) and the kernel folders
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
