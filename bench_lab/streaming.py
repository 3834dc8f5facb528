"""How tokens reach a client, and how the first requests after a start fare:
`python -m bench_lab.streaming`.

- *Smoothness*: for each tree (this one, and `--base-tree` for a before/after in
  one run; or this tree with `--base-args` instead of `--tierlm-args`, for a
  setting's before/after), one `tierlm serve` and the workload at each concurrency: the median
  gap between two streamed chunks (ITL p50) against the time per output token
  (TPOT p50). A server that streams every token has ITL ≈ TPOT; one that hands
  out a burst of tokens at a time has ITL ≈ burst. With `--base-tree`,
  `--rounds N` serves each tree N times, the order turned each round (base
  first, then this tree first, ...): on some machines the second of two servers
  started one after the other reads 10-25% lower whichever tree it is. The
  table gives each figure's median over the rounds, and each round's ratio.
- *Cold start*: at each `--cold` concurrency, a fresh `tierlm serve` and two runs
  of the workload, the first as soon as it is ready: first ÷ second output tok/s.
  Every run of the benchmark draws its own prompts (the same lengths, another
  seed), so no run finds another's blocks in the prefix cache, hot or on disk.
  `--cold-kernels fresh` gives each start an empty kernel folder (the first start
  on a machine); `kept` leaves the server its own (`kernel_cache_dir`), filled by
  a start that ran the workload once before them (a restart). Each is repeated
  `--cold-repeats` times: one pair of short runs on a shared machine varies by
  tens of percent, the median of a few does not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

from bench_lab import lab_parser, write_result
from tierlm.bench import runs, servers
from tierlm.bench.cli import add_load_args
from tierlm.bench.report import console, markdown_table, ms, num, ratio
from tierlm.config import Settings

SMOOTH_TARGET = ("Times in ms. Target: ITL p50 ≤ 2 × TPOT p50 at 1 and 4 streams, aggregate tok/s at 32 "
                 "streams no lower than before.\n")
COLD_TARGET = ("Cold start (target: first ÷ second ≥ 0.9). *fresh*: an empty kernel folder, as at the first "
               "start on a machine; *kept*: the folder of the starts before, as at a restart.\n")


class Side(NamedTuple):
    """One of the servers compared: its name in the results, its tree (None:
    this one) and its flags for tierlm serve."""
    name: str
    tree: Path | None
    flags: str


def sides(args) -> list[Side]:
    """The servers compared, base first: `--base-tree` and/or `--base-args`
    (the same tree with other flags) against this tree with `--tierlm-args`."""
    this = Side("this", None, args.tierlm_args)
    if args.base_tree is None and args.base_args is None:
        return [this]
    tree = Path(args.base_tree).resolve() if args.base_tree else None
    return [Side("base", tree, args.tierlm_args if args.base_args is None else args.base_args), this]


def _spec(args, side: Side, top: int, kernels: str | None) -> servers.ServerSpec:
    model = Path(args.model).expanduser() if args.model else servers.default_model_folder()
    spec = servers.tierlm_server(model, top, side.flags.split())
    tree = side.tree
    env = {}
    if tree is not None:  # the other tree's tierlm first on the path (this one is installed)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
        spec.cwd = str(tree)
    if kernels is not None:
        env["MLX_PTX_CACHE_DIR"] = kernels
    spec.env = env
    spec.name = side.name
    return spec


def _row(run: dict) -> dict:
    s = run["summary"]
    return {
        "concurrency": run["concurrency"],
        "output_tok_s": s["output_tok_s"],
        "ttft_p50": s["ttft_s"]["p50"],
        "tpot_p50": s["tpot_s"]["p50"],
        "itl_p50": s["itl_s"]["p50"],
        "itl_p99": s["itl_s"]["p99"],
        "failed": s["failed"],
    }


def _health(server) -> dict:
    return httpx.get(server.base_url + "/health", timeout=10).json()


def _warmup_of(server) -> dict | None:
    """What the served engine says of its warming (None: a tree before it)."""
    engines = httpx.get(server.base_url + "/stats", timeout=10).json().get("engines") or [{}]
    return engines[0].get("warmup")


def wait_warm(server, timeout_s: float = 300.0) -> float:
    """Until the server no longer says it is warming; the seconds waited."""
    tic = time.monotonic()
    while _health(server).get("warming") and time.monotonic() - tic < timeout_s:
        time.sleep(0.5)
    return time.monotonic() - tic


def smoothness(args, side: Side, concurrencies: list[int], tokenizer: str) -> list[dict]:
    """Steady state: timed once the server has warmed its batch shapes."""
    spec = _spec(args, side, max(concurrencies), None)
    console.print(f"smoothness: starting tierlm ({spec.name}: {side.tree or 'this tree'} {side.flags})")
    rows = []
    with servers.RunningServer(spec) as server:
        console.print(f"  warmed after {wait_warm(server):.1f} s more")
        for c in concurrencies:
            row = _row(runs.run_one(naming(args, server), server.base_url, tokenizer, c, label=spec.name))
            rows.append(row)
            console.print(f"  c={c}: ITL p50 {ms(row['itl_p50'])} ms, TPOT p50 {ms(row['tpot_p50'])} ms, "
                          f"{num(row['output_tok_s'])} out tok/s")
    return rows


def naming(args, server):
    """`args` with the model the server was started with named for its requests:
    an older tree's /v1/models lists its folder's models by name, the default
    not first, and the load generator would take whichever sorts first."""
    named = copy.copy(args)
    named.model_id = server.served_model_id()
    return named


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Each concurrency's figures, the median over the rounds' rows (failed requests: their sum)."""
    def merged(key, rows):
        values = [r[key] for r in rows]
        return values[0] if key == "concurrency" else sum(values) if key == "failed" else statistics.median(values)
    return [{key: merged(key, rows) for key in rows[0]} for rows in zip(*rounds)]


