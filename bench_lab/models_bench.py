"""Many models in one server: what loading a model costs, and what a second model
costs a workload. One tierlm server per round over a model folder of symlinks to
the models measured:

- loads: each model's first load in the server process (*cold*: the weights are
  likely in the OS page cache all the same, which only root can drop) and its
  loads after an unload (*warm*), through POST /v1/models/{id}/load and /unload;
- TTFT: a streamed chat request for a model that is not loaded (the request
  loads it) against the same request with the model loaded;
- mixed: `streams` concurrent streams, half to each of the first two models (both
  loaded), against the same streams all to the first; the arms alternate order
  each round.

The server's default `--model` is pinned (never unloaded), so it is a tiny
random-weight placeholder and every measured model can be unloaded and loaded.
Figures are medians over the rounds (and the repeats within a round). MLX is
imported inside the function that makes the placeholder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench_lab import lab_parser, write_result
from tierlm.bench.report import cpu_flags
from tierlm.bench.servers import RunningServer, tierlm_server
from tierlm.loadgen.client import LoadConfig, make_client, send
from tierlm.loadgen.metrics import RequestRecord, median, summarize
from tierlm.loadgen.workloads import BenchRequest, TokenSoup

DEFAULT_MODELS = ("SmolLM2-135M-Instruct", "gemma-3-270m")  # folders of tierlm's model folder
PLACEHOLDER = "placeholder-default"
ASK = [{"role": "user", "content": "Write a short poem about the sea."}]
ARMS = ("mixed", "single")


@dataclass
class ModelsBenchConfig:
    models: list[Path]  # model folders; the mixed arm uses the first two
    rounds: int = 3  # a fresh server each round
    repeats: int = 2  # warm loads, and TTFT pairs, per model per round
    streams: int = 8
    requests_per_stream: int = 2
    input_len: int = 128
    output_len: int = 64
    ttft_max_tokens: int = 8
    max_model_memory: str = "8GB"
    seed: int = 0
    server_args: list[str] = field(default_factory=list)


def model_dir(cfg: ModelsBenchConfig, work: Path) -> tuple[Path, Path]:
    """`work`/models: a symlink to each model; `work`/placeholder-default: the
    server's default model, a tiny random llama with the first model's tokenizer."""
    from tierlm.models.random_model import make_random_model

    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    for path in cfg.models:
        link = models / path.name
        if not link.exists():
            link.symlink_to(path.expanduser().resolve(), target_is_directory=True)
    placeholder = make_random_model("tiny", work / PLACEHOLDER, cfg.models[0].expanduser(), "float32")
    return models, placeholder


def server_spec(cfg: ModelsBenchConfig, work: Path, models: Path, placeholder: Path):
    (work / "settings.toml").write_text("")  # this run's settings, not the user's
    extra = [
        "--model-dir",
        str(models),
        "--no-hf-cache",
        "--keep-alive=-1",
        "--max-model-memory",
        cfg.max_model_memory,
        "--config",
        str(work / "settings.toml"),
        *cfg.server_args,
    ]
    spec = tierlm_server(placeholder, cfg.streams, extra)
    spec.env = {"HF_HUB_CACHE": str(work / "hf-cache")}
    return spec


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Models:
    """The server's model routes, timed."""

    def __init__(self, server: RunningServer):
        self.server = server
        self.http = httpx.Client(base_url=server.base_url + "/v1", timeout=600)

    def _post(self, path: str) -> tuple[float, dict]:
        tic = time.perf_counter()
        resp = self.http.post(path)
        elapsed = time.perf_counter() - tic
        if resp.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return elapsed, resp.json()

    def load(self, model: str) -> tuple[float, dict]:
        return self._post(f"/models/{model}/load")

    def unload(self, model: str) -> tuple[float, dict]:
        return self._post(f"/models/{model}/unload")

    def cards(self) -> dict[str, dict]:
        return {m["id"]: m for m in self.http.get("/models").json()["data"]}

    def rss(self) -> float | None:
        return rss_mib(self.server.proc.pid)

    def close(self) -> None:
        self.http.close()


