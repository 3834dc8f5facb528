"""Soak: a seeded chaos run against one tierlm server, counting what was lost.

`python -m bench_lab.soak` starts a tierlm server on 127.0.0.1 (or targets one there
with --base-url, and --pid for its memory), then:

1. runs every distinct greedy request of the mix alone, one after another, for
   its reference answer (temperature 0, a fixed max_tokens);
2. sends N requests (default 1,000) over C streams (default 16) from a seeded
   mix: plain chat, streamed chat, streams the client drops after a few chunks,
   requests with a short client timeout, invalid bodies (a 4xx is expected),
   and shared-prefix requests (one long system prompt, different questions);
3. waits for the server to go idle, reads its RSS, clears the prefix cache
   (DELETE /v1/cache) and reads it again.

It reports the status codes, every 5xx, hung requests (no answer within
--hang-s), answers under load that differ from the same request alone (a
dropped stream's text must be a prefix of it), and RSS before the run, after
it, and after the clear (from /proc/PID/status), and writes it all as JSON.
Every loop here is bounded: N requests at most, --max-duration-s for the load,
--hang-s per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench_lab import lab_parser
from tierlm.loadgen.client import LoadConfig, chunk_text, make_client, served_model_id

MIX = {  # shares of the N requests
    "normal": 0.24,
    "stream": 0.20,
    "disconnect": 0.12,
    "timeout": 0.10,
    "invalid": 0.12,
    "shared_prefix": 0.22,
}

TOPICS = [
    "the moon", "bread", "rivers", "a lighthouse", "bicycles", "winter", "honeybees", "the ocean",
    "libraries", "volcanoes", "trains", "coffee", "mountains", "a garden", "clocks", "music",
    "the desert", "owls", "rain", "chess", "bridges", "paper", "the wind", "maps",
]
TEMPLATES = [
    "Write two sentences about {t}.",
    "What is {a} plus {b}? Answer, then explain in one sentence.",
    "Give three facts about {t}.",
    "Describe {t} to a child.",
    "List four words that rhyme with {w}.",
    "Why do people like {t}? Be brief.",
]
RHYMES = ["cat", "light", "day", "tree", "cake", "sun", "ring", "stone"]

# bodies a correct server answers with a 4xx: (path, method, body); bytes go as they are
INVALID = [
    ("/chat/completions", "POST", b"{not json"),
    ("/chat/completions", "POST", {"messages": []}),
    ("/chat/completions", "POST", {"messages": "hello"}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}),
    ("/chat/completions", "POST", {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 4}),
    ("/chat/completions", "GET", None),
    ("/completions", "POST", {"prompt": "", "max_tokens": 4}),
    ("/completions", "POST", {"prompt": [10**9], "max_tokens": 4}),
    ("/completions", "POST", {"max_tokens": 4}),
    ("/no-such-route", "POST", {"prompt": "hi"}),
]


@dataclass
class SoakRequest:
    index: int
    kind: str
    path: str = "/chat/completions"
    method: str = "POST"
    body: dict | bytes | None = None
    ref: str | None = None  # key of the reference answer its text must equal
    stream: bool = False
    disconnect_after: int = 0  # content chunks read before the client drops the stream
    client_timeout_s: float | None = None  # the client gives up after this


@dataclass
class Outcome:
    index: int
    kind: str
    stream: bool
    # ok | rejected (4xx, expected for invalid) | disconnected | client_timeout | hung
    # | http_error (a status nobody expected) | stream_error (an error event in a stream)
    # | transport_error (connection reset, bad JSON from the server)
    outcome: str = "ok"
    status: int | None = None
    text: str = ""
    completion_tokens: int | None = None
    seconds: float = 0.0
    ref: str | None = None
    match: bool | None = None  # text equals the reference (a prefix of it, for a dropped stream)
    detail: str | None = None

    @property
    def ok(self) -> bool:  # for report.progress_bar
        return self.outcome in ("ok", "rejected", "disconnected", "client_timeout") and self.match is not False


@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 16
    seed: int = 0
    max_tokens: int = 32
    questions: int = 24  # distinct greedy chat prompts
    prefix_questions: int = 12  # distinct questions after the shared system prompt
    prefix_len: int = 600  # tokens of the shared system prompt
    hang_s: float = 180.0  # a request with no answer by then is hung
    timeout_range_s: tuple[float, float] = (0.05, 2.0)  # the short client timeouts
    max_duration_s: float = 3600.0  # no new request after this
    settle_s: float = 3.0  # wait before each RSS reading once idle
    mix: dict = field(default_factory=lambda: dict(MIX))


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def cpu_counters(pid: int | None) -> dict[str, float] | None:
    """The process's user and system CPU seconds and minor page faults so far."""
    if not pid:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"user_s": int(fields[11]) / tick, "sys_s": int(fields[12]) / tick, "minflt": int(fields[7])}


