"""`tierlm bench speculation`: speculative decoding on and off, side by side in
one server, on what coding agents write and on free prose.

One tierlm server is started (no prefix cache, so every request computes its
whole prompt either way); each workload runs at each concurrency with drafts
on and with `speculative_tokens: 0`, in alternating order each round, greedy.
The workloads (code edits, an agent's edit tool call, prose) are
tierlm.loadgen.edits.

Reported: output tokens a second over the run and while decoding (after each
request's first token), their ratio on/off, and whether the answers were the
same text (greedy: they should be, where the backend is batch-invariant).
"""

from __future__ import annotations

import asyncio
import math
import statistics

from rich.console import Console

from tierlm.loadgen.client import LoadConfig, run_load
from tierlm.loadgen.edits import WORKLOADS
from tierlm.loadgen.metrics import RequestRecord, summarize
from tierlm.loadgen.workloads import BenchRequest, Workload

console = Console()

def decode_tok_s(records: list[RequestRecord]) -> float:
    """Output tokens after each request's first, over the time from the first
    first token to the last token: the decoding side of a run."""
    ok = [r for r in records if r.ok]
    if not ok:
        return math.nan
    span = max(r.chunk_times[-1] for r in ok) - min(r.chunk_times[0] for r in ok)
    return sum(r.n_output - 1 for r in ok) / span if span > 0 else math.nan


def with_drafts(workload: Workload, on: bool) -> Workload:
    extra = {} if on else {"speculative_tokens": 0}
    sessions = [[BenchRequest(r.max_tokens, messages=r.messages, extra={**r.extra, **extra}) for r in s]
                for s in workload.sessions]
    return Workload(workload.name, sessions, workload.params)


def run_pair(base_url: str, model: str, workload: Workload, first_on: bool, streams: int | None = None) -> dict:
    """The workload with drafts on and off (in that order or the other): all
    at once, or `streams` requests in flight at most, the next sent as one ends."""
    cfg = LoadConfig(base_url, model=model, temperature=0.0, ignore_eos=False, timeout_s=1800, concurrency=streams)
    out = {}
    for on in (first_on, not first_on):
        records, duration = asyncio.run(run_load(with_drafts(workload, on), cfg))
        summary = summarize(records, duration)
        summary["decode_tok_s"] = decode_tok_s(records)
        out["on" if on else "off"] = {"summary": summary, "texts": [r.text for r in records]}
    return out


def run(base_url: str, model: str, workloads: list[str], concurrencies: list[int], rounds: int,
        max_tokens: int, stats=None, prompts: int | None = None) -> list[dict]:
    """Every workload at every concurrency, `rounds` times, sent to `model`;
    `stats()` reads the model's draft counters after each run (or None).
    `prompts`: requests a run sends (the workload's first ones), at most a
    concurrency's worth in flight, as a server's clients send their next
    request when one ends; None: one a stream, all at once (the run then ends
    with the sequence that gained least from its drafts)."""
    results = []
    for name in workloads:
        for c in concurrencies:
            workload = WORKLOADS[name](max(c, prompts or c), max_tokens)  # a workload has 8 prompts at most
            for rnd in range(rounds):
                before = stats() if stats else None
                pair = run_pair(base_url, model, workload, first_on=rnd % 2 == 0, streams=c)
                after = stats() if stats else None
                row = {"workload": name, "concurrency": c, "prompts": workload.num_requests, "round": rnd, **pair,
                       "same_text": pair["on"]["texts"] == pair["off"]["texts"]}
                if before and after:
                    row["drafts"] = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
                results.append(row)
                on, off = pair["on"]["summary"], pair["off"]["summary"]
                console.print(f"{name} c={c} round {rnd + 1}: decode {on['decode_tok_s']:.1f} vs "
                              f"{off['decode_tok_s']:.1f} tok/s ({on['decode_tok_s'] / off['decode_tok_s']:.2f}x), "
                              f"output {on['output_tok_s']:.1f} vs {off['output_tok_s']:.1f} tok/s, "
                              f"same text: {row['same_text']}, failed {on['failed'] + off['failed']}")
    return results


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Medians over rounds, per workload and concurrency."""
    header = ["workload", "streams", "decode tok/s on", "off", "ratio", "output tok/s on", "off", "ratio",
              "accepted / drafted", "same text"]
    rows = []
    keys = sorted({(r["workload"], r["concurrency"]) for r in results}, key=lambda k: (list(WORKLOADS).index(k[0]),
                                                                                       k[1]))
    for name, c in keys:
        runs = [r for r in results if (r["workload"], r["concurrency"]) == (name, c)]

        def med(side: str, key: str) -> float:
            return statistics.median(r[side]["summary"][key] for r in runs)

        drafts = [r["drafts"] for r in runs if "drafts" in r]
        drafted = sum(d["proposed_tokens"] for d in drafts)
        accepted = sum(d["accepted_tokens"] for d in drafts)
        sent = runs[0].get("prompts", c)  # requests a run sent, a stream's next as its last ended
        streams = str(c) if sent == c else f"{c} ({sent} requests)"
        rows.append([name, streams, f"{med('on', 'decode_tok_s'):.1f}", f"{med('off', 'decode_tok_s'):.1f}",
                     f"{med('on', 'decode_tok_s') / med('off', 'decode_tok_s'):.2f}x",
                     f"{med('on', 'output_tok_s'):.1f}", f"{med('off', 'output_tok_s'):.1f}",
                     f"{med('on', 'output_tok_s') / med('off', 'output_tok_s'):.2f}x",
                     f"{accepted} / {drafted}" if drafts else "-",
                     "yes" if all(r["same_text"] for r in runs) else "no"])
    return header, rows