def new_prompts(args, seeds: itertools.count):
    """`args` with a seed no run has used yet: prompts of the same lengths that no
    earlier run left in the prefix cache (hot, or on disk from an earlier start)."""
    fresh = copy.copy(args)
    fresh.seed = args.seed + next(seeds)
    fresh.warmup = 0  # the first request timed is the first the server sees
    return fresh


def cold_start(args, concurrency: int, kernels: str, tokenizer: str, seeds: itertools.count) -> dict:
    fresh = tempfile.TemporaryDirectory(prefix="tierlm-kernels-") if kernels == "fresh" else None
    spec = _spec(args, sides(args)[-1], concurrency, fresh.name if fresh else None)
    folder = Path(fresh.name) if fresh else Path(Settings().kernel_cache_dir).expanduser()
    with fresh or contextlib.nullcontext(), servers.RunningServer(spec) as server:
        at_ready, ready_kernels = _warmup_of(server), _kernel_files(folder)
        first = runs.run_one(naming(new_prompts(args, seeds), server), server.base_url, tokenizer, concurrency,
                             label="first")
        first_kernels = _kernel_files(folder)
        second = runs.run_one(naming(new_prompts(args, seeds), server), server.base_url, tokenizer, concurrency,
                              label="second")
        after, second_kernels = _warmup_of(server), _kernel_files(folder)
    result = {"concurrency": concurrency, "kernels": kernels, "first": _row(first), "second": _row(second),
              "ratio": ratio(first["summary"]["output_tok_s"], second["summary"]["output_tok_s"]),
              "warmup_at_ready": at_ready, "warmup_after": after,
              # what the warm-up left for the runs to compile (MLX's CUDA kernels; none on a CPU)
              "kernels_at_ready": len(ready_kernels),
              "kernels_compiled_in_first": sorted(first_kernels - ready_kernels),
              "kernels_compiled_in_second": sorted(second_kernels - first_kernels),
              "ttfts": {"first": _ttfts(first), "second": _ttfts(second)}}
    console.print(f"  cold start c={concurrency} ({kernels} kernels): first ÷ second {num(result['ratio'], 2)}")
    return result


