"""The SSD tier: one safetensors file per block, under a size cap, surviving restarts.

Threads: `read_chain`, `enqueue` and `flush` are called from the
engine's worker thread; a writer thread does the file I/O; a scan thread
rebuilds the index at start-up without delaying readiness. The index (key ->
file size, oldest first) is shared under a lock.

Reading: a lookup knows every key it will want, so `read_chain` works ahead of
need on a run of blocks: reader threads read and check each file's header; the
worker has MLX load each file whose header passed (`mx.load` on a CPU stream:
MLX's own I/O threads read the tensors straight into MLX memory, no numpy in
between, while the worker goes on); the checksum and token ids of each loaded
block are checked over that memory in place, on the reader threads, a few
blocks ahead of the one the worker hands out. At most READ_AHEAD_BYTES are
loaded ahead. On a GPU the loaded blocks are unified memory, moved to the GPU
by their first use (the hit's one concatenation). (Asking the kernel to read
the files ahead, posix_fadvise WILLNEED, made reads from the disk slower here.)

Queue policy: blocks wait for the writer in a queue bounded by bytes
(`max_pending_bytes`). When it is full a new block is dropped (counted in
`write_drops`) rather than blocking decoding or growing memory: the cache is
an optimization, and a dropped block is only recomputed later. The bound
(1 GiB) holds a whole 20k-token turn of a 1B model (32 KiB of KV a token:
640 MiB) enqueued at once, which write-through does when the turn ends; the
writer drains it at the disk's speed (`write_seconds`, `pending_peak_bytes`).

Durability: a block file's bytes are fsynced before it is linked into place,
and its folder after, so after a crash or power loss a name is either absent or
names a whole file.

Sharing a folder (several models of one server, or replicas on one host or on a
shared file system): a block file never changes once it has its name (it is
hard-linked into place, which fails if the name exists, rather than renamed over
it), so a reader sees a whole file, the same file, or none. A block another
process wrote is found on disk by `contains` the first time it is asked for.
The cap is for the folder as a whole: the writer re-reads the folder (every
block file, whoever wrote it, by last use) at most RESCAN_SECONDS apart, and
before every write once the folder is near the cap (while the walk costs at
most a tenth of the writer's time), then evicts the least recently used files,
whoever wrote them. Between two walks the folder can pass the cap by what the
others wrote meanwhile. A file another process evicted while this one reads it
is a miss, not an error.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from tierlm.cache import block_file, kv_quant
from tierlm.cache.hot_tier import Block

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_STOP = object()
# Test hook: TIERLM_TEST_SSD_PAUSE=<point>[:<n>] stops the writer for good at that point
# of its n-th write (default the first), so a test can SIGKILL the process there.
PAUSE_POINTS = ("partial", "written", "renamed")  # half the temp file; whole and fsynced; renamed
READ_THREADS = min(16, max(4, 2 * (os.cpu_count() or 1)))  # header reads wait on the disk
READ_AHEAD_BYTES = 256 * 2**20  # a chain's files loaded ahead of the worker, at most
CHECKS_AHEAD = 4  # blocks loaded and being checked on the reader threads while the worker goes on
RESCAN_SECONDS = 10.0  # a writer re-reads the shared folder at least this often
NEAR_CAP = 0.9  # from this share of the cap on, re-read before every write (time permitting)


def _fsync_dir(folder: Path) -> None:
    """A new or renamed directory entry survives power loss only once its folder is synced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(f, parts: list[memoryview]) -> None:
    """Every byte of `parts`, in order, to the unbuffered file `f`."""
    for part in parts:
        while part.nbytes:
            part = part[f.write(part) :]


