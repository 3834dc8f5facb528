"""The MLX side of one engine: admits requests, runs mlx-lm's BatchGenerator.

Everything here runs on the engine's worker thread, except `add_request` and
`abort`, which only touch thread-safe containers that `step` drains.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from mlx_lm.generate import BatchGenerator, StopSequences

from tierlm.engine.detokenizer import IncrementalText
from tierlm.engine.memory_guard import MemoryGuard
from tierlm.engine.request import FinishReason, MemoryGuardError, Request, RequestOutput
from tierlm.engine.sampling import make_request_processors, make_request_sampler

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_running: int = 8
    prefill_step_size: int = 2048
    prefill_batch_size: int = 8


@dataclass
class _Running:
    request: Request
    text: IncrementalText
    completion_tokens: int = 0
    prefilled_tokens: int = 0
    first_token_time: float | None = None


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    refused_requests: int = 0
    step_seconds: float = 0.0
    steps: int = 0


class Scheduler:
    def __init__(self, model, tokenizer, config: SchedulerConfig, guard: MemoryGuard, stream):
        self.model, self.tokenizer, self.config, self.guard = model, tokenizer, config, guard
        self._stream = stream
        self._incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: set[str] = set()
        self._aborts_lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, _Running] = {}  # by BatchGenerator uid
        self._uid_of: dict[str, int] = {}
        self.counters = SchedulerCounters()
        self.load = {"running": 0, "prefilling": 0, "waiting": 0}
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.config.max_running,
            prefill_batch_size=min(self.config.prefill_batch_size, self.config.max_running),
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
        )

    # ---- any thread -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._incoming.put(request)

    def abort(self, request_id: str) -> None:
        with self._aborts_lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(not self._incoming.empty() or self.waiting or self.running or self._aborts)

    # ---- worker thread ----------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step: aborts, admission, then one decode step plus one
        prefill chunk of everything admitted."""
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get_nowait())
        outputs = self._apply_aborts()
        outputs += self._admit()
        if self.running:
            tic = time.perf_counter()
            outputs += self._advance()
            self.counters.steps += 1
            self.counters.step_seconds += time.perf_counter() - tic
        self._publish_load()
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After a step raised: end every request with an error and start clean."""
        outputs = [self._error_output(r.request, message) for r in self.running.values()]
        outputs += [self._error_output(r, message) for r in self.waiting]
        self.counters.failed_requests += len(outputs)
        self.running.clear()
        self._uid_of.clear()
        self.waiting.clear()
        self._gen.close()
        self._gen = self._new_generator()
        return outputs

    def close(self) -> None:
        self._gen.close()

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._aborts_lock:
            ids, self._aborts = self._aborts, set()
        if not ids:
            return []
        outputs = []
        for request in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(request)
            outputs.append(self._final(request, FinishReason.ABORT, 0))
        for request_id in ids:
            uid = self._uid_of.get(request_id)
            if uid is not None:
                self._gen.remove([uid])
                state = self._finish(uid)
                outputs.append(self._final(state.request, FinishReason.ABORT, state.completion_tokens))
        self.counters.aborted_requests += len(outputs)
        return outputs

    def _admit(self) -> list[RequestOutput]:
        outputs, admitted_bytes = [], 0
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            n = len(request.prompt_tokens)
            try:
                self.guard.check_alone(n)
            except MemoryGuardError as e:
                self.waiting.popleft()
                self.counters.refused_requests += 1
                outputs.append(self._error_output(request, str(e), error_type="memory"))
                continue
            busy = self.running or admitted_bytes
            if busy and not self.guard.fits_now(n, pending_bytes=admitted_bytes):
                break  # it fits alone: wait until running requests free memory
            self.waiting.popleft()
            admitted_bytes += self.guard.prefill_bytes(n)
            self._insert(request)
        return outputs

    def _insert(self, request: Request) -> None:
        params = request.params
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += sorted(self.tokenizer.eos_token_ids)
        (uid,) = self._gen.insert(
            [request.prompt_tokens],
            max_tokens=[params.max_tokens],
            samplers=[make_request_sampler(params)],
            logits_processors=[make_request_processors(params)],
            stop_sequences=[StopSequences([[t] for t in stop_ids])],
        )
        text = IncrementalText(self.tokenizer.detokenizer, params.stop)
        self.running[uid] = _Running(request, text)
        self._uid_of[request.request_id] = uid
        self.counters.prompt_tokens += len(request.prompt_tokens)

    def _advance(self) -> list[RequestOutput]:
        prompt_responses, gen_responses = self._gen.next()
        for r in prompt_responses:
            if r.uid in self.running:
                self.running[r.uid].prefilled_tokens = r.progress[0]
        outputs, stopped = [], []
        for r in gen_responses:
            state = self.running.get(r.uid)
            if state is None:
                continue
            output = self._on_token(state, r.token, r.finish_reason)
            if output.finished:
                self._finish(r.uid)
                if r.finish_reason is None:
                    stopped.append(r.uid)  # a stop string: BatchGenerator still runs it
            outputs.append(output)
        if stopped:
            self._gen.remove(stopped)
        self.counters.generated_tokens += len(gen_responses)
        return outputs

    def _on_token(self, state: _Running, token: int, gen_finish: str | None) -> RequestOutput:
        state.completion_tokens += 1
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
        reason = None
        if gen_finish == "stop":  # a stop token: counted, never shown as text
            text, reason = state.text.finish(), FinishReason.STOP
        else:
            text = state.text.add(token)
            if state.text.stopped:
                reason = FinishReason.STOP
            elif gen_finish == "length":
                text, reason = text + state.text.finish(), FinishReason.LENGTH
        return RequestOutput(
            request_id=state.request.request_id,
            text=text,
            token_ids=[token],
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(state.request.prompt_tokens),
            completion_tokens=state.completion_tokens,
            first_token_time=state.first_token_time if state.completion_tokens == 1 else None,
        )

    def _finish(self, uid: int) -> _Running:
        state = self.running.pop(uid)
        del self._uid_of[state.request.request_id]
        self.counters.finished_requests += 1
        return state

    def _final(self, request: Request, reason: FinishReason, completion_tokens: int) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_tokens),
            completion_tokens=completion_tokens,
        )

    def _error_output(self, request: Request, message: str, error_type: str = "internal") -> RequestOutput:
        output = self._final(request, FinishReason.ERROR, 0)
        output.error, output.error_type = message, error_type
        return output

    def _publish_load(self) -> None:
        # One assignment of a fresh dict: the event loop reads it without a lock.
        self.load = {
            "running": len(self.running),
            "prefilling": sum(1 for s in self.running.values() if s.first_token_time is None),
            "waiting": len(self.waiting),
        }