def measure_loads(models: Models, order: list[str], repeats: int) -> list[dict]:
    """Each model's first load in this process, then `repeats` unload + load."""
    rows = []
    for name in order:
        state = models.cards()[name]["state"]
        if state != "available":
            raise RuntimeError(f"{name} is {state} before its first load: not a cold load")
        load_s, card = models.load(name)
        rows.append(
            {
                "model": name,
                "kind": "cold",
                "load_s": load_s,
                "unload_s": None,
                "memory_bytes": card.get("memory_bytes"),
                "rss_mib": models.rss(),
            }
        )
        for _ in range(repeats):
            unload_s, card = models.unload(name)
            rss_unloaded = models.rss()
            load_s, card = models.load(name)
            rows.append(
                {
                    "model": name,
                    "kind": "warm",
                    "load_s": load_s,
                    "unload_s": unload_s,
                    "memory_bytes": card.get("memory_bytes"),
                    "rss_mib": models.rss(),
                    "rss_unloaded_mib": rss_unloaded,
                }
            )
    return rows


def _ttft(base_url: str, model: str, max_tokens: int) -> RequestRecord:
    async def one() -> RequestRecord:
        cfg = LoadConfig(base_url=base_url, model=model)
        async with make_client(cfg, 2) as client:
            return await send(client, cfg, model, BenchRequest(max_tokens, messages=ASK))

    record = asyncio.run(one())
    if not record.ok:
        raise RuntimeError(f"TTFT request to {model}: {record.error}")
    return record


def measure_ttft(models: Models, order: list[str], repeats: int, max_tokens: int) -> list[dict]:
    """Per model, `repeats` times: unload, the request (it loads the model), the
    same request again (loaded)."""
    rows = []
    for name in order:
        for _ in range(repeats):
            models.unload(name)
            for arm in ("triggers load", "loaded"):
                r = _ttft(models.server.base_url, name, max_tokens)
                rows.append(
                    {"model": name, "arm": arm, "ttft_s": r.ttft, "e2e_s": r.e2e, "output_tokens": r.n_output}
                )
    return rows


def stream_plan(cfg: ModelsBenchConfig, soups: dict[str, TokenSoup], arm: str, names: list[str]):
    """Per stream, its model and its requests: in the mixed arm even streams go to
    the first model and odd ones to the second; in the single arm all to the first."""
    plan = []
    for i in range(cfg.streams):
        model = names[i % 2] if arm == "mixed" else names[0]
        soup = soups[model]
        reqs = [
            BenchRequest(
                cfg.output_len,
                messages=[{"role": "user", "content": soup.text(cfg.input_len)}],
                input_tokens=cfg.input_len,
            )
            for _ in range(cfg.requests_per_stream)
        ]
        plan.append((model, reqs))
    return plan


async def _run_streams(base_url: str, plan) -> tuple[list[tuple[str, RequestRecord]], float]:
    cfg = LoadConfig(base_url=base_url)  # greedy, EOS ignored: every request runs to max_tokens
    done: list[tuple[str, RequestRecord]] = []
    async with make_client(cfg, len(plan) + 4) as client:

        async def stream(model: str, reqs: list[BenchRequest]) -> None:
            for req in reqs:
                done.append((model, await send(client, cfg, model, req)))

        tic = time.perf_counter()
        await asyncio.gather(*(stream(m, reqs) for m, reqs in plan))
        return done, time.perf_counter() - tic


