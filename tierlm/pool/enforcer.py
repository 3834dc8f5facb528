"""The memory enforcer: keeps the process under its marks rather than let the
kernel kill the server.

Every POLL_S it reads the process's memory. Above the soft mark new requests
wait (the pool's pause) and idle models are unloaded, least recently used
first; the pause ends once memory is back under the soft mark. Above the hard
mark the requests in flight on the engine holding the most memory end with an
error (each client gets an error body or an error event, none hangs). Every
action is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from tierlm.pool.pool import ModelPool, Slot

log = logging.getLogger(__name__)

POLL_S = 0.5
HARD_COOLDOWN_S = 2.0  # after aborting at the hard mark, time for the memory to come back


def process_memory() -> int:
    """The process's resident memory: RSS from /proc/self/statm (Linux), else
    what MLX holds (its arrays and its buffer cache)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import mlx.core as mx

        return mx.get_active_memory() + mx.get_cache_memory()


def memory_reader_for_tests() -> Callable[[], int] | None:
    """Tests only: TIERLM_TEST_MEMORY_FILE names a file holding the byte count the
    enforcer reads instead of the process's memory (a mark cannot be crossed for
    real in a test); a file that is empty or absent: the real reading."""
    path = os.environ.get("TIERLM_TEST_MEMORY_FILE")
    if not path:
        return None

    def read() -> int:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return process_memory()

    return read


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


class MemoryEnforcer:
    def __init__(self, pool: ModelPool, marks: Callable[[], tuple[int, int]],
                 read_memory: Callable[[], int] | None = None, poll_s: float = POLL_S):
        """`marks`: the (soft, hard) marks in bytes now (they follow the settings)."""
        self.pool, self.marks, self.poll_s = pool, marks, poll_s
        self.read_memory = read_memory or memory_reader_for_tests() or process_memory
        self._task: asyncio.Task | None = None
        self._hard_at = 0.0  # when requests were last aborted at the hard mark
        self.aborted_requests = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="memory-enforcer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.pool.resume()

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("memory enforcer: a check failed")
            await asyncio.sleep(self.poll_s)

    async def check(self) -> None:
        """One poll: pause and unload above the soft mark, abort above the hard one,
        resume under the soft one."""
        soft, hard = self.marks()
        used = self.read_memory()
        if used < soft:
            if self.pool.paused is not None:
                log.info("memory enforcer: process memory %s MiB is under the soft mark (%s MiB): "
                         "new requests start again", _mib(used), _mib(soft))
                self.pool.resume()
            return
        if self.pool.paused is None:
            log.warning("memory enforcer: process memory %s MiB is above the soft mark (%s MiB): new requests "
                        "wait, idle models are unloaded", _mib(used), _mib(soft))
            self.pool.pause(f"process memory {_mib(used)} MiB is above the soft mark of {_mib(soft)} MiB")
        while used >= soft and self.pool.idle_slots():
            why = f"process memory {_mib(used)} MiB is above the soft mark ({_mib(soft)} MiB)"
            await self.pool.evict_idle(1, why)
            used = self.read_memory()
        if used >= hard and time.monotonic() - self._hard_at >= HARD_COOLDOWN_S:
            self._abort_largest(used, hard)

    def _abort_largest(self, used: int, hard: int) -> None:
        busy = [s for s in self.pool.slots.values() if s.served is not None and s.in_flight > 0]
        if not busy:
            return
        slot = max(busy, key=_held_bytes)
        message = (f"aborted: the server's memory reached its hard mark ({_mib(used)} of {_mib(hard)} MiB); "
                   f"the requests of {slot.entry.name}, the model holding the most memory, were ended")
        failed = slot.served.engine.fail_all_requests(message, "overloaded")
        self._hard_at = time.monotonic()
        self.aborted_requests += failed
        log.error("memory enforcer: process memory %s MiB is above the hard mark (%s MiB): aborted %d "
                  "request(s) of %s (%s MiB held)", _mib(used), _mib(hard), failed, slot.entry.name,
                  _mib(_held_bytes(slot)))


def _held_bytes(slot: Slot) -> int:
    """What a loaded model holds, as the pool knows it: its memory as measured at
    its load (the KV of its requests is the worker's to count, not read here)."""
    return slot.memory_bytes
