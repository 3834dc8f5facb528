"""A long agent turn over HTTP: time to the first token cold, as a hot-tier hit
and as an SSD hit after a restart, beside the server's own account of where it
went (its request stages: body, template, tokenizer, queue, restore, prefill).

Per prompt size and round, a conversation of its own (no round shares a block
with another) whose first user message holds a source file of about that many
tokens:

- cold: its first turn;
- hot: the next turn (the answer and a new question appended), from the hot tier;
- ssd: the server restarted on the same SSD folder, then the turn after that.

The stages come from the server's /stats (`request_stages.last`); *before the
engine* is body to hand-over (what the request path costs), *engine* the queue,
the restore and the prefill of what was not cached; *deliver* the first token's
way from the engine to the stream. Medians over rounds.

    python -m bench_lab.request_path --model ~/.tierlm/models/SmolLM2-135M-Instruct --sizes 2000 6000
    python -m bench_lab.request_path --preset llama-1b --tokenizer TOKENIZER_DIR --sizes 8000 20000 60000
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench_lab import add_model_args, lab_parser, model_folder, write_result
from tierlm.bench.servers import RunningServer, tierlm_server
from tierlm.engine.stages import STAGES

BEFORE_ENGINE = STAGES[: STAGES.index("submit") + 1]
ENGINE = STAGES[STAGES.index("submit") + 1 : STAGES.index("deliver")]


def source_file(tokenizer, n: int, seed: int) -> str:
    """Python source of about n tokens that no other seed shares a block with."""
    lines, text = [], ""
    i = 0
    while len(tokenizer.encode(text)) < n:
        lines.extend(f"def handler_{seed}_{i + k}(request, limit={(i + k) * 7 % 97}):\n"
                     f"    \"\"\"Serve request {i + k} of batch {seed}.\"\"\"\n"
                     f"    return request.reply(limit * {(i + k) % 13} + {seed})\n\n" for k in range(40))
        i += 40
        text = "".join(lines)
    return tokenizer.decode(tokenizer.encode(text)[:n])


def conversation(source: str, turns: int) -> list[dict]:
    """An agent's conversation after `turns` turns: the file, then questions and answers."""
    messages = [{"role": "system", "content": "You are a coding agent. Answer briefly."},
                {"role": "user", "content": f"Here is server.py:\n\n{source}\n\nWhat does handler_0 do?"}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"Answer {t}: it replies to the request."},
                     {"role": "user", "content": f"Question {t}: and handler_{t}?"}]
    return messages