def measure_arm(base_url: str, plan, arm: str) -> dict:
    records, duration = asyncio.run(_run_streams(base_url, plan))
    summary = summarize([r for _, r in records], duration)
    per_model = {}
    for model in sorted({m for m, _ in records}):
        mine = [r for m, r in records if m == model]
        ok = [r for r in mine if r.ok]
        span = max((r.end for r in ok), default=0.0) - min((r.start for r in mine), default=0.0)
        s = summarize(mine, span)  # the model's tokens over its own requests' span
        per_model[model] = {
            "streams": sum(1 for m, _ in plan if m == model),
            "output_tok_s": s["output_tok_s"],
            "ttft_p50_s": s["ttft_s"]["p50"],
            "failed": s["failed"],
        }
    return {"arm": arm, "summary": summary, "per_model": per_model}


def _median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return median(values) if values else None


def summarize_runs(runs: list[dict], names: list[str]) -> dict:
    loads, ttft = {}, {}
    for name in names:
        rows = [r for run in runs for r in run["loads"] if r["model"] == name]
        cold = [r for r in rows if r["kind"] == "cold"]
        warm = [r for r in rows if r["kind"] == "warm"]
        loads[name] = {
            "cold_s": _median_of(cold, "load_s"),
            "warm_s": _median_of(warm, "load_s"),
            "unload_s": _median_of(warm, "unload_s"),
            "cold_n": len(cold),
            "warm_n": len(warm),
            "memory_bytes": _median_of(rows, "memory_bytes"),
        }
        t = [r for run in runs for r in run["ttft"] if r["model"] == name]
        ttft[name] = {
            "loaded_s": _median_of([r for r in t if r["arm"] == "loaded"], "ttft_s"),
            "triggers_load_s": _median_of([r for r in t if r["arm"] == "triggers load"], "ttft_s"),
            "n": sum(1 for r in t if r["arm"] == "loaded"),
        }
    mixed = {}
    for arm in ARMS:
        arms = [a for run in runs for a in run["mixed"] if a["arm"] == arm]
        s = [a["summary"] for a in arms]
        mixed[arm] = {
            "output_tok_s": median([x["output_tok_s"] for x in s]),
            "ttft_p50_s": median([x["ttft_s"]["p50"] for x in s]),
            "ttft_p90_s": median([x["ttft_s"]["p90"] for x in s]),
            "tpot_p50_s": median([x["tpot_s"]["p50"] for x in s]),
            "failed": sum(x["failed"] for x in s),
            "rounds": len(s),
            "per_model": {
                m: {
                    "streams": arms[0]["per_model"][m]["streams"],
                    "output_tok_s": median([a["per_model"][m]["output_tok_s"] for a in arms]),
                    "ttft_p50_s": median([a["per_model"][m]["ttft_p50_s"] for a in arms]),
                }
                for m in (arms[0]["per_model"] if arms else {})
            },
        }
    return {"loads": loads, "ttft": ttft, "mixed": mixed}


