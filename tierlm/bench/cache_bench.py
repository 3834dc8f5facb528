"""`tierlm bench cache`: the prefix cache's tiers against the machine's own speeds.

In process, on one model (no server, no network):

- per prompt size: time to first token cold, as a hit of the hot tier, and as
  a hit of the SSD tier after a restart, once with the block files read from
  disk (page cache dropped) and once from the page cache;
- the SSD restore rate in GB/s (KV file bytes over the worker's time reading
  them, reads ahead included; and over the extra time to first token of an SSD
  hit beside a hot one), beside the rates of the same folder's disk: one big
  file written, the page cache dropped, read back in 16 MiB reads in one
  thread, then read again from the page cache (into one reused buffer; into
  new memory a piece: what any restore into memory not touched before pays, as
  the first hit after a restart does; and into pieces touched beforehand: the
  copy alone);
- the SSD writer: its rate (file bytes over its time serializing, writing and
  fsyncing), and whether its queue drops blocks when an agent session stores a
  whole turn of 20k tokens at once (write-through: every block enqueued when
  the turn ends), far faster than 20k tokens a minute.

The page cache is dropped with /proc/sys/vm/drop_caches where allowed (root),
else with posix_fadvise(DONTNEED) on each file (clean pages only: the writer
fsyncs every file). The prompts are random token ids; each size has its own,
so no size hits another's blocks. Each engine is started anew from the loaded
weights, as after a restart: the SSD folder is all they share.

    tierlm bench cache --model DIR --prefix 8000 20000 60000 --ssd-dir /tmp/ssd --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

DISK_CHUNK = 16 * 2**20
FRESH_PIECE = 8 * 2**20  # a block of a 1B model's KV
BLOCK = 256  # prefixes are whole multiples of it: whole blocks at either default block size (64 or 256)


def drop_page_cache(paths: list[Path]) -> str:
    """Evict these files from the page cache; how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def disk_rates(folder: Path, nbytes: int) -> dict:
    """Sequential read rate of a file of `nbytes` in `folder`: from the disk (page
    cache dropped), then from the page cache; and its write rate (with fsync)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tierlm-bench-disk-{os.getpid()}.tmp"
    chunk = np.random.default_rng(0).integers(0, 256, DISK_CHUNK, dtype=np.uint8)
    try:
        tic = time.perf_counter()
        with open(path, "wb") as f:
            f.writelines(memoryview(chunk) for _ in range(max(1, nbytes // DISK_CHUNK)))
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - tic
        size = path.stat().st_size
        how = drop_page_cache([path])
        buf = np.empty(DISK_CHUNK, dtype=np.uint8)

        def read() -> float:
            tic = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            return time.perf_counter() - tic

        def read_into_new() -> float:
            tic, kept = time.perf_counter(), []
            with open(path, "rb", buffering=0) as f:
                while f.readinto(piece := bytearray(FRESH_PIECE)):  # calloc'd: untouched pages
                    kept.append(piece)
            return time.perf_counter() - tic

        def read_into_touched() -> float:
            pieces = [np.ones(FRESH_PIECE, np.uint8) for _ in range(-(-size // FRESH_PIECE))]  # touched
            tic = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                for piece in pieces:
                    f.readinto(piece)
            return time.perf_counter() - tic

        disk_s = read()
        cached_s = min(read() for _ in range(2))
        fresh_s = min(read_into_new() for _ in range(2))
        touched_s = min(read_into_touched() for _ in range(2))
    finally:
        path.unlink(missing_ok=True)
    return {"file_bytes": size, "read_gbs": size / disk_s / 1e9, "page_cache_gbs": size / cached_s / 1e9,
            "page_cache_new_memory_gbs": size / fresh_s / 1e9,
            "page_cache_touched_memory_gbs": size / touched_s / 1e9,
            "write_gbs": size / write_s / 1e9, "drop": how}


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    hi = max(200, min(vocab, 32000) - 100)
    return [rng.randrange(100, hi) for _ in range(n)]


async def _ttft(engine, prompt: list[int]) -> tuple[float, int]:
    from tierlm.engine.request import Request, SamplingParams

    tic = time.perf_counter()
    request = Request(engine.new_request_id(), prompt, SamplingParams(max_tokens=1, temperature=0))
    output = await engine.generate(request)
    return time.perf_counter() - tic, output.cached_tokens


def _ssd_of(engine):
    """The engine's SSD tier (in process: its counters stay readable after a close)."""
    cache = getattr(getattr(engine, "scheduler", None), "cache", None)
    return getattr(cache, "ssd", None)


