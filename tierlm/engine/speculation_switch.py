"""Whether a batch drafts at all: measured, not modelled.

StepCosts (speculative_batch) picks a verification's width from what steps
cost; what it cannot see is what drafting costs around the steps. Looking for
a draft waits for the last sampled tokens, a verification waits for its own,
and meanwhile the GPU idles while Python readies the next step, where plain
steps keep it busy (mlx-lm starts a step's forward pass before it hands out
the previous step's tokens). On the H200 that made prose 3-17 % slower with
drafts at 4 sequences and more, though each step's own cost said drafting paid.

So a batch runs in windows of a few steps, drafting or plain, and a window's
tokens a second, from the start of its first step to the start of the step
after its last (everything the engine did for those tokens), decides: for each
batch size the better way is kept and the other tried again after 1, 2, 4...
windows while it keeps losing by less than `close` (at most `retry_close`
apart), after 4, 8, 16... when it lost by more (at most `retry_far`). A window
the batch's size changed in, or a prefill ran in, is not counted, nor the first
drafting window of a size (a GPU compiles kernels in it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SpeculationSwitch:
    window: int = 8  # steps per window
    weight: float = 0.5  # of a new window's rate in the running one
    retry_close: int = 6  # windows before the losing way is tried again, when it lost by < `close`
    retry_far: int = 24  # ... and when it lost by more
    close: float = 1.25
    rates: dict[tuple[bool, int], float] = field(default_factory=dict)  # (drafting, rows) -> tokens a second
    drafting: bool = True
    _start: float | None = None
    _rows: int = 0
    _steps: int = 0
    _tokens: int = 0
    _kept: dict[int, int] = field(default_factory=dict)  # rows -> windows in a row the winner ran
    _gap: dict[int, int] = field(default_factory=dict)  # rows -> windows the winner runs before a retry
    _winner: dict[int, bool] = field(default_factory=dict)  # rows -> the way that won last
    _seen: set = field(default_factory=set)  # (True, rows) whose first drafting window was passed over
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (drafting, rows, tokens, seconds)

    def step(self, now: float, rows: int) -> bool:
        """A step of `rows` sequences starts at `now`: whether it may draft."""
        if self._start is not None and rows != self._rows:
            self._start = None  # sequences joined or left: not the size measured
        if self._start is not None and self._steps >= self.window:
            self._close(now)
        if self._start is None:
            self.drafting = self._choose(rows)
            self._start, self._rows, self._steps, self._tokens = now, rows, 0, 0
        self._steps += 1
        return self.drafting

    def made(self, tokens: int) -> None:
        """Tokens the step just taken handed out."""
        self._tokens += tokens

    def interrupted(self) -> None:
        """The engine did other work (a prefill) since the last step started."""
        self._start = None

    def _close(self, now: float) -> None:
        key = (self.drafting, self._rows)
        rate = self._tokens / max(now - self._start, 1e-9)
        self.recent.append((self.drafting, self._rows, self._tokens, now - self._start))
        self._start = None
        if self.drafting and key not in self._seen:  # its first verifications compiled kernels (a GPU)
            self._seen.add(key)
            return
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + self.weight * (rate - old)

    def _choose(self, rows: int) -> bool:
        on, off = self.rates.get((True, rows)), self.rates.get((False, rows))
        if on is None or off is None:  # measure drafting first, then plain steps
            return on is None
        best = on >= off
        ratio = max(on, off) / max(min(on, off), 1e-9)
        far = ratio >= self.close
        gap = self._gap.get(rows, 1)
        if self._winner.get(rows) != best:
            gap = 4 if far else 1  # a new winner: the loser is tried again soon
        self._winner[rows] = best
        kept = self._kept.get(rows, 0)
        if kept >= gap:  # the loser again: costs move with the context and the load
            self._kept[rows] = 0
            self._gap[rows] = min(2 * gap, self.retry_far if far else self.retry_close)
            return not best
        self._kept[rows], self._gap[rows] = kept + 1, gap
        return best

    @property
    def measuring(self) -> bool:
        """Whether a window is open."""
        return self._start is not None
