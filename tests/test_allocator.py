"""The idle heap trim (tierlm/engine/allocator.py): a real server runs it, and its
RSS comes back after a burst of long prompts; the trim itself, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import wait_until

from tierlm.engine.allocator import CHECK_S, glibc

pytestmark = [pytest.mark.slow,  # RSS measured around a burst of requests
              pytest.mark.skipif(glibc() is None, reason="the trim is for Linux with glibc")]

MODEL = "SmolLM2-135M-Instruct"
MiB = 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def thread_names(pid: int) -> list[str]:
    return [p.read_text().strip() for p in Path(f"/proc/{pid}/task").glob("*/comm")]


def idle(server) -> bool:
    s = server.stats()
    return s["running"] + s["prefilling"] + s["waiting"] == 0


@pytest.fixture(scope="module")
def server(uncached_server):
    # no prefix cache: the burst's KV must not stay alive in the hot tier (conftest's
    # uncached_server, shared with other modules: 8 requests at a time, the log at info)
    return uncached_server


def settled_rss(pid: int) -> int:
    """The process's RSS once it stopped falling: two reads, further apart than the
    trim thread's look (allocator.CHECK_S), within 8 MiB of each other."""
    reads = []

    def settled() -> bool:
        reads.append(rss(pid))
        return len(reads) > 1 and abs(reads[-1] - reads[-2]) < 8 * MiB

    wait_until(settled, timeout=60, interval=1.5 * CHECK_S)
    return reads[-1]


def test_the_trim_thread_runs_in_the_server(server):
    assert "tierlm-trim" in thread_names(server.proc.pid)


def test_rss_comes_back_after_a_burst(server):
    pid = server.proc.pid

    def ask(i: int, words: int, max_tokens: int) -> None:
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": [
            {"role": "user", "content": f"Note {i}. " + " ".join(f"item{i}x{j}" for j in range(words))}]}
        r = httpx.post(server.v1 + "/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text

    ask(0, 20, 4)
    wait_until(lambda: idle(server), timeout=60)
    before = settled_rss(pid)  # any trim of the start-up's buffers is done by now

    peak = before
    # 8 prompts of ~400 tokens at once: the heap grows by ~300 MiB here (by ~700 with 150
    # words, for twice the time); the check needs 150
    threads = [threading.Thread(target=ask, args=(i, 80, 16)) for i in range(1, 9)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss(pid))
        time.sleep(0.05)
    wait_until(lambda: idle(server), timeout=60)
    after_burst = rss(pid)
    assert peak - before > 150 * MiB, f"the burst did not grow the heap ({before / MiB:.0f} -> {peak / MiB:.0f} MiB)"

    # without the trim, glibc keeps the burst's freed buffers: RSS stays near the peak for good
    limit, deadline = before + max(before // 20, 64 * MiB), time.monotonic() + 30
    while rss(pid) >= limit and time.monotonic() < deadline:
        time.sleep(0.2)
    now = rss(pid)
    trims = [line for line in server.log().splitlines() if "tierlm.engine.allocator" in line]
    assert now < limit, (f"RSS {before / MiB:.0f} MiB before, {peak / MiB:.0f} at the peak, "
                         f"{after_burst / MiB:.0f} once idle, {now / MiB:.0f} 30 s later; {trims}")


TRIM_PROBE = textwrap.dedent("""
    import ctypes, sys
    from tierlm.engine.allocator import IdleTrimmer, glibc, rss_bytes
    libc = glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 1 MiB blocks come from the heap, as they do once glibc adapts
    base = rss_bytes()
    blocks = [libc.malloc(1 << 20) for _ in range(256)]
    pin = libc.malloc(1 << 20)  # a live block above them (from the top, as no free chunk fits):
    # the heap's top cannot shrink past it, so glibc keeps the freed blocks by itself
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
    held = rss_bytes()
    trimmer = IdleTrimmer(libc)
    trimmer.trim_if_grown((base, 0))
    after = rss_bytes()
    print(base >> 20, held >> 20, after >> 20, trimmer.trims)
""")


def test_the_trim_gives_freed_heap_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=60, check=True)
    base, held, after, trims = map(int, out.stdout.split())
    assert held - base > 200, (base, held, after)  # freed, but still resident
    assert trims == 1 and after < base + 16, (base, held, after)