def _time_reads(ssd) -> None:
    """Code without a read_seconds counter (before its SSD reads were timed): time
    its per-block `read`, which its lookup calls, so the figures compare."""
    if ssd is None or hasattr(ssd.stats, "read_seconds"):
        return
    read, ssd.stats.read_seconds = ssd.read, 0.0

    def timed(*args):
        tic = time.perf_counter()
        try:
            return read(*args)
        finally:
            ssd.stats.read_seconds += time.perf_counter() - tic

    ssd.read = timed


def _ssd_stats(ssd) -> dict:
    if ssd is None:
        return {}
    s = ssd.stats
    return {k: getattr(s, k, None) for k in ("reads", "read_bytes", "read_seconds", "writes", "write_bytes",
                                            "write_seconds", "write_drops", "pending_peak_bytes", "errors")}


def _delta(after: dict, before: dict) -> dict:
    return {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and before.get(k) is not None else v)
            for k, v in after.items()}


class _Bench:
    def __init__(self, loaded, model_path: Path, ssd: Path, hot_cache_size: str, ssd_cache_size: str):
        from tierlm.cache.block_hash import model_fingerprint

        self.loaded, self.ssd = loaded, ssd
        self.fingerprint = model_fingerprint(model_path, {})
        self.hot_cache_size, self.ssd_cache_size = hot_cache_size, ssd_cache_size

    async def engine(self, preload: bool = False):
        """An engine on the folder; `preload`: reading its blocks back at start
        (off, the restarts measure what a lookup reads from SSD)."""
        from tierlm.config import Settings
        from tierlm.engine.core import EngineCore

        settings = Settings(hot_cache_size=self.hot_cache_size, ssd_cache=True, ssd_cache_dir=str(self.ssd),
                            ssd_cache_size=self.ssd_cache_size, ssd_preload=preload)
        engine = EngineCore("bench-cache", lambda: self.loaded, settings, self.fingerprint)
        await engine.start()
        return engine

    async def size(self, n: int, seed: int, vocab: int) -> dict:
        """`n` tokens of shared prefix (a whole number of blocks: all of it can hit)
        and a 24-token question."""
        n = max(BLOCK, n // BLOCK * BLOCK)
        prefix = _prompt(n, seed, vocab)
        questions = [_prompt(24, seed * 100 + k, vocab) for k in range(5)]
        out: dict = {"tokens": n}

        engine = await self.engine()  # cold, then a hit of the hot tier
        out["cold_s"], _ = await _ttft(engine, prefix + questions[0])
        out["hot_s"], out["hot_cached_tokens"] = await _ttft(engine, prefix + questions[1])
        stats = await engine.cache_stats()
        out["hot_tier_bytes"] = stats["bytes"]
        ssd = _ssd_of(engine)
        tic = time.perf_counter()
        await engine.close()  # write-back: the hot tier goes to SSD
        out["close_s"] = time.perf_counter() - tic
        w = out["writer"] = _ssd_stats(ssd)
        if w.get("write_seconds"):
            out["writer_gbs"] = w["write_bytes"] / w["write_seconds"] / 1e9

        files = list(self.ssd.rglob("*.safetensors"))
        out["drop"] = drop_page_cache(files)
        for where, question in (("ssd_disk", questions[2]), ("ssd_cached", questions[3])):
            engine = await self.engine()  # a restart: only the SSD folder is shared
            ssd = _ssd_of(engine)
            _time_reads(ssd)
            before = _ssd_stats(ssd)
            out[f"{where}_s"], out[f"{where}_cached_tokens"] = await _ttft(engine, prefix + question)
            read = _delta(_ssd_stats(ssd), before)
            await engine.close()
            out[f"{where}_read"] = read
            nbytes = read.get("read_bytes") or 0
            seconds = read.get("read_seconds")
            out[f"{where}_restore_gbs"] = nbytes / seconds / 1e9 if seconds else None
            extra = out[f"{where}_s"] - out["hot_s"]
            out[f"{where}_restore_gbs_ttft"] = nbytes / extra / 1e9 if extra > 0 else None
        # a restart given the time to read its blocks back while idle (from the page cache here)
        engine = await self.engine(preload=True)
        tic = time.perf_counter()
        while engine.preloading:
            await asyncio.sleep(0.005)
        out["preload_s"] = time.perf_counter() - tic
        out["preloaded_s"], out["preloaded_cached_tokens"] = await _ttft(engine, prefix + questions[4])
        await engine.close()
        return out


def writer_burst(loaded, ssd: Path, turn_tokens: int, turns: int, block_size: int = 256) -> dict:
    """An agent session's stores at full speed: `turns` turns of `turn_tokens` new
    tokens each, every block of a turn enqueued when it ends (write-through), as
    fast as the worker can store them. Whether the writer's queue drops any, its
    peak, and the rate at which the writer drains it. Synthetic KV of the model's
    own layout; runs before any engine, on this thread."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from tierlm.cache.codecs import codecs_for
    from tierlm.cache.prefix_cache import PrefixCache

    model = loaded[0]
    probe = make_prompt_cache(model)
    codecs = codecs_for(probe)
    if codecs is None or not all(getattr(c, "sliceable", False) for c in codecs):
        return {"skipped": "the model's cache layout is not plain attention KV"}
    model(mx.array([[1] * 8]), cache=probe)
    total = turn_tokens * turns
    layers = make_prompt_cache(model)
    for c, p in zip(layers, probe):
        shape = (1, p.keys.shape[1], total, p.keys.shape[3])
        c.keys = mx.random.normal(shape).astype(p.keys.dtype)
        c.values = mx.random.normal(shape).astype(p.values.dtype)
        c.offset = total
    mx.eval([a for c in layers for a in (c.keys, c.values)])
    folder = ssd / "writer-burst"
    pc = PrefixCache(os.urandom(32), codecs, block_size, 64 * 2**30, ssd_dir=folder, ssd_bytes=64 * 2**30,
                     write_through=True)
    tokens = _prompt(total, 7, 32000)
    tic = time.perf_counter()
    stored, store_s = 0, 0.0
    for t in range(1, turns + 1):
        view = []
        for c in layers:
            v = type(c)()
            v.keys, v.values, v.offset = c.keys[..., : t * turn_tokens, :], c.values[..., : t * turn_tokens, :], \
                t * turn_tokens
            view.append(v)
        t0 = time.perf_counter()
        stored = pc.store(tokens[: t * turn_tokens], [], view, stored)
        store_s += time.perf_counter() - t0
    flushed = pc.ssd.flush(timeout=600)
    wall = time.perf_counter() - tic
    s = pc.ssd.stats
    out = {
        "turn_tokens": turn_tokens, "turns": turns, "blocks": s.writes + s.write_drops,
        "written_blocks": s.writes, "write_drops": s.write_drops, "flushed": flushed,
        "write_bytes": s.write_bytes, "store_s": store_s, "wall_s": wall,
        "pending_peak_bytes": getattr(s, "pending_peak_bytes", None),
        "max_pending_bytes": getattr(pc.ssd, "max_pending_bytes", None),
        "write_gbs": s.write_bytes / wall / 1e9,
    }
    write_s = getattr(s, "write_seconds", None)
    out["writer_gbs"] = s.write_bytes / write_s / 1e9 if write_s else None
    pc.close()
    shutil.rmtree(folder, ignore_errors=True)
    return out


async def run(args) -> dict:
    import mlx.core as mx

    from tierlm.models.loader import load_model

    model_path = Path(args.model).expanduser()
    loaded = load_model(model_path)
    vocab = getattr(loaded[1], "vocab_size", None) or 32000
    base = Path(args.ssd_dir).expanduser() if args.ssd_dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierlm-bench-cache-", dir=base))
    result: dict = {"model": str(model_path), "device": str(mx.default_device()), "ssd_dir": str(work),
                    "hot_cache_size": args.hot_cache_size, "sizes": []}
    try:
        print(f"disk: {work}", flush=True)
        result["disk"] = disk_rates(work, args.disk_bytes)
        d = result["disk"]
        print(f"  sequential read {d['read_gbs']:.2f} GB/s from disk, {d['page_cache_gbs']:.2f} GB/s from the "
              f"page cache{_page_cache_variants(d)}; write+fsync {d['write_gbs']:.2f} GB/s (page cache dropped by "
              f"{d['drop']})", flush=True)
        if args.write_turns:
            w = result["writer"] = writer_burst(loaded, work, args.write_turn_tokens, args.write_turns)
            if "skipped" not in w:
                print(f"writer: {w['turns']} turns x {w['turn_tokens']} tokens stored at once, write-through: "
                      f"{w['write_drops']} of {w['blocks']} blocks dropped, queue peak "
                      f"{(w['pending_peak_bytes'] or 0) / 2**20:.0f} MiB of {(w['max_pending_bytes'] or 0) / 2**20:.0f}"
                      f"; drained at {w['write_gbs']:.2f} GB/s (writer busy: "
                      f"{w['writer_gbs'] or float('nan'):.2f} GB/s)", flush=True)
        bench = _Bench(loaded, model_path, work / "ssd", args.hot_cache_size, args.ssd_cache_size)
        warm = await bench.engine()  # first-call costs (kernels, allocator) out of the figures
        await _ttft(warm, _prompt(300, 999, vocab))
        await warm.close()
        shutil.rmtree(work / "ssd", ignore_errors=True)
        for i, n in enumerate(args.prefix):
            r = await bench.size(n, 1000 + i, vocab)
            result["sizes"].append(r)
            r["kv_bytes"] = r["ssd_disk_read"].get("read_bytes") or 0  # the hit's block files
            gb = r["kv_bytes"] / 1e9
            print(f"{n} tokens ({gb:.2f} GB of KV): cold {r['cold_s']:.2f} s, hot {r['hot_s']:.3f} s "
                  f"({r['hot_s'] / r['cold_s']:.3f} x cold), SSD after restart {r['ssd_disk_s']:.3f} s from disk, "
                  f"{r['ssd_cached_s']:.3f} s from the page cache; restore "
                  f"{_f(r['ssd_disk_restore_gbs'])} GB/s from disk ({_f(r['ssd_disk_restore_gbs_ttft'])} by TTFT), "
                  f"{_f(r['ssd_cached_restore_gbs'])} GB/s cached ({_f(r['ssd_cached_restore_gbs_ttft'])} by TTFT); "
                  f"cached tokens hot {r['hot_cached_tokens']}, SSD {r['ssd_disk_cached_tokens']}; "
                  f"read back at a restart in {r['preload_s']:.2f} s, then a hit {r['preloaded_s']:.3f} s", flush=True)
            shutil.rmtree(work / "ssd", ignore_errors=True)  # the next size starts from an empty folder
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _page_cache_variants(d: dict) -> str:
    """The page cache's rate into other memory than one reused buffer, where measured."""
    parts = [f"{d[k]:.2f} GB/s into {what}" for k, what in (("page_cache_touched_memory_gbs", "memory already touched"),
                                                            ("page_cache_new_memory_gbs", "new memory")) if d.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


def table(result: dict) -> str:
    d = result["disk"]
    lines = [
        ("| tokens | KV | cold | hot hit | SSD hit, from disk | SSD hit, page cache | restore from disk | "
         "restore, page cache | read back at a restart, then a hit |"),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["sizes"]:
        preloaded = f"{r['preload_s']:.2f} s, {r['preloaded_s']:.3f} s" if "preload_s" in r else "n/a"
        lines.append(
            f"| {r['tokens']} | {r['kv_bytes'] / 2**20:.0f} MiB | {r['cold_s']:.2f} s | {r['hot_s']:.3f} s | "
            f"{r['ssd_disk_s']:.3f} s | {r['ssd_cached_s']:.3f} s | {_f(r['ssd_disk_restore_gbs'])} GB/s | "
            f"{_f(r['ssd_cached_restore_gbs'])} GB/s | {preloaded} |")
    lines.append(f"\nDisk (same folder, one 16 MiB-read stream): {d['read_gbs']:.2f} GB/s, page cache "
                 f"{d['page_cache_gbs']:.2f} GB/s{_page_cache_variants(d)}.")
    w = result.get("writer")
    if w and "skipped" not in w:
        lines.append(f"Writer: {w['turns']} x {w['turn_tokens']} tokens stored at once, {w['write_drops']} of "
                     f"{w['blocks']} blocks dropped, drained at {w['write_gbs']:.2f} GB/s.")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--prefix", type=int, nargs="+", default=[8192, 20480, 61440],
                   help="prompt sizes, tokens (rounded down to a multiple of 256: whole blocks)")
    p.add_argument("--ssd-dir", default=None, help="a folder on the disk to measure (default: the temp folder)")
    p.add_argument("--hot-cache-size", default="8GiB", help="hot tier size: the largest prompt's KV must fit")
    p.add_argument("--ssd-cache-size", default="16GiB")
    p.add_argument("--disk-bytes", type=int, default=2 * 2**30, help="size of the disk-rate test file")
    p.add_argument("--write-turns", type=int, default=1, help="writer test: turns stored at once (0: skip)")
    p.add_argument("--write-turn-tokens", type=int, default=20000, help="writer test: new tokens a turn")
    p.add_argument("--json", default=None, help="write results here")


def cmd_cache(args) -> int:
    from tierlm.bench import runs
    from tierlm.bench.report import write_json

    if not args.model:
        args.model = str(runs.default_tokenizer(args))
    result = asyncio.run(run(args))
    print()
    print(table(result))
    if args.json:
        print(write_json(args.json, "cache", result, runs.command_line()))
    return 0


if __name__ == "__main__":  # also runs on a tree without the `cache` subcommand (a before/after)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(cmd_cache(parser.parse_args()))