def _kernel_files(folder: Path) -> set[str]:
    """The compiled kernels MLX keeps in `folder` (none where it is not there)."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


def _ttfts(run: dict) -> list:
    """Each request's time to its first token, in the order they ended."""
    return [r["ttft"] for r in run["per_request"]]


def prime_kernels(args, concurrency: int, tokenizer: str, seeds: itertools.count) -> None:
    """Before the `kept` starts: a start on the server's own kernel folder that
    warms and runs the workload once, as the run before a restart would have."""
    with servers.RunningServer(_spec(args, sides(args)[-1], concurrency, None)) as server:
        wait_warm(server)
        runs.run_one(naming(new_prompts(args, seeds), server), server.base_url, tokenizer, concurrency,
                     label="prime kernels")


def run_streaming(args, save=lambda result: None) -> dict:
    """The whole run's result; `save(result so far)` after each part, so a run cut
    short (a time limit on a lent machine) still leaves what it measured."""
    tokenizer = runs.default_tokenizer(args)
    concurrencies = runs.concurrencies(args.concurrency)
    compared = sides(args)
    result = {"model": args.model, "base_tree": args.base_tree, "tierlm_args": args.tierlm_args,
              "base_args": args.base_args,
              "shape": {"input_len": args.input_len, "output_len": args.output_len},
              "smoothness": {}, "cold_start": [], "complete": False}
    rounds = max(1, args.rounds) if len(compared) > 1 else 1
    for n in range(rounds if concurrencies else 0):
        served = {}
        for side in compared if n % 2 == 0 else compared[::-1]:
            served[side.name] = smoothness(args, side, concurrencies, tokenizer)
        result.setdefault("smoothness_rounds", []).append(served)
        result["smoothness"] = {name: median_rows([r[name] for r in result["smoothness_rounds"]])
                                for name in ("base", "this") if name in served}
        save(result)
    cold = runs.concurrencies(args.cold)
    seeds = itertools.count(1)  # the smoothness runs above took the seed itself
    for kernels in filter(None, args.cold_kernels.split(",")):
        if kernels == "kept" and cold:
            prime_kernels(args, max(cold), tokenizer, seeds)
        for c in cold:
            for _ in range(args.cold_repeats):
                result["cold_start"].append(cold_start(args, c, kernels, tokenizer, seeds))
                save(result)
    result["complete"] = True
    return result


def _round_ratios(rounds: list[dict]) -> list[str]:
    """With several rounds: each round's tok/s this ÷ base, and which tree it served first."""
    if len(rounds) < 2:
        return []
    cells = [f"round {n + 1} ({next(iter(r))} first): "
             + " / ".join(num(ratio(t["output_tok_s"], b["output_tok_s"]), 2) for t, b in zip(r["this"], r["base"]))
             for n, r in enumerate(rounds)]
    return ["Tok/s this ÷ base at each concurrency, by round: " + "; ".join(cells) + ".", ""]


def _cold_medians(cold: list[dict]) -> str:
    groups: dict[tuple, list[float]] = {}
    for c in cold:
        groups.setdefault((c["concurrency"], c["kernels"]), []).append(c["ratio"])
    cells = [f"{n} streams, {k} kernels: {num(statistics.median(r), 2)} ({len(r)} starts, "
             f"{num(min(r), 2)}–{num(max(r), 2)})" for (n, k), r in groups.items()]
    return "Median first ÷ second: " + "; ".join(cells) + "."


def _warm_cell(warm: dict | None, key: str, unit: str) -> str:
    return "-" if not warm else f"{num(warm[key], 1 if unit else 0)}{unit}"


