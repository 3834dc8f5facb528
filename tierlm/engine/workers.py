"""The MLX worker threads, lent to engines and kept across them.

An engine runs every MLX call for its model on one thread, with one MLX stream
of its own (DESIGN.md, Threads). MLX never ends the thread behind a CPU stream,
neither the stream a thread makes nor its default one, and each of those
threads keeps a glibc malloc arena: an engine that made a thread and a stream
of its own left about 6 MiB of RSS behind per load and unload. So a worker (a
thread and its stream) outlives its engine: `lend` hands out an idle one, or
makes one when all are busy, and `give_back` parks it for the next engine. A
process makes as many workers as it ever had engines at once.

At interpreter exit each worker ends before the interpreter finalizes (as
`concurrent.futures` ends its threads), and first drops its MLX streams
(`mx.clear_streams`, what MLX asks of a thread that used it): what its
thread-local state held would otherwise be freed by the thread's C++ destructors
after its Python state is gone, racing the interpreter's finalization, which
killed the process with "terminate called without an active exception".
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import sys
import threading
from concurrent.futures import Executor, Future

import mlx.core as mx

log = logging.getLogger(__name__)
PR_SET_NAME = 15


class Worker(Executor):
    """A thread with an MLX stream, made on it for the device then in use; an
    Executor of one thread (`loop.run_in_executor`) that runs what it is given
    in order."""

    def __init__(self, index: int):
        self.index = index
        self.owner: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"mlx-worker-{index}")
        self._thread.start()
        self.device = mx.default_device()
        self.stream = self.submit(mx.new_stream, self.device).result()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ends the thread once what it was given before has run."""
        self._jobs.put(None)
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the caller gets it, as from a ThreadPoolExecutor
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
        try:
            mx.synchronize(self.stream)
        except Exception:
            log.debug("worker %d: its stream failed at the end", self.index, exc_info=True)
        mx.clear_streams()

    def name_thread(self, owner: str) -> None:
        """On the worker thread: name it after its engine (logs, top -H)."""
        thread = threading.current_thread()
        thread.name = f"mlx-{owner}"
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(thread.name.encode()[:15]), 0, 0, 0)
            except (OSError, AttributeError):
                pass


_lock = threading.Lock()
_all: list[Worker] = []
_idle: list[Worker] = []
_count = itertools.count()
made = 0  # workers made in this process (tests read it)


def lend(owner: str) -> Worker:
    """An idle worker (one for the device in use now), or a new one."""
    global made
    device = mx.default_device()
    with _lock:
        for i, worker in enumerate(_idle):
            if worker.device == device:
                del _idle[i]
                break
        else:
            worker = None
    if worker is None:
        worker = Worker(next(_count))
        with _lock:
            _all.append(worker)
            made += 1
    worker.owner = owner
    return worker


def give_back(worker: Worker) -> None:
    """Park a worker whose engine has ended; it must hold nothing of it."""
    worker.owner = None
    with _lock:
        _idle.append(worker)


def idle() -> int:
    with _lock:
        return len(_idle)


def _end_all() -> None:
    """At interpreter exit, before non-daemon threads are joined: every worker
    ends (after what it was given) and drops its MLX streams."""
    with _lock:
        ending = list(_all)
    for worker in ending:
        worker.shutdown(wait=False)
    for worker in ending:
        worker.shutdown(wait=True)


threading._register_atexit(_end_all)  # what concurrent.futures uses: before the threads are joined
