"""The GPU kernels a piece of work ran, from torch's profiler: CUPTI records
every kernel of the process, MLX's included, so a process that can import
torch with CUDA sees where MLX's GPU time goes (per kernel name: count and
time; the GPU's busy time against the span from first kernel to last, the
rest being the host's). Used by bench_lab.hit_profile `--kernels`."""

from __future__ import annotations

import collections
from contextlib import contextmanager


def available() -> str | None:
    """None where torch with CUDA can profile this process, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


@contextmanager
def recorded(into: list):
    """Profiles the block; appends its kernel summary (`summary`) to `into`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")  # the profiler's CUDA context, before the block
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    into.append(summary([e for e in prof.events() if "cuda" in str(e.device_type).lower()]))


def summary(events, top: int = 12) -> dict:
    """busy_ms, span_ms, kernels, and the `top` kernel names by time (name, count, ms)."""
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        entry = by_name[e.name[:100]]
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    return {"kernels": len(events), "busy_ms": round(sum(v[1] for v in by_name.values()), 2),
            "span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 2) if spans else 0.0,
            "top": [(name, n, round(ms, 3)) for name, (n, ms) in
                    sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]}
