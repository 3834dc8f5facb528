"""Two tierlm replicas sharing one SSD folder, over HTTP.

Per round, with its own prompts of --prompt-tokens tokens:

- cold: replica B answers a prompt nobody has seen (time to first token);
- replica hit: replica A answers another prompt (writing its blocks through to the
  shared folder), then B answers that same prompt from A's files;
- hot: A answers it again, from its own hot tier.

The figure is the replica hit over cold (medians over rounds). With --nginx, nginx
is started with docs/nginx-replicas.conf (its ports replaced) in front of both,
and agent sessions (Claude Code's and Codex's session headers) send two turns
each through it: both turns of a session must reach the same replica, the
second from its hot tier.

    python -m bench_lab.replicas --model ~/.tierlm/models/SmolLM2-135M-Instruct --prompt-tokens 4000
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench_lab import lab_parser, write_result
from tierlm.bench.servers import RunningServer, default_model_folder, free_port, tierlm_server
from tierlm.loadgen.client import chunk_text

NGINX_CONF = Path(__file__).resolve().parent.parent / "docs" / "nginx-replicas.conf"
PORTS = ("127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002")  # the conf's front, replica A, replica B


def document(tokenizer, n: int, seed: int) -> str:
    """Text of about n tokens that no other seed shares a block with."""
    words = " ".join(f"item{seed}-{i} costs {i * 7 % 101} coins;" for i in range(n))
    return tokenizer.decode(tokenizer.encode(words)[:n])


def ttft(base_url: str, text: str, headers: dict | None = None) -> tuple[float, int]:
    """Seconds to the first streamed token of a chat turn on `text`; its cached tokens."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tic, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices") and chunk_text(chunk):  # not the role's chunk
                first = time.perf_counter() - tic
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return first, cached


def cache_stats(server: RunningServer) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats", timeout=10).json()["prefix_cache"]


def wait_written(server: RunningServer, timeout: float = 120) -> None:
    """Until every block the server stored is in the shared folder."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = cache_stats(server)
        if s["ssd"]["pending_bytes"] == 0 and s["ssd"]["writes"] + s["ssd"]["write_drops"] >= s["stored_blocks"]:
            return
        time.sleep(0.05)
    raise TimeoutError("the replica's blocks never reached the folder")


def replica_rounds(a: RunningServer, b: RunningServer, tokenizer, n: int, rounds: int) -> dict:
    rows = []
    for r in range(rounds):
        cold, _ = ttft(b.base_url, document(tokenizer, n, 1000 + r))
        ttft(a.base_url, shared := document(tokenizer, n, 2000 + r))
        wait_written(a)
        replica, cached = ttft(b.base_url, shared)
        hot, _ = ttft(a.base_url, shared)
        rows.append({"cold_s": cold, "replica_hit_s": replica, "replica_cached_tokens": cached, "hot_s": hot})
        print(f"round {r + 1}: cold {cold:.3f}s  replica hit {replica:.3f}s ({cached} tokens cached)  "
              f"hot {hot:.3f}s", flush=True)
    med = {k: statistics.median(row[k] for row in rows) for k in ("cold_s", "replica_hit_s", "hot_s")}
    return {"rounds": rows, **{f"median_{k}": v for k, v in med.items()},
            "replica_hit_over_cold": med["replica_hit_s"] / med["cold_s"],
            "hot_over_cold": med["hot_s"] / med["cold_s"]}


def start_nginx(folder: Path, a: RunningServer, b: RunningServer) -> tuple[subprocess.Popen, str]:
    """nginx on docs/nginx-replicas.conf, its addresses replaced by free ports here."""
    front = f"127.0.0.1:{free_port()}"
    conf = NGINX_CONF.read_text()
    for old, new in zip(PORTS, (front, f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")):
        conf = conf.replace(old, new)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    (folder / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([shutil.which("nginx") or "nginx", "-p", str(folder), "-c", str(folder / "nginx.conf"),
                             "-g", f"daemon off; pid {folder}/nginx.pid; error_log {folder}/logs/error.log;"])
    base = f"http://{front}"
    for _ in range(100):
        try:
            httpx.get(base + "/health", timeout=1)
            return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"nginx did not start: {(folder / 'logs' / 'error.log').read_text()}")


def served_by(replicas: list[RunningServer], before: list[dict]) -> tuple[int, int]:
    """Which replica the last turn went to (whose lookups grew), and the tokens it
    took from its hot tier."""
    after = [cache_stats(r) for r in replicas]
    (i,) = [i for i in range(len(replicas)) if after[i]["lookups"] > before[i]["lookups"]]
    return i, after[i]["hot_hit_tokens"] - before[i]["hot_hit_tokens"]


def affinity_sessions(base: str, replicas: list[RunningServer], tokenizer, n: int, sessions: int) -> dict:
    """Each session: two turns through nginx under its agent's session header. Both
    must reach the same replica, the second from that replica's hot tier."""
    rows = []
    for s in range(sessions):
        header = "X-Claude-Code-Session-Id" if s % 2 == 0 else "session-id"
        headers = {header: str(uuid.uuid4())}
        text = document(tokenizer, n, 3000 + s)
        before = [cache_stats(r) for r in replicas]
        first, _ = ttft(base, text, headers)
        first_replica, _ = served_by(replicas, before)
        before = [cache_stats(r) for r in replicas]
        second, _ = ttft(base, text + " And one more question.", headers)
        second_replica, hot = served_by(replicas, before)
        rows.append({"header": header, "replicas": [first_replica, second_replica], "first_s": first,
                     "second_s": second, "second_hot_hit_tokens": hot})
        print(f"session {s + 1} ({header}): replica {'AB'[first_replica]} then {'AB'[second_replica]}, "
              f"turn 2 {hot} tokens from the hot tier, {second:.3f}s (turn 1 {first:.3f}s)", flush=True)
    return {"sessions": rows, "both_replicas_used": len({r["replicas"][0] for r in rows}) == len(replicas),
            "every_session_kept": all(r["replicas"][0] == r["replicas"][1] and r["second_hot_hit_tokens"] > 0
                                      for r in rows)}