def title(doc: dict) -> str:
    """Runs of other concurrencies or other server flags are benchmarks of their own."""
    shape = doc.get("shape", {})
    smooth = next(iter(doc.get("smoothness", {}).values()), [])
    streams = ", ".join(str(r["concurrency"]) for r in smooth)
    return (f"Streaming and cold start: `{Path(doc.get('model') or 'default model').name}`, "
            f"{shape.get('input_len', '?')}-token prompts, {shape.get('output_len', '?')} tokens out"
            + (f", at {streams} streams" if streams else "")
            + (f", `{doc['tierlm_args']}`" if doc.get("tierlm_args") else "")
            + (", against an earlier tree" if doc.get("base_tree") else "")
            + (f", against `{doc['base_args'] or 'no flags'}`" if doc.get("base_args") is not None else ""))


def markdown(doc: dict) -> str:
    out = [doc["note"], ""] if doc.get("note") else []
    if doc.get("complete") is False:
        out += ["This run was cut short: what it measured before that.", ""]
    smooth = doc.get("smoothness", {})
    if smooth:
        header = ["streams"]
        for name in smooth:
            header += [f"{name}: ITL p50", "TPOT p50", "ITL ÷ TPOT", "out tok/s"]
        if "base" in smooth:
            header += ["tok/s this ÷ base"]
        rows = []
        for i, first in enumerate(next(iter(smooth.values()))):
            row = [str(first["concurrency"])]
            for runs_of in smooth.values():
                r = runs_of[i]
                row += [ms(r["itl_p50"]), ms(r["tpot_p50"]), num(ratio(r["itl_p50"], r["tpot_p50"]), 2),
                        num(r["output_tok_s"])]
            if "base" in smooth:
                row.append(num(ratio(smooth["this"][i]["output_tok_s"], smooth["base"][i]["output_tok_s"]), 2))
            rows.append(row)
        out += [SMOOTH_TARGET, markdown_table(header, rows), ""]
        out += _round_ratios(doc.get("smoothness_rounds", []))
    cold = doc.get("cold_start", [])
    if cold:
        header = ["streams", "kernel folder", "first run tok/s", "second run tok/s", "first ÷ second",
                  "first TTFT p50", "second TTFT p50", "warming before ready", "shapes left at ready",
                  "kernels compiled in the first run"]
        rows = [[str(c["concurrency"]), c["kernels"], num(c["first"]["output_tok_s"]),
                 num(c["second"]["output_tok_s"]), num(c["ratio"], 2), ms(c["first"]["ttft_p50"]),
                 ms(c["second"]["ttft_p50"]), _warm_cell(c.get("warmup_at_ready"), "seconds", " s"),
                 _warm_cell(c.get("warmup_at_ready"), "shapes_left", ""),
                 str(len(c["kernels_compiled_in_first"])) if "kernels_compiled_in_first" in c else "-"]
                for c in cold]
        out += [COLD_TARGET, markdown_table(header, rows), "", _cold_medians(cold), ""]
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = lab_parser("bench_lab.streaming", __doc__)
    p.add_argument("--model", default=None, help="MLX model folder (default: the default model)")
    p.add_argument("--base-tree", default=None, help="a checkout of another commit, served first, for a before/after")
    p.add_argument("--cold", default="8,32", help="concurrencies of the cold-start runs (empty: none)")
    p.add_argument("--cold-kernels", default="fresh,kept", help="fresh and/or kept: the kernel folder per start")
    p.add_argument("--cold-repeats", type=int, default=3, help="cold starts per concurrency and kernel folder")
    p.add_argument("--tierlm-args", default="", help="extra flags for tierlm serve")
    p.add_argument("--base-args", default=None,
                   help="the base server's flags instead of --tierlm-args: with no --base-tree, this tree "
                        "served with them, for a before/after of a setting")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --base-tree or --base-args: each side served this many times, the order "
                        "turned each round")
    add_load_args(p, default_concurrency="1,4,32")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    result = run_streaming(args, lambda so_far: write_result(args, p, "streaming", so_far))
    console.print(markdown(result))
    write_result(args, p, "streaming", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
