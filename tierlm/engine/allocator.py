"""Gives the C heap's free memory back to the system whenever the server goes idle.

Why: on Linux, MLX's CPU buffers come from glibc's malloc. glibc raises its mmap
threshold each time a large mmapped chunk is freed (up to 32 MiB), so after the
first steps nearly every activation, logit and KV buffer is carved out of the
malloc arenas instead of mmapped. Under load the arenas grow to the peak
working set; when the load ends the freed chunks sit between live ones, and
glibc only gives back the top of an arena by itself. The process kept its peak
RSS for good, and clearing the prefix cache (DELETE /v1/cache) gave none of it
back. MLX's own buffer cache is not it: on the CPU backend its limit is 32 MiB.

Measured with `python -m bench_lab.soak` (SmolLM2-135M, 300 requests over 16 streams,
this 2-core Xeon with AMX, other jobs sharing the cores): RSS before -> after
the run -> after DELETE /v1/cache, and the server's CPU during the load:
- nothing set:          1017 -> 2434 -> 2434 MiB; 8 s system CPU, 1.4 M page faults, 160 s
- M_MMAP_THRESHOLD 128 KiB (what MALLOC_MMAP_THRESHOLD_=131072 does):
                         973 ->  957 ->  952 MiB; 107 s system CPU, 55 M faults, 467 s:
  every large buffer is a fresh mmap whose pages fault in zeroed, every step
- M_MMAP_THRESHOLD 1 MiB: 1000 -> 1092 -> 1092 MiB; 64 s system CPU, 37 M faults, 205 s
- M_ARENA_MAX 2:        1009 -> 2083 -> 2083 MiB
- malloc_trim(0) once idle (an early form of this module):
                        1016 -> 1019 -> 1019 MiB; 6 s system CPU, 2.3 M faults, 152 s;
  one trim after the load, RSS 2024 -> 1018 MiB in 55 ms
The 1,000-request figures, with and without this module, are in docs/robustness.md.

So tierlm keeps glibc's fast reuse while it works, and a thread looks once a
second: when the process used under 5 % of a core since the last look (idle),
it first hands MLX's cached CPU buffers back to the heap, then, if RSS or the
heap's free bytes grew by 16 MiB since the last look and at least that much is
free, calls malloc_trim(0), which releases the free pages inside every arena
(madvise), not only the tops. A busy server is never trimmed; one that goes
quiet is back at its resting size within a second or two. A look costs
microseconds while busy; idle, mallinfo2 walks the free lists (up to ~5 ms on
a heap fragmented by a 1 GiB load). Linux with glibc only;
TIERLM_MALLOC_TRIM=off turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often the thread looks: os.times(), and while idle /proc/self/statm and mallinfo2
IDLE_CPU_SHARE = 0.05  # of one core, over the last check: below this the process is idle
FLOOR_BYTES = 16 * 2**20  # trim once RSS or the heap's free bytes grew this much since the last look
THREAD_NAME = b"tierlm-trim"  # as /proc/PID/task/TID/comm and top -H show it
PR_SET_NAME = 15


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def glibc() -> ctypes.CDLL | None:
    """The process's C library, when it is glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # not glibc (musl, say)
        return None
    if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
        libc.mallinfo2.restype = Mallinfo2
    return libc


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class IdleTrimmer:
    """A daemon thread: trims the C heap when the process is idle and has grown."""

    def __init__(self, libc: ctypes.CDLL, check_s: float = CHECK_S, floor: int = FLOOR_BYTES):
        self.libc, self.check_s, self.floor = libc, check_s, floor
        self.trims = 0
        self.thread = threading.Thread(target=self._run, name="tierlm-trim", daemon=True)

    def start(self) -> IdleTrimmer:
        self.thread.start()
        return self

    def trim_if_grown(self, last: tuple[int, int]) -> tuple[int, int]:
        """Trims when RSS or the heap's free bytes grew by `floor` since `last` (RSS,
        free) and the heap holds at least that much free. Returns the new `last`:
        the figures after a trim, else the lower of the two (memory reused and
        freed again without growing is not counted twice)."""
        self._clear_mlx_cache()
        now, free = rss_bytes(), self._free()
        if free is not None and free < self.floor:  # grown by live memory: nothing to give back
            return min(last[0], now), free
        grown = now - last[0] >= self.floor or (free is not None and free - last[1] >= self.floor)
        if not grown:
            return min(last[0], now), min(last[1], free or 0)
        t0 = time.perf_counter()
        self.libc.malloc_trim(0)
        after = rss_bytes()
        self.trims += 1
        log.log(logging.INFO if now - after >= self.floor else logging.DEBUG,
                "idle: gave %d MiB of free heap back (RSS %d -> %d MiB) in %.0f ms",
                (now - after) >> 20, now >> 20, after >> 20, (time.perf_counter() - t0) * 1e3)
        return after, free if free is not None else 0

    @staticmethod
    def _clear_mlx_cache() -> None:
        """MLX's CPU allocator keeps up to 32 MiB of freed buffers for reuse, live as far
        as malloc knows; idle, they go back to the heap first (under MLX's own lock).
        Not on a GPU, where an idle CPU may only mean the device is busy."""
        mx = sys.modules.get("mlx.core")
        if mx is not None and mx.get_cache_memory() and mx.default_device() == mx.cpu:
            mx.clear_cache()

    def _free(self) -> int | None:
        """Bytes free inside the heap (resident or already given back), summed over arenas."""
        return self.libc.mallinfo2().fordblks if hasattr(self.libc, "mallinfo2") else None

    def _run(self) -> None:
        self.libc.prctl(PR_SET_NAME, ctypes.c_char_p(THREAD_NAME), 0, 0, 0)
        cpu, last = sum(os.times()[:2]), (rss_bytes(), self._free() or 0)
        while True:
            time.sleep(self.check_s)
            before, cpu = cpu, sum(os.times()[:2])
            if cpu - before < IDLE_CPU_SHARE * self.check_s:
                last = self.trim_if_grown(last)
                cpu = sum(os.times()[:2])  # the look's own time does not count as work


def trim_heap() -> int | None:
    """Hands MLX's cached buffers back (to the heap, or the device) and the heap's
    free pages to the system, now: after a model is unloaded (EngineCore.close)
    the freed weights sit in the arenas otherwise. Returns the bytes RSS fell by;
    None where the C library is not glibc (MLX's cache is still emptied). Takes
    milliseconds to ~100 ms on a heap that held a model; call it off the event
    loop."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()
    libc = glibc()
    if libc is None:
        return None
    before = rss_bytes()
    libc.malloc_trim(0)
    return max(0, before - rss_bytes())


def configure_allocator() -> IdleTrimmer | None:
    """Called once by `tierlm serve`, before the model loads."""
    if os.environ.get("TIERLM_MALLOC_TRIM", "").lower() in ("off", "0", "false", "no"):
        return None
    libc = glibc()
    if libc is None:
        return None
    return IdleTrimmer(libc).start()