def title(result: dict) -> str:
    routed = ", agent sessions through nginx" if result.get("nginx") else ""
    return (f"Two replicas sharing one SSD folder{routed}, {Path(result['model']).name}: "
            f"a {result['prompt_tokens']}-token prompt")


def table(result: dict) -> str:
    r = result["replicas"]
    lines = ["| cold | hit from the other replica's blocks (÷ cold) | hot hit (÷ cold) | tokens cached |",
             "|---|---|---|---|",
             f"| {r['median_cold_s']:.3f} s | {r['median_replica_hit_s']:.3f} s ({r['replica_hit_over_cold']:.3f}) "
             f"| {r['median_hot_s']:.3f} s ({r['hot_over_cold']:.3f}) "
             f"| {statistics.median(row['replica_cached_tokens'] for row in r['rounds'])} |"]
    if n := result.get("nginx"):
        kept = sum(row["replicas"][0] == row["replicas"][1] and row["second_hot_hit_tokens"] > 0
                   for row in n["sessions"])
        lines += ["", f"Through nginx: {kept} of {len(n['sessions'])} agent sessions kept on one replica with "
                      f"their second turn from its hot tier; both replicas used: "
                      f"{'yes' if n['both_replicas_used'] else 'no'}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = lab_parser("bench_lab.replicas", __doc__)
    p.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nginx", action="store_true", help="also route agent sessions through nginx")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    model = Path(args.model).expanduser() if args.model else default_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = Path(tempfile.mkdtemp(prefix="tierlm-replicas-"))
    shared = ["--ssd-cache", "--ssd-cache-dir", str(work / "ssd"), "--ssd-write-through"]
    a = RunningServer(tierlm_server(model, 4, shared), log_dir=work)
    b = RunningServer(tierlm_server(model, 4, shared), log_dir=work)
    result: dict = {"model": str(model), "prompt_tokens": args.prompt_tokens}
    nginx = None
    try:
        a.start(), b.start()
        a.wait_warm(), b.wait_warm()
        result["replicas"] = replica_rounds(a, b, tokenizer, args.prompt_tokens, args.rounds)
        print(f"replica hit / cold: {result['replicas']['replica_hit_over_cold']:.3f} "
              f"(hot / cold {result['replicas']['hot_over_cold']:.3f})")
        if args.nginx:
            nginx, base = start_nginx(work / "nginx", a, b)
            result["nginx"] = affinity_sessions(base, [a, b], tokenizer, args.prompt_tokens, args.sessions)
            print(f"every session kept on its replica: {result['nginx']['every_session_kept']}; "
                  f"both replicas used: {result['nginx']['both_replicas_used']}")
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(timeout=10)
        a.stop(), b.stop()
    write_result(args, p, "replicas", result)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
