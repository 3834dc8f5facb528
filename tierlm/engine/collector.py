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
    """

    def __init__(self, stream_interval: int = 1):
        self.stream_interval = max(1, stream_interval)
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self.last_read = time.monotonic()
        self.reading = False
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            self._pending.merge(output)
        self.finished = self.finished or output.finished
        pending = self._pending
        first = pending.completion_tokens == len(pending.token_ids)  # nothing read yet
        if output.finished or first or len(pending.token_ids) >= self.stream_interval:
            self._ready.set()

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The merged output, or None if `timeout` passed first (used for keep-alives)."""
        self.reading = True
        try:
            if timeout is None:
                await self._ready.wait()
            else:
                await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.reading = False
            self.last_read = time.monotonic()
        output, self._pending = self._pending, None
        self._ready.clear()
        return output
