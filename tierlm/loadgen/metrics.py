"""Per-request timings and their summary: TTFT, TPOT, ITL, end-to-end latency.

Definitions follow vLLM's `bench serve`:
- TTFT: request sent -> first chunk carrying output text.
- ITL: the gaps between successive output chunks of one request.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request.
- E2E: request sent -> last byte.
Output tokens are the server's `usage.completion_tokens` when it reports them,
else the number of output chunks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    start: float  # perf_counter seconds when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each output chunk
    end: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # from usage; else len(chunk_times)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt read from a cache
    error: str | None = None
    text: str = ""  # what was streamed (answers compared between runs)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def n_output(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.n_output < 2:
            return None
        return (self.e2e - self.ttft) / (self.n_output - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def geometric_mean_se(ratios: list[float]) -> tuple[float, float]:
    """Geometric mean of ratios and its standard error (from the logs' s.e.); nan
    with fewer than two. For pairs of runs made back to back, when the machine's
    speed moves between pairs more than within one."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 2:
        return math.nan, math.nan
    mean = sum(logs) / len(logs)
    se = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1) / len(logs))
    return math.exp(mean), math.exp(mean) * se


def median(values: list[float]) -> float:
    return percentile(values, 50)


def distribution(values: list[float]) -> dict[str, float]:
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """The summary of one run: `duration` is the wall time from the first request
    sent to the last one finished."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.n_output for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,  # of prompt_tokens, read from a server's cache (where it says)
        "output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(ok) if ok else math.nan,
        "output_tok_s": output_tokens / duration if duration > 0 else math.nan,
        "total_tok_s": (output_tokens + prompt_tokens) / duration if duration > 0 else math.nan,
        "requests_s": len(ok) / duration if duration > 0 else math.nan,
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": distribution([x for r in ok for x in r.itls]),
        "e2e_s": distribution([r.e2e for r in ok]),
    }


def steady_decode_rate(token_times: list[list[float]]) -> float:
    """Decode tokens/s of a full batch: the tokens that arrive after every request
    has its first token and until the first request ends, over that window."""
    times = [t for t in token_times if t]
    if not times:
        return math.nan
    t0 = max(t[0] for t in times)
    t1 = min(t[-1] for t in times)
    n = sum(1 for t in times for x in t if t0 < x <= t1)
    return n / (t1 - t0) if t1 > t0 and n else math.nan
