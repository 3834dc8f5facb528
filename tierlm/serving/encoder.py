"""An encoder served (embeddings, rerank): loaded on a worker thread of its
own, as a generative model's engine is, and fed by every client at once.
Requests queue; each pass takes what is waiting and runs it on the worker
thread, in batches of like lengths (tierlm.models.encoder); each request gets
its rows back. The pool loads, keeps and unloads it like any model (the same budget, LRU,
pin and keep-alive)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from tierlm.config import Settings
from tierlm.engine import workers
from tierlm.models.encoder import Encoder, load_encoder
from tierlm.models.loader import ModelInfo, read_model_info
from tierlm.pool.discovery import ModelEntry

log = logging.getLogger(__name__)


@dataclass
class _Job:
    pairs: bool  # rerank pairs (ids, types), else sequences of ids
    items: list
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EncoderEngine:
    """What the pool and the admin pages ask of an engine, for an encoder: its
    life (start, close, alive), its failure hooks, no scheduler."""

    scheduler = None  # no generation, no prefix cache
    profile = None
    degraded = None
    warming = False

    def __init__(self, name: str, path: Path, kind: str, settings: Settings):
        self.name, self.path, self.kind, self.settings = name, path, kind, settings
        self.encoder: Encoder | None = None
        self.memory_elsewhere = None  # set by the pool, read by a generative engine's guard
        self.on_memory_pressure = None
        self._queue: list[_Job] = []
        self.counts = {"requests": 0, "sequences": 0, "tokens": 0, "passes": 0}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._worker = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._worker = workers.lend(self.name)
        try:
            self.encoder = await loop.run_in_executor(self._worker, self._on_worker, self._load)
        except BaseException:
            self._give_back()
            raise
        self._task = asyncio.create_task(self._run(), name=f"encoder-{self.name}")

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def embed(self, sequences: list[list[int]]) -> np.ndarray:
        """Embeddings of token-id sequences (each within the model's max_tokens)."""
        return await self._submit(_Job(False, sequences))

    async def score(self, pairs: list[tuple[list[int], list[int]]]) -> np.ndarray:
        """Relevance scores of (ids, token types) pairs."""
        return await self._submit(_Job(True, pairs))

    async def _submit(self, job: _Job):
        if not self.is_alive:
            raise RuntimeError(f"the model {self.name} is not running")
        self.counts["requests"] += 1
        self.counts["sequences"] += len(job.items)
        self.counts["tokens"] += sum(len(item[0] if job.pairs else item) for item in job.items)
        self._queue.append(job)
        self._wake.set()
        return await job.done

    def get_stats(self) -> dict:
        """What /stats shows of it: requests, sequences and tokens encoded, passes run."""
        return {"model": self.name, "kind": self.kind, "waiting": len(self._queue), **self.counts}

    def abort_all_requests(self) -> None:
        """Requests end as their pass does: nothing long runs to abort."""

    def fail_all_requests(self, message: str, error_type: str = "overloaded") -> int:
        waiting, self._queue = self._queue, []
        for job in waiting:
            if not job.done.done():
                job.done.set_exception(RuntimeError(message))
        return len(waiting)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_all_requests(f"the model {self.name} was unloaded")
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._drop)
            self._give_back()

    # ---- passes ---------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                kind = self._queue[0].pairs
                jobs = [j for j in self._queue if j.pairs == kind]
                self._queue = [j for j in self._queue if j.pairs != kind]
                items = [item for job in jobs for item in job.items]
                self.counts["passes"] += 1
                try:
                    rows = await loop.run_in_executor(self._worker, self._on_worker, self._pass, kind, items)
                except Exception as e:  # noqa: BLE001 (each waiting request gets it)
                    log.exception("encoder pass of %s failed", self.name)
                    for job in jobs:
                        if not job.done.done():
                            job.done.set_exception(e)
                    continue
                start = 0
                for job in jobs:
                    if not job.done.done():
                        job.done.set_result(rows[start:start + len(job.items)])
                    start += len(job.items)

    def _pass(self, pairs: bool, items: list) -> np.ndarray:
        """Every item's row (on the worker; the encoder batches them by length)."""
        return self.encoder.score_pairs(items) if pairs else self.encoder.embed_ids(items)

    def _load(self) -> Encoder:
        s = self.settings
        return load_encoder(self.path, s.cpu_weights_dtype, s.memory_limit_bytes(), s.cpu_kernels, s.cpu_amx)

    def _on_worker(self, fn, *args):
        with mx.stream(self._worker.stream):
            return fn(*args)

    def _drop(self) -> None:
        self.encoder = None
        mx.clear_cache()

    def _give_back(self) -> None:
        workers.give_back(self._worker)
        self._worker = None


class ServedEncoder:
    """An encoder as the pool serves it: its names, kind (embedding or rerank),
    limits and engine."""

    def __init__(self, info: ModelInfo, engine: EncoderEngine, kind: str, aliases: tuple[str, ...] = (),
                 settings: Settings | None = None):
        self.info, self.engine, self.kind = info, engine, kind
        self.settings = settings or Settings()
        self.names = {info.name, str(info.path), *aliases}

    @property
    def encoder(self) -> Encoder:
        return self.engine.encoder

    @property
    def context(self) -> int:
        return self.encoder.max_tokens

    def matches(self, requested: str | None) -> bool:
        return requested is None or requested in self.names


async def serve_encoder(entry: ModelEntry, settings: Settings, aliases: tuple[str, ...] = ()) -> ServedEncoder:
    """Load an encoder and start its engine: what the pool keeps for it."""
    engine = EncoderEngine(entry.name, entry.path, entry.kind, settings)
    await engine.start()
    return ServedEncoder(read_model_info(entry.path, entry.name), engine, entry.kind, aliases, settings)