def turn(server: RunningServer, messages: list[dict]) -> dict:
    """One streamed turn: seconds to the first token, prompt and cached tokens, the server's stages."""
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    client = httpx.Client(base_url=server.base_url, timeout=600)  # made before the clock starts, as an agent's is
    client.get("/health")
    tic, first, cached, prompt = time.perf_counter(), None, 0, None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            choice = (chunk.get("choices") or [{}])[0]
            if first is None and (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                first = time.perf_counter() - tic
            if chunk.get("usage"):
                prompt = chunk["usage"].get("prompt_tokens")
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    engine = client.get("/stats").json()["engines"][0]
    client.close()
    stats = engine.get("request_stages", {}).get("last", {})  # {}: a server from before the stages
    return {"ttft_s": first, "prompt_tokens": prompt, "cached_tokens": cached, "stages_ms": stats,
            "before_engine_ms": sum(stats.get(s, 0.0) for s in BEFORE_ENGINE),
            "engine_ms": sum(stats.get(s, 0.0) for s in ENGINE)}


def size_rounds(start, tokenizer, n: int, rounds: int) -> dict:
    """`start()`: a server on the shared SSD folder, started and warm."""
    rows = []
    for r in range(rounds):
        source = source_file(tokenizer, n, 100 * n + r)
        server = start()
        try:
            cold = turn(server, conversation(source, 1))
            hot = turn(server, conversation(source, 2))
        finally:
            server.stop()  # writes the hot tier back to the SSD folder
        server = start()
        try:
            ssd = turn(server, conversation(source, 3))
        finally:
            server.stop()
        rows.append({"cold": cold, "hot": hot, "ssd": ssd})
        print(f"{n} tokens, round {r + 1}: cold {cold['ttft_s']:.3f}s  hot {hot['ttft_s']:.3f}s "
              f"({hot['ttft_s'] / cold['ttft_s']:.3f}; before the engine {hot['before_engine_ms']:.1f} ms, "
              f"engine {hot['engine_ms']:.1f} ms)  ssd {ssd['ttft_s']:.3f}s ({ssd['ttft_s'] / cold['ttft_s']:.3f}; "
              f"{ssd['cached_tokens']} cached)", flush=True)
    med = {f"{kind}_{what}": statistics.median(row[kind][what] for row in rows)
           for kind in ("cold", "hot", "ssd") for what in ("ttft_s", "before_engine_ms", "engine_ms")}
    stages = {kind: {s: statistics.median(row[kind]["stages_ms"].get(s, 0.0) for row in rows) for s in STAGES}
              for kind in ("cold", "hot", "ssd")}
    return {"prompt_tokens": n, "rounds": rows, **{f"median_{k}": v for k, v in med.items()},
            "median_stages_ms": stages,
            "hot_over_cold": over_cold(rows, "hot"), "ssd_over_cold": over_cold(rows, "ssd")}


def over_cold(rows: list[dict], kind: str) -> float:
    """Each round's `kind` hit against its own cold prompt, the median of those:
    one slow cold prompt (an H100 round once took 1.2 s against 0.33) moves no ratio."""
    return statistics.median(row[kind]["ttft_s"] / row["cold"]["ttft_s"] for row in rows)


def title(result: dict) -> str:
    model = f"random weights of {result['preset']}'s shapes" if result.get("preset") else Path(result["model"]).name
    served = f", served with {' '.join(result['serve_args'])}" if result.get("serve_args") else ""
    if result.get("environment"):  # another run's figures, not a newer one's
        served += ", under " + " ".join(f"{k}={v}" for k, v in result["environment"].items())
    sizes = ", ".join(str(s["prompt_tokens"]) for s in result["sizes"])
    return f"An agent's turn over HTTP, cold, hot and SSD after a restart, {model}{served}: {sizes} tokens"


def table(result: dict) -> str:
    """A row a prompt size: the medians of its rounds, from three rounds on; below
    that a row a round (a median of two is their mean, and one slow cold prompt
    moves it)."""
    lines = ["| prompt tokens | cold | hot (÷ its round's cold) | SSD after restart (÷ its round's cold) "
             "| hot: before the engine | hot: engine |",
             "|---|---|---|---|---|---|"]
    for s in result["sizes"]:
        rows = s["rounds"]
        if len(rows) >= 3:
            lines.append(_row(str(s["prompt_tokens"]), s["median_cold_ttft_s"], s["median_hot_ttft_s"],
                              s["median_ssd_ttft_s"], over_cold(rows, "hot"), over_cold(rows, "ssd"),
                              s["median_hot_before_engine_ms"], s["median_hot_engine_ms"]))
            continue
        for i, r in enumerate(rows, 1):
            cold, hot, ssd = r["cold"]["ttft_s"], r["hot"]["ttft_s"], r["ssd"]["ttft_s"]
            lines.append(_row(f"{s['prompt_tokens']}, round {i}", cold, hot, ssd, hot / cold, ssd / cold,
                              r["hot"]["before_engine_ms"], r["hot"]["engine_ms"]))
    return "\n".join(lines)


def _row(name: str, cold: float, hot: float, ssd: float, hot_ratio: float, ssd_ratio: float,
         before_ms: float, engine_ms: float) -> str:
    return (f"| {name} | {cold:.3f} s | {hot:.3f} s ({hot_ratio:.3f}) | {ssd:.3f} s ({ssd_ratio:.3f}) | "
            f"{before_ms:.1f} ms | {engine_ms:.1f} ms |")


def main(argv=None) -> int:
    p = lab_parser("bench_lab.request_path", __doc__)
    add_model_args(p)
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 6000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for tierlm serve")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="tierlm-request-path-"))
    model = model_folder(args, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    serve = ["--ssd-cache", "--ssd-cache-dir", str(work / "ssd"), "--ssd-cache-size", "100GiB", *args.serve_arg]

    def start() -> RunningServer:
        server = RunningServer(tierlm_server(model, 4, serve), log_dir=work).start()
        server.wait_warm()
        return server

    result = {"model": str(model), "preset": args.preset, "serve_args": args.serve_arg,
              "sizes": [size_rounds(start, tokenizer, n, args.rounds) for n in args.sizes]}
    print(table(result))
    write_result(args, p, "request_path", result)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