def _delta(a: dict | None, b: dict | None) -> dict | None:
    return {k: round(b[k] - a[k], 2) for k in a} if a and b else None


class RssSampler:
    """Reads the server's RSS (MiB) once a second on a thread while the load runs."""

    def __init__(self, pid: int | None, every_s: float = 1.0):
        self.pid, self.every_s, self.samples = pid, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                rss = round(rss_kib(self.pid)["VmRSS"] / 1024, 1)
                self.samples.append((round(time.monotonic() - self._t0, 1), rss))  # seconds, MiB
            except (OSError, KeyError):
                return

    def __enter__(self) -> RssSampler:  # noqa: PYI034
        if self.pid:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _question(rng: random.Random) -> str:
    template = rng.choice(TEMPLATES)
    return template.format(t=rng.choice(TOPICS), a=rng.randint(2, 99), b=rng.randint(2, 99), w=rng.choice(RHYMES))


def build_mix(cfg: SoakConfig, system_prompt: str) -> tuple[list[SoakRequest], dict[str, dict]]:
    """The N requests in sending order, and the bodies of the distinct greedy requests
    whose answers are the references (keyed by ref)."""
    rng = random.Random(cfg.seed)
    greedy = {"temperature": 0, "max_tokens": cfg.max_tokens}
    refs: dict[str, dict] = {}
    seen: set[str] = set()
    while len(refs) < cfg.questions:
        q = _question(rng)
        if q not in seen:
            seen.add(q)
            refs[f"q{len(refs)}"] = {"messages": [{"role": "user", "content": q}], **greedy}
    plain = list(refs)
    while len(refs) < cfg.questions + cfg.prefix_questions:
        q = _question(rng)
        if q not in seen:
            seen.add(q)
            messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}]
            refs[f"p{len(refs) - cfg.questions}"] = {"messages": messages, **greedy}
    prefixed = [k for k in refs if k.startswith("p")]

    kinds = list(cfg.mix)
    weights = [cfg.mix[k] for k in kinds]
    out = []
    for i in range(cfg.requests):
        kind = rng.choices(kinds, weights)[0]
        req = SoakRequest(i, kind)
        if kind == "invalid":
            req.path, req.method, req.body = rng.choice(INVALID)
        else:
            req.ref = rng.choice(prefixed if kind == "shared_prefix" else plain)
            req.stream = kind in ("stream", "disconnect") or (kind in ("timeout", "shared_prefix") and rng.random() < 0.5)
            req.body = dict(refs[req.ref])
            if kind == "disconnect":
                req.disconnect_after = rng.randint(1, 4)
            if kind == "timeout":
                req.client_timeout_s = round(rng.uniform(*cfg.timeout_range_s), 3)
        if req.stream:
            req.body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
        out.append(req)
    return out, refs


async def _exchange(client: httpx.AsyncClient, v1: str, model: str, req: SoakRequest, out: Outcome) -> None:
    """One request; fills `out` as it goes, so a cancelled one keeps what came."""
    body = req.body
    if isinstance(body, dict) and req.kind != "invalid":
        body = {"model": model, **body}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    if isinstance(body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}
    async with client.stream(req.method, v1 + req.path, **kwargs) as resp:
        out.status = resp.status_code
        if resp.status_code != 200 or not req.stream:
            raw = await resp.aread()
            if resp.status_code != 200:
                out.outcome = "rejected" if 400 <= resp.status_code < 500 else "http_error"
                out.detail = raw.decode(errors="replace")[:300]
                return
            data = json.loads(raw)
            out.text = data["choices"][0]["message"]["content"] or ""
            out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
            return
        chunks, done = 0, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.outcome, out.detail = "stream_error", str(chunk["error"])[:300]
                return
            piece = chunk_text(chunk)
            if piece:
                out.text += piece
                chunks += 1
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"].get("completion_tokens")
            if req.disconnect_after and chunks >= req.disconnect_after:
                out.outcome = "disconnected"  # leaving the block closes the connection
                return
        if not done:
            out.outcome, out.detail = "transport_error", "stream ended without [DONE]"