def run_models_bench(cfg: ModelsBenchConfig, work: Path | None = None, on_progress=print) -> dict:
    """All rounds; the result file's body (write_json adds the machine)."""
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tierlm-bench-models-"))
    try:
        models_dir, placeholder = model_dir(cfg, work)
        names = [p.name for p in cfg.models]
        soups = {p.name: TokenSoup(p.expanduser(), seed=cfg.seed) for p in cfg.models}
        spec = server_spec(cfg, work, models_dir, placeholder)
        runs = []
        for rnd in range(cfg.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            arms = ARMS if rnd % 2 == 0 else ARMS[::-1]
            loadavg = os.getloadavg()[0]
            with RunningServer(spec, log_dir=work) as server:
                models = Models(server)
                try:
                    loads = measure_loads(models, order, cfg.repeats)
                    on_progress(
                        f"round {rnd + 1}: loads "
                        + ", ".join(f"{r['model']} {r['kind']} {r['load_s']:.2f} s" for r in loads)
                    )
                    ttft = measure_ttft(models, order, cfg.repeats, cfg.ttft_max_tokens)
                    on_progress(
                        f"round {rnd + 1}: TTFT "
                        + ", ".join(f"{r['model']} {r['arm']} {1000 * r['ttft_s']:.0f} ms" for r in ttft)
                    )
                    for name in names[:2]:
                        models.load(name)
                    cards = models.cards()
                    mixed = []
                    for arm in arms:
                        plan = stream_plan(cfg, soups, arm, names)
                        mixed.append(measure_arm(server.base_url, plan, arm))
                        s = mixed[-1]["summary"]
                        on_progress(
                            f"round {rnd + 1}: {arm} {s['output_tok_s']:.1f} tok/s, TTFT p50 "
                            f"{1000 * s['ttft_s']['p50']:.0f} ms, failed {s['failed']}"
                        )
                    runs.append(
                        {
                            "round": rnd,
                            "order": order,
                            "loadavg_1m_before": loadavg,
                            "rss_end_mib": models.rss(),
                            "loads": loads,
                            "ttft": ttft,
                            "mixed": mixed,
                            "cards": {n: cards[n] for n in names},
                        }
                    )
                finally:
                    models.close()
        return {
            "models": [
                {
                    "id": p.name,
                    "path": str(p),
                    "size_bytes": runs[0]["cards"][p.name]["size_bytes"] if runs else None,
                    "quantization": runs[0]["cards"][p.name]["quantization"] if runs else None,
                }
                for p in cfg.models
            ],
            "default_model": PLACEHOLDER,
            "device": _device(),
            "cpu_flags": cpu_flags(),
            "config": {
                k: (v if not isinstance(v, list) else [str(x) for x in v]) for k, v in asdict(cfg).items()
            },
            "server_cmd": spec.cmd,
            "runs": runs,
            "summary": summarize_runs(runs, names),
        }
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _device() -> str:
    import mlx.core as mx

    return str(mx.default_device())


# ---- tables -------------------------------------------------------------------

LOAD_HEADER = [
    "model",
    "size MiB",
    "memory MiB",
    "cold load s",
    "warm load s",
    "cold ÷ warm",
    "unload s",
    "TTFT loaded ms",
    "TTFT that loads ms",
    "difference ms",
]
MIXED_HEADER = [
    "arm",
    "streams",
    "out tok/s",
    "÷ single",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TPOT p50 ms",
    "TTFT p50 per model ms",
    "failed",
]


def load_rows(result: dict) -> list[list[str]]:
    from tierlm.bench.report import ms, num, ratio

    rows = []
    sizes = {m["id"]: m.get("size_bytes") for m in result["models"]}
    for name, s in result["summary"]["loads"].items():
        t = result["summary"]["ttft"][name]
        size, mem = sizes.get(name), s.get("memory_bytes")
        diff = (
            None
            if t["triggers_load_s"] is None or t["loaded_s"] is None
            else t["triggers_load_s"] - t["loaded_s"]
        )
        rows.append(
            [
                name,
                num(size / 2**20, 0) if size else "-",
                num(mem / 2**20, 0) if mem else "-",
                num(s["cold_s"], 2),
                num(s["warm_s"], 2),
                num(ratio(s["cold_s"], s["warm_s"]), 2),
                num(s["unload_s"], 2),
                ms(t["loaded_s"]),
                ms(t["triggers_load_s"]),
                ms(diff),
            ]
        )
    return rows


def mixed_rows(result: dict) -> list[list[str]]:
    from tierlm.bench.report import ms, num, ratio

    mixed = result["summary"]["mixed"]
    single = mixed.get("single", {}).get("output_tok_s")
    rows = []
    for arm in ARMS:
        m = mixed.get(arm)
        if not m:
            continue
        split = " + ".join(f"{v['streams']} {k}" for k, v in m["per_model"].items())
        per = ", ".join(ms(v.get("ttft_p50_s")) for v in m["per_model"].values())
        rows.append(
            [
                arm,
                split,
                num(m["output_tok_s"]),
                num(ratio(m["output_tok_s"], single), 2),
                ms(m["ttft_p50_s"]),
                ms(m["ttft_p90_s"]),
                ms(m["tpot_p50_s"]),
                per,
                str(m["failed"]),
            ]
        )
    return rows


def title(doc: dict) -> str:
    names = " + ".join(f"`{m['id']}`" for m in doc["models"])
    return f"Many models, one server: {names} on {doc['device']}"


def describe(doc: dict) -> str:
    c = doc["config"]
    loadavg = [r["loadavg_1m_before"] for r in doc["runs"]]
    first, second = (doc["models"] + [{"id": "?"}] * 2)[:2]
    return (
        f"CPU flags: {doc.get('cpu_flags', '?')}. {c['rounds']} rounds, a fresh server each "
        f"(1-minute load average before them: {', '.join(f'{x:.2f}' for x in loadavg)}); medians. "
        f"*Cold*: a model's first load in the server process, by `POST /v1/models/{{id}}/load` (its files "
        "are likely in the OS page cache all the same: dropping that needs root); *warm*: a load after "
        f"an unload, {c['repeats']} per model per round. *Memory*: what the pool measured loading it. "
        f"*TTFT*: a streamed chat request of {c['ttft_max_tokens']} tokens; *that loads*: sent while the "
        f"model is unloaded (a warm load), *loaded*: the same request right after. The server's default "
        f"model is a tiny random-weight placeholder: the default is pinned and could not be unloaded.\n\n"
        f"Mixed: {c['streams']} concurrent streams of {c['requests_per_stream']} chat requests each "
        f"({c['input_len']} random tokens → {c['output_len']} greedy tokens, EOS ignored); *mixed*: half "
        f"the streams to `{first['id']}`, half to `{second['id']}`, both loaded; *single*: all to "
        f"`{first['id']}`; the arms alternate order each round. Tok/s: all output tokens over the wall time.\n"
    )


def markdown(doc: dict) -> str:
    from tierlm.bench.report import markdown_table

    return "\n".join(
        [
            describe(doc),
            markdown_table(LOAD_HEADER, load_rows(doc)),
            "",
            markdown_table(MIXED_HEADER, mixed_rows(doc)),
            "",
        ]
    )


def print_tables(result: dict) -> None:
    from tierlm.bench.report import machine_info, print_table

    cpu = machine_info().get("cpu", "?")
    c = result["config"]
    print_table(
        f"model loads and TTFT on {result['device']}, {cpu} ({result['cpu_flags']}); medians of "
        f"{c['rounds']} rounds",
        LOAD_HEADER,
        load_rows(result),
    )
    print_table(
        f"{c['streams']} streams: two models vs one (medians of {c['rounds']} rounds)",
        MIXED_HEADER,
        mixed_rows(result),
    )


def default_models() -> list[Path]:
    from tierlm.config import HOME

    return [HOME / "models" / name for name in DEFAULT_MODELS]


def dumps(result: dict) -> str:
    return json.dumps(result, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    import shlex

    p = lab_parser("bench_lab.models_bench", __doc__)
    p.add_argument("--models", default=None, help="comma list of model folders (default: SmolLM2-135M-Instruct,"
                   "gemma-3-270m in tierlm's model folder); the mixed workload uses the first two")
    p.add_argument("--rounds", type=int, default=3, help="a fresh server each; arms alternate each round")
    p.add_argument("--repeats", type=int, default=2, help="warm loads and TTFT pairs per model per round")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-max-tokens", type=int, default=8)
    p.add_argument("--max-model-memory", default="8GB")
    p.add_argument("--tierlm-args", default="", help="extra flags for tierlm serve")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    from tierlm.bench.report import console

    models = [Path(m).expanduser() for m in args.models.split(",")] if args.models else default_models()
    cfg = ModelsBenchConfig(models, args.rounds, args.repeats, args.streams, args.requests_per_stream,
                            args.input_len, args.output_len, args.ttft_max_tokens, args.max_model_memory,
                            server_args=shlex.split(args.tierlm_args))
    result = run_models_bench(cfg, on_progress=lambda line: console.print("  " + line))
    print_tables(result)
    write_result(args, p, "models", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
