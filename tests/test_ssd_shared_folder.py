"""Two processes over one SSD folder, as two replicas sharing a disk are: each
writes, reads and evicts blocks of a key space they share, under a cap far
smaller than what they write, at once. Every block a reader gets is the one its
key names; every file left is whole and right; the folder ends under its cap."""

from __future__ import annotations

import hashlib
import os
import multiprocessing
import random
import time
from pathlib import Path

import mlx.core as mx
import pytest
import numpy as np
from safetensors.numpy import load as st_load

from tierlm.cache import block_file
from tierlm.cache.hot_tier import Block
from tierlm.cache.ssd_tier import COULD_NOT_OPEN, SSDTier

FINGERPRINT = hashlib.sha256(b"shared-folder-test-model").digest()
SIGNATURE = "test"
KEYS = 120  # the key space both processes write and read
SHAPE = (4, 2, 32, 16)  # a packed block: (2 x layers, kv heads, tokens, head dim)
TOKENS = 32


def key_of(k: int) -> bytes:
    return hashlib.sha256(f"block {k}".encode()).digest()


def tokens_of(k: int) -> tuple[int, ...]:
    return tuple(range(k, k + TOKENS))


def kv_of(k: int) -> np.ndarray:
    """The KV a block's key names: the same in both processes."""
    return np.random.default_rng(k).standard_normal(SHAPE).astype(np.float16)


def block_bytes() -> int:
    tensors, meta = block_file.encode(key_of(0), b"", tokens_of(0), mx.array(kv_of(0)), FINGERPRINT, SIGNATURE)
    return sum(p.nbytes for p in block_file.to_bytes(tensors, meta))


def replica(folder: str, cap: int, seed: int, seconds: float, results) -> None:
    """One process: for `seconds`, write a random block or read a random run of
    blocks (a prefix lookup's chain), checking each block read against its key."""
    tier = SSDTier(Path(folder), cap, FINGERPRINT, SIGNATURE)
    tier.scanned.wait()
    rng = random.Random(seed)
    counts = {"writes": 0, "reads": 0, "absent": 0, "wrong": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        k = rng.randrange(KEYS)
        if rng.random() < 0.5:
            tier.enqueue(Block(key_of(k), b"", tokens_of(k), None, nbytes=0, packed=mx.array(kv_of(k))), wait=1.0)
            counts["writes"] += 1
            continue
        run = [(key_of(j), tokens_of(j)) for j in range(k, min(KEYS, k + 4))]
        got = list(tier.read_chain(run))
        counts["reads"] += len(got)
        counts["absent"] += len(run) - len(got)
        for j, block in zip(range(k, k + 4), got):
            if not np.array_equal(np.array(block.packed.astype(mx.float32)), kv_of(j).astype(np.float32)):
                counts["wrong"] += 1
    tier.close()
    results.put({**counts, **{k: v for k, v in tier.snapshot_stats().items() if isinstance(v, int)}})


@pytest.mark.slow  # two processes for ~10 s
def test_two_processes_writing_reading_and_evicting_one_folder(tmp_path):
    cap = 20 * block_bytes()  # a sixth of the key space: both evict all the time
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(str(tmp_path), cap, seed, 4.0, results)) for seed in (1, 2)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for r in reports:
        assert r["wrong"] == 0, reports
        assert r["errors"] == 0, reports  # a file the other evicted mid-read is a miss, not a bad file
        assert r["writes"] > 20 and r["reads"] > 20 and r["evictions"] > 0, reports
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files and not list(tmp_path.rglob("*.tmp"))
    for f in files:  # every file left is whole, and holds what its name says
        data = f.read_bytes()
        key = bytes.fromhex(f.name.removesuffix(".safetensors"))
        k = next(i for i in range(KEYS) if key_of(i) == key)
        block_file.verify(data, key, tokens_of(k), FINGERPRINT, SIGNATURE)  # raises if not whole
        assert np.array_equal(st_load(data)["a0"], kv_of(k))
    assert sum(f.stat().st_size for f in files) <= cap  # the last to close saw both processes' writes


def test_a_scan_over_the_cap_evicts_the_least_recently_used_files(tmp_path):
    size = block_bytes()
    first = SSDTier(tmp_path, 10 * size, FINGERPRINT, SIGNATURE)
    first.scanned.wait()
    for k in range(6):
        first.enqueue(Block(key_of(k), b"", tokens_of(k), None, nbytes=0, packed=mx.array(kv_of(k))))
    assert first.close()
    now = time.time()
    for k in range(6):  # last used: block 0 an hour ago ... block 5 now
        path = first.path_for(key_of(k).hex())
        os.utime(path, (now - 3600 + k * 600, now - 3600 + k * 600))
    second = SSDTier(tmp_path, 3 * size, FINGERPRINT, SIGNATURE)
    second.scanned.wait()
    kept = {k for k in range(6) if second.path_for(key_of(k).hex()).exists()}
    assert kept == {3, 4, 5}
    second.close()


def test_a_file_that_cannot_be_opened_at_load_is_a_miss_and_is_kept(tmp_path, monkeypatch):
    """The race the two processes above run into now and then: the other process
    evicts a file after this one read its header, and writes it again before this
    one looks whether it is gone. MLX's load then fails to open it, though a
    whole file is there: a miss, not a damaged file to delete. The race cannot
    be timed for real, so the load fails here as it did there."""
    tier = SSDTier(tmp_path, 10 * block_bytes(), FINGERPRINT, SIGNATURE)
    tier.scanned.wait()
    tier.enqueue(Block(key_of(1), b"", tokens_of(1), None, nbytes=0, packed=mx.array(kv_of(1))))
    assert tier.close()
    tier = SSDTier(tmp_path, 10 * block_bytes(), FINGERPRINT, SIGNATURE)
    tier.scanned.wait()
    real_load = mx.load

    def evicted_meanwhile(path, *args, **kwargs):
        raise RuntimeError(f"[load_safetensors] {COULD_NOT_OPEN} file {path}")

    monkeypatch.setattr(mx, "load", evicted_meanwhile)
    assert list(tier.read_chain([(key_of(1), tokens_of(1))])) == []
    assert tier.snapshot_stats()["errors"] == 0 and tier.path_for(key_of(1).hex()).exists()
    monkeypatch.setattr(mx, "load", real_load)
    (got,) = tier.read_chain([(key_of(1), tokens_of(1))])
    assert np.array_equal(np.array(got.packed), kv_of(1))
    tier.close()


def test_mlx_says_it_could_not_open_a_file_that_is_not_there(tmp_path):
    """ssd_tier tells a file gone from a bad one by MLX's words for a failed open."""
    with pytest.raises((RuntimeError, ValueError), match=COULD_NOT_OPEN):
        mx.load(str(tmp_path / "gone.safetensors"), stream=mx.cpu)