async def send_one(client: httpx.AsyncClient, v1: str, model: str, req: SoakRequest, hang_s: float) -> Outcome:
    out = Outcome(req.index, req.kind, req.stream, ref=req.ref)
    t0 = time.perf_counter()
    limit = min(req.client_timeout_s or hang_s, hang_s)
    try:
        await asyncio.wait_for(_exchange(client, v1, model, req, out), limit)
    except TimeoutError:
        out.outcome = "client_timeout" if req.client_timeout_s else "hung"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as e:
        out.outcome, out.detail = "transport_error", f"{type(e).__name__}: {e}"[:300]
    out.seconds = time.perf_counter() - t0
    return out


def check_answer(out: Outcome, references: dict[str, str]) -> None:
    """Sets out.match: a finished greedy answer equals its reference; a dropped or
    timed-out stream's text is a prefix of it."""
    if out.ref is None or out.ref not in references:
        return
    ref = references[out.ref]
    if out.outcome == "ok":
        out.match = out.text == ref
    elif out.outcome in ("disconnected", "client_timeout") and out.text:
        out.match = ref.startswith(out.text)


async def _idle(client: httpx.AsyncClient, base: str, limit_s: float = 120.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            engines = (await client.get(base + "/stats")).json()["engines"]
            if all(e["running"] + e["prefilling"] + e["waiting"] == 0 for e in engines):
                return True
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return False


def _rss_mib(pid: int | None) -> float | None:
    return round(rss_kib(pid)["VmRSS"] / 1024, 1) if pid else None


async def run_soak(base_url: str, pid: int | None, cfg: SoakConfig, system_prompt: str, on_done=None,
                   log=print) -> dict:
    """The whole soak against a server already up at `base_url` (process `pid`)."""
    requests, ref_bodies = build_mix(cfg, system_prompt)
    load_cfg = LoadConfig(base_url=base_url, timeout_s=cfg.hang_s)
    base = base_url.rstrip("/").removesuffix("/v1")
    async with make_client(load_cfg, cfg.concurrency + 4) as client:
        model = await served_model_id(client, load_cfg)
        # references, alone and one at a time (this also warms the server up)
        references, ref_runs = {}, []
        for key, body in ref_bodies.items():
            out = await send_one(client, load_cfg.v1, model, SoakRequest(-1, "reference", body=body, ref=key),
                                 cfg.hang_s)
            if out.outcome != "ok":
                raise RuntimeError(f"reference {key} failed alone: {out.outcome} {out.status} {out.detail}")
            references[key] = out.text
            ref_runs.append(out)
        log(f"{len(references)} reference answers, alone")
        await _idle(client, base)
        await asyncio.sleep(cfg.settle_s)
        rss_before = _rss_mib(pid)
        log(f"RSS before: {rss_before} MiB")

        queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)
        outcomes: list[Outcome] = []
        deadline = time.monotonic() + cfg.max_duration_s

        async def stream_worker() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                req = queue.get_nowait()
                out = await send_one(client, load_cfg.v1, model, req, cfg.hang_s)
                check_answer(out, references)
                outcomes.append(out)
                if on_done:
                    on_done(out)

        t0, cpu0 = time.perf_counter(), cpu_counters(pid)
        with RssSampler(pid) as sampler:
            await asyncio.gather(*(stream_worker() for _ in range(cfg.concurrency)))
            duration = time.perf_counter() - t0
            idle = await _idle(client, base)
        server_cpu = _delta(cpu0, cpu_counters(pid))
        await asyncio.sleep(cfg.settle_s)
        rss_after = _rss_mib(pid)
        cache_stats = (await client.get(load_cfg.v1 + "/cache/stats")).json().get("prefix_cache")
        cleared = (await client.delete(load_cfg.v1 + "/cache")).json()
        await asyncio.sleep(cfg.settle_s)
        rss_after_clear = _rss_mib(pid)
        server_stats = (await client.get(base + "/stats")).json()
        health = (await client.get(base + "/health")).status_code
        log(f"RSS after: {rss_after} MiB, after clearing the cache: {rss_after_clear} MiB")

        # the same requests alone again, after all that: the server's state must not have drifted
        post = []
        for key in list(references)[:: max(1, len(references) // 6)]:
            out = await send_one(client, load_cfg.v1, model, SoakRequest(-1, "reference", body=ref_bodies[key],
                                                                         ref=key), cfg.hang_s)
            check_answer(out, references)
            post.append(out)

    outcomes.sort(key=lambda o: o.index)
    return summarize(cfg, requests, outcomes, ref_runs, post, duration, idle, pid,
                     {"before": rss_before, "after": rss_after, "after_clear": rss_after_clear,
                      "peak_during": max((s[1] for s in sampler.samples), default=None),
                      "series": sampler.samples[:: max(1, len(sampler.samples) // 200)]},
                     cache_stats, cleared, {**server_stats, "health_status": health}, server_cpu)


def _tok_s(outs: list[Outcome]) -> float | None:
    rates = [o.completion_tokens / o.seconds for o in outs if o.outcome == "ok" and o.completion_tokens and o.seconds]
    return round(statistics.median(rates), 2) if rates else None


def summarize(cfg, requests, outcomes, ref_runs, post, duration, idle, pid, rss, cache_stats, cleared,
              server_stats, server_cpu=None) -> dict:
    statuses = Counter(str(o.status) if o.status is not None else "none" for o in outcomes)
    by_kind = {k: dict(Counter(o.outcome for o in outcomes if o.kind == k)) for k in cfg.mix}
    five_xx = [o for o in outcomes if o.status is not None and o.status >= 500]
    hung = [o for o in outcomes if o.outcome == "hung"]
    mismatched = [o for o in outcomes if o.match is False]
    unexpected = [o for o in outcomes if o.outcome in ("http_error", "stream_error", "transport_error")
                  or (o.kind == "invalid" and o.outcome != "rejected")
                  or (o.kind != "invalid" and o.outcome == "rejected")]
    by_index = {r.index: r for r in requests}

    def short(x):  # the shared system prompt and the over-long prompt, named instead of quoted
        if isinstance(x, str) and len(x) > 200:
            return f"{x[:60]}... <{len(x)} characters>"
        if isinstance(x, dict):
            return {k: short(v) for k, v in x.items()}
        return [short(v) for v in x] if isinstance(x, list) else x

    def show(o: Outcome) -> dict:
        r = by_index[o.index]
        body = short(r.body.decode(errors="replace") if isinstance(r.body, bytes) else r.body)
        return {**asdict(o), "request": {"path": r.path, "method": r.method, "body": body,
                                         "disconnect_after": r.disconnect_after,
                                         "client_timeout_s": r.client_timeout_s}}

    completed = [o for o in outcomes if o.outcome == "ok"]
    tokens = sum(o.completion_tokens or 0 for o in completed)
    rss_growth = {}
    if rss["before"]:
        rss_growth = {"after_pct": round(100 * (rss["after"] / rss["before"] - 1), 1),
                      "after_clear_pct": round(100 * (rss["after_clear"] / rss["before"] - 1), 1)}
    return {
        "config": {**asdict(cfg), "server_pid": pid},
        "requests_sent": len(outcomes),
        "requests_planned": len(requests),
        "duration_s": round(duration, 1),
        "idle_after": idle,
        "status_codes": dict(sorted(statuses.items())),
        "outcomes": dict(Counter(o.outcome for o in outcomes)),
        "by_kind": by_kind,
        "five_xx": len(five_xx),
        "hung": len(hung),
        "mismatched": len(mismatched),
        "unexpected": len(unexpected),
        "greedy_checked": sum(o.match is not None for o in outcomes),
        "post_alone_mismatched": sum(o.match is False for o in post),
        "rss_mib": rss,
        "rss_growth": rss_growth,
        "throughput": {
            "output_tok_s_under_load": round(tokens / duration, 1) if duration else None,
            "completed": len(completed),
            "alone_tok_s_median": _tok_s(ref_runs),
            "normal_tok_s_median_under_load": _tok_s([o for o in completed if o.kind == "normal"]),
            "server_cpu_during_load": server_cpu,  # user and sys seconds, minor page faults
        },
        "prefix_cache_before_clear": cache_stats,
        "cleared": cleared,
        "server_stats": server_stats,
        "problems": [show(o) for o in five_xx + hung + mismatched + unexpected][:50],
        "references": {k: o.text for k, o in zip([o.ref for o in ref_runs], ref_runs)},
    }


def _local_only(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"bench soak only targets this machine (127.0.0.1), not {host}")


def cmd_soak(args, command: str, tokenizer: str) -> int:
    """Starts the server (or targets --base-url), soaks it, prints and saves; `command`:
    the command line, for the result file; `tokenizer`: the folder its prompts come from."""
    from tierlm.bench.report import console, print_table, progress_bar, write_json
    from tierlm.bench.servers import RunningServer, default_model_folder, tierlm_server
    from tierlm.loadgen.workloads import TokenSoup

    cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                     max_tokens=args.max_tokens, prefix_len=args.prefix_len, hang_s=args.hang_s,
                     max_duration_s=args.max_duration_s)
    if cfg.requests > 100_000 or cfg.concurrency > 256:
        raise SystemExit("bench soak: at most 100,000 requests over 256 streams")
    soup = TokenSoup(tokenizer, seed=cfg.seed)
    system_prompt = "You are a careful assistant. Reference notes follow. " + soup.text(cfg.prefix_len)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    server = None
    if args.base_url:
        _local_only(args.base_url)
        base_url, pid = args.base_url, args.pid
    else:
        model = Path(args.model).expanduser() if args.model else default_model_folder()
        spec = tierlm_server(model, args.max_concurrent or cfg.concurrency, args.tierlm_args.split())
        spec.env.update(env)
        server = RunningServer(spec).start()
        base_url, pid = server.base_url, server.proc.pid
        console.print(f"tierlm up at {base_url}, pid {pid}, log {server.log_path}")
    try:
        with progress_bar(cfg.requests, f"soak c={cfg.concurrency}", args.progress) as done:
            result = asyncio.run(run_soak(base_url, pid, cfg, system_prompt, done, console.print))
    finally:
        if server is not None:
            result_log = server.log_tail(4000)
            server.stop()
    if server is not None:
        result["server_log_tail"] = result_log
        result["server_env"] = env
        result["tierlm_args"] = args.tierlm_args
    rss = result["rss_mib"]
    print_table(
        f"soak: {result['requests_sent']} requests, {cfg.concurrency} streams, {result['duration_s']} s",
        ["", "value"],
        [
            ["status codes", json.dumps(result["status_codes"])],
            ["outcomes", json.dumps(result["outcomes"])],
            ["5xx", str(result["five_xx"])],
            ["hung", str(result["hung"])],
            ["mismatched answers", f"{result['mismatched']} of {result['greedy_checked']} checked"],
            ["unexpected outcomes", str(result["unexpected"])],
            ["alone again after the run, mismatched", str(result["post_alone_mismatched"])],
            ["RSS before / after / after clear (MiB)", f"{rss['before']} / {rss['after']} / {rss['after_clear']}"],
            ["RSS peak during the run (MiB)", str(rss["peak_during"])],
            ["output tok/s under load", str(result["throughput"]["output_tok_s_under_load"])],
            ["tok/s alone / normal requests under load (medians)",
             f"{result['throughput']['alone_tok_s_median']} / {result['throughput']['normal_tok_s_median_under_load']}"],
            ["server CPU during the load", json.dumps(result["throughput"]["server_cpu_during_load"])],
        ],
    )
    for p in result["problems"][:10]:
        console.print(f"[red]problem[/red] #{p['index']} {p['kind']}: {p['outcome']} {p['status']} {p['detail']}")
    if args.json:
        console.print(f"wrote {write_json(args.json, 'soak', result, command)}")
    clean = not (result["five_xx"] or result["hung"] or result["mismatched"] or result["unexpected"]
                 or result["post_alone_mismatched"])
    within = not rss["before"] or abs(result["rss_growth"]["after_clear_pct"]) <= args.rss_tolerance_pct
    return 0 if clean and within else 1


def main(argv: list[str] | None = None) -> int:
    p = lab_parser("bench_lab.soak", __doc__)
    p.add_argument("--base-url", default=None, help="a server on 127.0.0.1 (default: start tierlm here)")
    p.add_argument("--pid", type=int, default=None, help="with --base-url: its process, for RSS")
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--tierlm-args", default="", help="extra flags for tierlm serve")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the started server (repeatable)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="the server's --max-concurrent-requests (default: --concurrency)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=600, help="tokens of the shared system prompt")
    p.add_argument("--hang-s", type=float, default=180.0, help="no answer by then: hung")
    p.add_argument("--max-duration-s", type=float, default=3600.0, help="no new request after this")
    p.add_argument("--rss-tolerance-pct", type=float, default=5.0, help="RSS after the clear vs before")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    from tierlm.bench import runs

    return cmd_soak(args, runs.command_line(p.prog), runs.default_tokenizer(args))


if __name__ == "__main__":
    raise SystemExit(main())