def _link_into_place(tmp: Path, path: Path) -> bool:
    """Give the whole file `tmp` the block's name unless a file already has it (another
    process sharing the folder wrote the block first): whether `tmp` got it. A hard
    link fails on an existing name, so a named file never changes under a reader;
    a file system without hard links gets an atomic rename instead."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:
        os.replace(tmp, path)
    return True


def _first_bytes(parts: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for part in parts:
        out.append(part[: max(0, n)])
        n -= part.nbytes
    return out


@dataclass
class SSDStats:
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0  # worker time in reads, waits on the readers included
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0  # writer time per written file: serializing, writing, fsync
    write_drops: int = 0
    pending_peak_bytes: int = 0
    errors: int = 0
    evictions: int = 0
    walks: int = 0  # the folder re-read for what other processes wrote and evicted


@dataclass
class _Ahead:
    """A block of the chain being read: its header's check on a reader thread,
    then its arrays being loaded by MLX."""
    key: bytes
    tokens: tuple[int, ...]
    size: int
    header: Future  # -> (Header, None), (None, why) for a bad file, (None, None) for one gone
    arrays: dict | None = None  # loading, then loaded
    check: Future | None = None  # the checksum and token ids over the loaded arrays
    error: str | None = None  # why loading or checking it failed
    gone: bool = False  # its file went away before MLX could load it


COULD_NOT_OPEN = "Failed to open"  # in MLX's error from a load whose open(2) failed (a test holds MLX to it)


def _could_not_open(path: Path, e: Exception) -> bool:
    """Whether loading a block file failed because it could not be opened: it was
    evicted by another process sharing the folder (and may be there again,
    written anew by it, when we look): a miss, not a file that failed a check."""
    return not path.exists() or COULD_NOT_OPEN in str(e)


class SSDTier:
    def __init__(self, directory: Path, capacity_bytes: int, fingerprint: bytes, signature: str,
                 max_pending_bytes: int = 2**30, min_free_bytes: int = 2 * 2**30):
        self.dir, self.capacity = Path(directory), capacity_bytes
        self.fingerprint, self.signature = fingerprint, signature
        self.max_pending_bytes, self.min_free_bytes = max_pending_bytes, min_free_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = SSDStats()
        self._index: OrderedDict[str, int] = OrderedDict()  # hex key -> bytes, oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._epoch = 0  # bumped by clear(): blocks queued before it must not land
        self._walked_at, self._walk_seconds = 0.0, 0.0  # the folder's last walk: when, how long
        self.scanned = threading.Event()
        self._pause_at, _, nth = os.environ.get("TIERLM_TEST_SSD_PAUSE", "").partition(":")
        if self._pause_at and self._pause_at not in PAUSE_POINTS:
            raise ValueError(f"TIERLM_TEST_SSD_PAUSE: {self._pause_at!r} is none of {PAUSE_POINTS}")
        self._pause_nth, self._writes_begun = int(nth or 1), 0
        self._readers: ThreadPoolExecutor | None = None  # started on the first read
        self._writer = threading.Thread(target=self._write_loop, name="ssd-writer", daemon=True)
        self._writer.start()
        threading.Thread(target=self._scan, name="ssd-scan", daemon=True).start()

    # ---- paths and index ----------------------------------------------------

    def path_for(self, hex_key: str) -> Path:
        return self.dir / hex_key[:2] / hex_key[2:4] / f"{hex_key}{SUFFIX}"

    def indexed(self, key: bytes) -> bool:
        """Whether the block is in the index (no look at the folder: for probing
        many keys at once)."""
        with self._lock:
            return key.hex() in self._index

    def contains(self, key: bytes) -> bool:
        """Whether the block is on disk: in the index, or a file that another process
        (or a model sharing the folder) wrote since the last walk, indexed from now."""
        if self.indexed(key):
            return True
        hex_key = key.hex()
        path = self.path_for(hex_key)
        if not path.is_file():
            return False
        if self.scanned.is_set():  # else the scan will index it
            self._index_file(hex_key, path)
        return True

    def _index_file(self, hex_key: str, path: Path) -> None:
        """Index a block file another process wrote, if it is still there."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        with self._lock:
            self._bytes += size - self._index.pop(hex_key, 0)
            self._index[hex_key] = size

    def _index_drop(self, hex_key: str) -> None:
        with self._lock:
            self._bytes -= self._index.pop(hex_key, 0)

    def _walk(self) -> list[tuple[float, str, int]]:
        """(last use, hex key, bytes) of every block file in the folder, whoever wrote
        it; leftovers of interrupted writes (a minute old: not a live writer's) removed."""
        entries = []
        for folder, _, files in os.walk(self.dir):
            for name in files:
                path = Path(folder) / name
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                if name.endswith(".tmp"):
                    if time.time() - stat.st_mtime > 60:
                        path.unlink(missing_ok=True)
                elif name.endswith(SUFFIX):
                    entries.append((stat.st_mtime, name[: -len(SUFFIX)], stat.st_size))
                    if len(entries) % 10000 == 0 and not self.scanned.is_set():
                        log.info("SSD cache scan: %d files so far", len(entries))
        return sorted(entries)

    def _scan(self) -> None:
        """Index what earlier processes left: every block file, this model's or not,
        counts against the cap."""
        tic = time.monotonic()
        entries = self._walk()
        with self._lock:
            for _, hex_key, size in reversed(entries):  # the oldest ends up first
                if hex_key not in self._index:  # a write of this process may have come first
                    self._index[hex_key] = size
                    self._index.move_to_end(hex_key, last=False)
                    self._bytes += size
            self._walked_at, self._walk_seconds = time.monotonic(), time.monotonic() - tic
        log.info("SSD cache %s: %d blocks, %.0f MiB (cap %.0f MiB), scanned in %.1fs", self.dir, len(entries),
                 self._bytes / 2**20, self.capacity / 2**20, time.monotonic() - tic)
        self._enforce_cap()
        self.scanned.set()

    def _rewalk_if_due(self) -> None:
        """Writer thread: the index rebuilt from the folder, if the last walk is old, or
        the folder is near the cap and walking costs little beside writing (see the
        module docstring). Files of other processes join it, files they evicted leave."""
        since = time.monotonic() - self._walked_at
        near = self._bytes >= NEAR_CAP * self.capacity and since >= 10 * self._walk_seconds
        if self.scanned.is_set() and (since >= RESCAN_SECONDS or near):
            self._rewalk()

    def _rewalk(self) -> None:
        tic = time.monotonic()
        entries = self._walk()
        with self._lock:
            self._index = OrderedDict((hex_key, size) for _, hex_key, size in entries)
            self._bytes = sum(self._index.values())
            self._walked_at, self._walk_seconds = time.monotonic(), time.monotonic() - tic
        self.stats.walks += 1

    # ---- reading (worker thread) -----------------------------------------

    def read_chain(self, wanted: list[tuple[bytes, tuple[int, ...]]]):
        """Worker thread: the verified blocks of `wanted` ((key, token ids) in chain
        order), one by one, stopping before the first that is missing or fails a
        check (that file is deleted). Files are worked on ahead (module docstring);
        closing the generator early cancels the header reads not started."""
        if not wanted:
            return
        self._start_readers()
        ahead: deque[_Ahead] = deque()
        items = iter(wanted)
        ahead_bytes = 0
        tic = time.perf_counter()

        def fill() -> None:
            nonlocal ahead_bytes
            while not ahead or (ahead_bytes < READ_AHEAD_BYTES and len(ahead) < 4 * READ_THREADS):
                item = next(items, None)
                if item is None:
                    break
                with self._lock:
                    size = self._index.get(item[0].hex(), 0)
                ahead.append(_Ahead(*item, size, self._readers.submit(self._open, *item)))
                ahead_bytes += size
            for block in ahead:  # loads start in chain order, from checked headers only
                if block.arrays is None:  # the headers are read in parallel: a short wait
                    if block.header.result()[0] is None or not self._start_load(block):
                        break

        try:
            fill()
            while ahead:
                for block in itertools.islice(ahead, CHECKS_AHEAD):  # checked on the readers meanwhile
                    if block.check is None and not self._begin_check(block):
                        break
                block = ahead.popleft()
                ahead_bytes -= block.size
                header, payload = self._finish(block)
                if payload is None:
                    return
                fill()
                self.stats.reads += 1
                self.stats.read_bytes += header.nbytes
                with self._lock:
                    if block.key.hex() in self._index:
                        self._index.move_to_end(block.key.hex())
                packed = payload if isinstance(payload, mx.array) or kv_quant.is_quantized(payload) else None
                self.stats.read_seconds += time.perf_counter() - tic
                yield Block(block.key, header.parent, block.tokens, None if packed is not None else payload,
                            nbytes=0, packed=packed)
                tic = time.perf_counter()
        finally:
            for block in ahead:
                block.header.cancel()
            self.stats.read_seconds += time.perf_counter() - tic

    def _start_readers(self) -> None:
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ssd-read")

    def newest_keys(self) -> list[bytes]:
        """Every indexed block file's key, the most recently used first, whoever
        wrote it (read_whole tells this model's)."""
        with self._lock:
            return [bytes.fromhex(k) for k in reversed(self._index)]

    def read_whole(self, key: bytes) -> Block | None:
        """Worker thread: the block in `key`'s file, its token ids read from the
        file (the checksum covers them), where the file is this model's in this
        layout; None otherwise, or if it is gone. A file that fails a check is
        deleted, as on a lookup. For preloading: no prompt asked for it."""
        self._start_readers()
        meta = block_file.metadata_of(self.path_for(key.hex()))
        if meta is None or meta.get("fingerprint") != self.fingerprint.hex() or meta.get("signature") != self.signature:
            return None  # another model's, another layout's, or gone: not ours to judge
        count = meta.get("token_count", "")
        header, error = self._open(key, (0,) * int(count)) if count.isdigit() else (None, "no token count")
        block = _Ahead(key, (), 0, Future())
        block.header.set_result((header, error))
        if header is None or not self._begin_check_tokens_read(block):
            self._reject(key, error or block.error)
            return None
        header, payload = self._finish(block)
        if payload is None:
            return None
        self.stats.reads += 1
        self.stats.read_bytes += header.nbytes
        packed = payload if isinstance(payload, mx.array) or kv_quant.is_quantized(payload) else None
        return Block(key, header.parent, block.tokens, None if packed is not None else payload, nbytes=0,
                     packed=packed)

    def _begin_check_tokens_read(self, block: _Ahead) -> bool:
        """Worker thread: load the block's arrays and take its token ids as the
        wanted ones (read_whole), then check it as a chain's block is checked."""
        if not self._start_load(block):
            return False
        try:
            mx.eval(block.arrays["tokens"])
            block.tokens = tuple(int(t) for t in np.asarray(block.arrays["tokens"]))
        except (KeyError, RuntimeError, ValueError) as e:
            block.gone = _could_not_open(self.path_for(block.key.hex()), e)
            block.error = None if block.gone else f"unreadable: {e}"
            return False
        return self._begin_check(block)

    def _begin_check(self, block: _Ahead) -> bool:
        """Worker thread: wait for the block's arrays, then check them on a reader
        thread; False if the block cannot get that far (gone, or failed)."""
        header, _ = block.header.result()
        if header is None or block.error is not None or block.gone:
            return False
        if block.arrays is None and not self._start_load(block):
            return False
        try:
            mx.eval(list(block.arrays.values()))
            parts, stored = block_file.loaded_parts(header, block.arrays)
        except (block_file.BlockFileError, RuntimeError, ValueError) as e:
            block.gone = _could_not_open(self.path_for(block.key.hex()), e)
            block.error = None if block.gone else str(e)
            return False
        block.check = self._readers.submit(block_file.check_data, header, parts, stored, block.tokens)
        return True

    def _finish(self, block: _Ahead):
        """Worker thread: (header, payload) of a block that passed every check; else
        (header or None, None), the block rejected."""
        header, error = block.header.result()
        if header is not None and (block.check is not None or self._begin_check(block)):
            try:
                block.check.result()
                return header, block_file.payload_of(header, block.arrays)
            except block_file.BlockFileError as e:
                error = str(e)
        self._reject(block.key, None if block.gone else error if header is None else block.error or error)
        return header, None

    def _start_load(self, block: _Ahead) -> bool:
        """Worker thread: MLX reads the file's tensors on its I/O threads, from now;
        False if it cannot (the file went away or changed since its header was read)."""
        path = self.path_for(block.key.hex())
        try:
            block.arrays = mx.load(str(path), stream=mx.cpu)
        except (RuntimeError, ValueError) as e:
            block.gone = _could_not_open(path, e)  # evicted by another process since its header was read
            block.error = None if block.gone else f"unreadable: {e}"
            return False
        mx.async_eval(list(block.arrays.values()))
        return True

    def _reject(self, key: bytes, error: str | None) -> None:
        """A block of the chain that is gone (`error` None) or failed a check (its
        file is deleted: its tokens will be computed again)."""
        hex_key = key.hex()
        if error is not None:
            log.warning("SSD block %s rejected (%s): deleted, its tokens will be computed", hex_key[:16], error)
            self.stats.errors += 1
            self.path_for(hex_key).unlink(missing_ok=True)
        self._index_drop(hex_key)

    def _open(self, key: bytes, tokens: tuple[int, ...]):
        """A reader thread, plain I/O: (the file's checked header, None), else
        (None, why it was refused) or (None, None) for a file that is gone."""
        path = self.path_for(key.hex())
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None, None
        except OSError as e:
            return None, f"unreadable: {e}"
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            length = block_file.header_length(head)
            head += os.pread(fd, length, 8) if len(head) == 8 and 8 + length <= size else b""
            header = block_file.check_header(head, size, key, tokens, self.fingerprint, self.signature)
        except block_file.BlockFileError as e:
            return None, str(e)
        except OSError as e:
            return None, f"unreadable: {e}"
        finally:
            os.close(fd)
        try:
            os.utime(path)  # recently used: evicted last
        except FileNotFoundError:
            pass
        return header, None

    # ---- writing ----------------------------------------------------------

    def enqueue(self, block: Block, wait: float = 0.0) -> bool:
        """Worker thread: encode now (MLX -> numpy), write later. Drops the block if
        the queue is full, unless `wait` seconds are allowed (used at shutdown)."""
        if self.contains(block.key):
            return True
        tensors, meta = block_file.encode(block.key, block.parent, block.tokens, block.payload(),
                                          self.fingerprint, self.signature)
        size = sum(t.nbytes for t in tensors.values())
        deadline = time.monotonic() + wait
        while self._pending_bytes + size > self.max_pending_bytes:
            if time.monotonic() >= deadline:
                self.stats.write_drops += 1
                return False
            time.sleep(0.01)
        with self._lock:
            self._pending_bytes += size
            self.stats.pending_peak_bytes = max(self.stats.pending_peak_bytes, self._pending_bytes)
        self._queue.put((block.key.hex(), tensors, meta, size, self._epoch))
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued block is on disk (or `timeout`); whether they are."""
        deadline = time.monotonic() + timeout
        while self._pending_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._pending_bytes <= 0

    def close(self, timeout: float = 60.0) -> bool:
        """Wait for the queued blocks to land, within `timeout`, then stop the
        writer; whether everything queued was written and the writer ended. A
        writer still busy finishes its queue on its own (a daemon thread)."""
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        self._queue.put(_STOP)
        self._writer.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.scanned.is_set() and not self._writer.is_alive():
            self._rewalk()  # the last to close sees every process's writes: the folder ends under its cap
            self._enforce_cap()
        return flushed and not self._writer.is_alive()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            hex_key, tensors, meta, size, epoch = item
            try:
                if epoch == self._epoch:  # else cleared while it waited
                    self._write(hex_key, tensors, meta, epoch)
            except OSError as e:
                self.stats.errors += 1
                log.warning("SSD write of block %s failed: %s", hex_key[:16], e)
            finally:
                with self._lock:
                    self._pending_bytes -= size

    def _write(self, hex_key: str, tensors, meta, epoch: int) -> None:
        tic = time.perf_counter()
        parts = block_file.to_bytes(tensors, meta)
        size = sum(p.nbytes for p in parts)
        path = self.path_for(hex_key)
        self._rewalk_if_due()
        if path.exists():  # another process sharing the folder wrote it meanwhile
            self._index_file(hex_key, path)
            return
        new_dirs = [d for d in (path.parent.parent, path.parent) if not d.is_dir()]
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in new_dirs:  # the new folders' own entries must survive too
            _fsync_dir(d.parent)
        if shutil.disk_usage(path.parent).free - size < self.min_free_bytes:
            self.stats.write_drops += 1  # never fill the disk
            return
        tmp = path.with_name(f".{hex_key}.{uuid.uuid4().hex[:8]}.tmp")
        self._writes_begun += 1
        with open(tmp, "wb", buffering=0) as f:
            if self._pausing("partial"):
                _write_all(f, _first_bytes(parts, size // 2))
                self._hold("partial", tmp, path)
            _write_all(f, parts)
            os.fsync(f.fileno())  # the bytes are on disk before any name points at them
        if self._pausing("written"):
            self._hold("written", tmp, path)
        with self._lock:  # a clear() either sees this file in the index or has made it stale
            landed = epoch == self._epoch and _link_into_place(tmp, path)
            if landed:
                self._bytes += size - self._index.pop(hex_key, 0)
                self._index[hex_key] = size
        tmp.unlink(missing_ok=True)
        if not landed:
            if epoch == self._epoch:
                self._index_file(hex_key, path)
            return
        if self._pausing("renamed"):
            self._hold("renamed", tmp, path)
        _fsync_dir(path.parent)  # the new name itself survives power loss
        self.stats.writes += 1
        self.stats.write_bytes += size
        self.stats.write_seconds += time.perf_counter() - tic
        self._enforce_cap()

    # ---- test hook (TIERLM_TEST_SSD_PAUSE, see PAUSE_POINTS) --------------

    def _pausing(self, point: str) -> bool:
        return point == self._pause_at and self._writes_begun == self._pause_nth

    def _hold(self, point: str, tmp: Path, path: Path) -> None:
        """Leave a marker beside the cache folder saying where the writer stopped, then
        hold this thread until the test kills the process."""
        marker = self.dir.with_name(self.dir.name + ".test-pause.json")
        marker.with_suffix(".tmp").write_text(json.dumps({"point": point, "tmp": str(tmp), "path": str(path)}))
        os.replace(marker.with_suffix(".tmp"), marker)  # the test reads a whole marker
        while True:
            time.sleep(60)

    def _enforce_cap(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.capacity or not self._index:
                    return
                hex_key, size = self._index.popitem(last=False)
                self._bytes -= size
            self.path_for(hex_key).unlink(missing_ok=True)
            self.stats.evictions += 1

    def clear(self) -> int:
        """Delete this model's block files. Other models sharing the folder keep
        theirs: a file's header says which model it was written for. Blocks still
        queued for the writer, or being written, are dropped too."""
        with self._lock:
            self._epoch += 1
            keys = list(self._index)
        mine = [k for k in keys if block_file.fingerprint_of(self.path_for(k)) == self.fingerprint.hex()]
        for hex_key in mine:
            self._index_drop(hex_key)
            self.path_for(hex_key).unlink(missing_ok=True)
        return len(mine)

    def snapshot_stats(self) -> dict:
        s = self.stats
        with self._lock:
            files, size = len(self._index), self._bytes
        return {
            "dir": str(self.dir), "files": files, "bytes": size, "capacity_bytes": self.capacity,
            "pending_bytes": self._pending_bytes, "scanned": self.scanned.is_set(),
            "reads": s.reads, "read_bytes": s.read_bytes, "read_seconds": round(s.read_seconds, 6),
            "writes": s.writes, "write_bytes": s.write_bytes, "write_seconds": round(s.write_seconds, 6),
            "write_drops": s.write_drops, "pending_peak_bytes": s.pending_peak_bytes,
            "max_pending_bytes": self.max_pending_bytes, "errors": s.errors, "evictions": s.evictions,
            "walks": s.walks,
        }
