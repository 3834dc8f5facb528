"""Per-request mailbox between the engine loop and the HTTP handler."""

from __future__ import annotations

import asyncio
import time

from tierlm.engine.request import RequestOutput


class OutputCollector:
    """Holds at most one pending output: later outputs merge into it, so a consumer
    that lags gets one larger piece rather than an ever longer queue.

    The reader is woken for the first token at once, then every `stream_interval`
    tokens, and always when the request finishes.

    The event loop runs `put` and `get` once per request per hand-off of the
    engine's worker, and that thread's time comes off the decode rate where the
    steps are CPU-bound (it holds the GIL the worker needs): a reader waits on a
    bare future, woken by `put` directly, and a reader that finds its output ready
    takes it without waiting at all.
    """

    def __init__(self, stream_interval: int = 1):
        self.stream_interval = max(1, stream_interval)
        self._pending: RequestOutput | None = None
        self._ready = False  # `_pending` may be taken now
        self._waiter: asyncio.Future | None = None  # the reader waiting in `get`
        self.last_read = time.monotonic()
        self.reading = False
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        pending = self._pending
        if pending is None:
            pending = self._pending = output
        else:
            pending.merge(output)
        if output.finished:
            self.finished = True
        first = pending.completion_tokens == len(pending.token_ids)  # nothing read yet
        if output.finished or first or len(pending.token_ids) >= self.stream_interval:
            self._ready = True
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The merged output, or None if `timeout` passed first (used for keep-alives)."""
        if not self._ready:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            # one timer, not asyncio.wait_for (a task and two futures per call)
            timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
            self.reading = True
            try:
                await waiter
            finally:
                self._waiter, self.reading = None, False
                if timer is not None:
                    timer.cancel()
        self.last_read = time.monotonic()
        if not self._ready:
            return None
        output, self._pending, self._ready = self._pending, None, False
        return output


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
