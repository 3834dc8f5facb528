"""Where one request's time goes on its way to the first token.

Each stage is marked as it ends: by the API (the body read, the model held,
loaded first if it was not, the chat template, the tokenizer, the grammar, the
hand-over to the engine), by the engine (the wait in the queue, the prefix
lookup and restore from the cache tiers, the prefill) and by the stream once
the first token reached it (`deliver`). A stage lasts from the end of the last
stage marked before it (the request's arrival for the first). `/stats` shows
the recent requests' medians per stage (`StageLog`), and every generation's
response a `Server-Timing` header with its own (a stream's: the stages before
the engine's, sent before them). An SSD restore happens while the request is
queued: its prefix is read ahead before it is admitted.

The API's stages are marked on the request's `Stages`, found through a context
variable the HTTP middleware sets (`begin`): the helpers that render and
tokenize are shared by every API and by `tierlm.LLM`, and need no argument for
it; outside a request they mark nothing.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from contextvars import ContextVar

# in the order they happen
STAGES = ("read", "model", "template", "tokenize", "grammar", "submit", "queue", "restore", "prefill",
          "deliver")


class Stages:
    """The moments at which one request's stages ended (perf_counter seconds)."""

    __slots__ = ("start", "ends")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """`stage` ended now; marked again (a request that waited for another's
        prefix is queued twice), its last end counts."""
        self.ends[stage] = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        """Each marked stage's length, in order."""
        out, before = {}, self.start
        for stage in STAGES:
            if stage in self.ends:
                out[stage] = max(0.0, self.ends[stage] - before)
                before = self.ends[stage]
        return out

    def server_timing(self) -> str:
        """The `Server-Timing` header's value (milliseconds)."""
        return ", ".join(f"{stage};dur={s * 1000:.1f}" for stage, s in self.seconds().items())


_current: ContextVar[Stages | None] = ContextVar("tierlm_request_stages", default=None)


def begin() -> Stages:
    """A request arrived: its stages, current in this context from now on."""
    stages = Stages()
    _current.set(stages)
    return stages


def current() -> Stages | None:
    return _current.get()


def mark(stage: str) -> None:
    """The current request's `stage` ended (outside a request: nothing)."""
    stages = _current.get()
    if stages is not None:
        stages.mark(stage)


class StageLog:
    """The stages of an engine's last `size` requests that reached a first token
    (read when asked for: a stream marks `deliver` after the engine added it)."""

    def __init__(self, size: int = 256):
        self._recent: deque[Stages] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, stages: Stages) -> None:
        with self._lock:
            self._recent.append(stages)

    def summary(self) -> dict:
        """Per stage: median and 90th percentile in ms over the requests that
        marked it, and how many did; `last`: the latest request's, in ms."""
        with self._lock:
            recent = [stages.seconds() for stages in self._recent]
        out: dict = {"requests": len(recent),
                     "last": {stage: round(s * 1000, 3) for stage, s in recent[-1].items()} if recent else {}}
        for stage in STAGES:
            values = sorted(r[stage] for r in recent if stage in r)
            if values:
                out[stage] = {"p50_ms": round(statistics.median(values) * 1000, 3),
                              "p90_ms": round(values[math.ceil(0.9 * len(values)) - 1] * 1000, 3),
                              "requests": len(values)}
        return out
