"""The MLX side of one engine: admits requests, runs mlx-lm's BatchGenerator.

Everything here runs on the engine's worker thread, except `add_request` and
`abort`, which only touch thread-safe containers that `step` drains.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from tierlm.cache.hot_tier import Block
from tierlm.cache.codecs import kv_cache
from tierlm.cache.prefix_cache import MIN_PART_TOKENS, PrefixCache
from tierlm.engine.detokenizer import IncrementalText, byte_level_table
from tierlm.engine.folded_prompt import can_fold
from tierlm.engine.lockstep import Lockstep, StepPlan
from tierlm.engine.memory_guard import MemoryGuard
from tierlm.engine.half_kv import batch_slots
from tierlm.engine.last_sequence import LastSequence, whole_kv
from tierlm.engine.quantized_kv import dequantized
from tierlm.engine.request import FinishReason, MemoryGuardError, Request, RequestOutput
from tierlm.engine.sampling import make_request_processors, make_request_sampler, repair_random_state
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.engine.stages import StageLog

log = logging.getLogger(__name__)


def _finite(logprob: float) -> float:
    """A token masked out (-inf) as vLLM shows it: JSON has no infinity."""
    return max(-9999.0, logprob)  # NaN too


class _RequestFault(Exception):
    """Something built for one request raised: that request fails, alone."""


@dataclass
class SchedulerConfig:
    max_running: int = 8
    prefill_step_size: int = 2048
    prefill_batch_size: int = 8
    stall_timeout_s: float = 300.0  # a running request with no progress this long ends with an error
    speculative_tokens: int = 0  # draft tokens a sequence verifies a step at most by default (0: no drafting)
    draft_model: Any = None  # a smaller model of the same tokenizer drafting too (engine.draft_model)
    kv_bits: int = 16  # what the batch keeps attention KV at (engine.quantized_kv)
    kv_half: bool = False  # ... and at 16, float16 where computed as float32 (engine.half_kv)
    key_scales: list | None = None  # per layer, what quantized keys are kept divided by (engine.key_scaling)
    kv_tail: int = 0  # decode steps quantized KV may hold at 16 bits (backends.Backend.kv_tail)


@dataclass
class _Running:
    request: Request
    text: IncrementalText
    completion_tokens: int = 0
    prefilled_tokens: int = 0
    first_token_time: float | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    keys: list[bytes] = field(default_factory=list)  # the prompt's block keys
    stored_blocks: int = 0  # leading blocks known to be in the cache
    hit_blocks: list[Block] = field(default_factory=list)  # held while running
    out: RequestOutput | None = None  # its output in the scheduler's outbox, if any
    progress: tuple[int, int, float] = (0, 0, 0.0)  # (prefilled, generated) as last seen, and when
    # A request with no stop string to watch and no logprobs to record takes the
    # fast path once its first token is out (`fast`): `_advance` only appends its
    # tokens to `new`, and their text is made for all of them at once when they
    # go out (`_emit`). At batch 32 on a GPU the worker's Python per token is the
    # step's bottleneck.
    deferrable: bool = False
    fast: bool = False
    new: list[int] = field(default_factory=list)
    # its prompt's end, past a block, runs with its last token in its first step
    # (folded_prompt): the blocks it completes are stored right after that step
    folded_blocks: bool = False


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
    # speculative decoding (speculative_batch.SpeculativeBatch counts them here)
    proposed_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of them, kept
    speculative_steps: int = 0  # steps that verified drafts


def _room_for(remainder: int) -> int:
    """Tokens of room a rebuilt hit's buffers get for its `remainder`: what
    mlx-lm's batch cache would grow them by (whole steps of 256), so that a
    lone hit enters the batch as it is (cache.codecs.RebuiltKVCache)."""
    return -(-remainder // BatchKVCache.step) * BatchKVCache.step


class Scheduler:
    def __init__(
        self, model, tokenizer, config: SchedulerConfig, guard: MemoryGuard, stream,
        cache: PrefixCache | None = None, elsewhere: Callable[[], int] | None = None,
        relieve: Callable[[int], bool] | None = None, lockstep: Lockstep | None = None,
    ):
        self.model, self.tokenizer, self.config, self.guard = model, tokenizer, config, guard
        # over several ranks: the leader decides, followers do as it did (engine/lockstep.py)
        self.lockstep = lockstep
        self.following = lockstep is not None and not lockstep.leader
        self._unshared: list[Request] = []  # the leader's arrivals since its last plan
        self._ended: list[str] = []  # the leader's requests ended since its last plan
        self._greedy = greedy_sampler  # the sampler greedy rows share
        if lockstep is not None:
            lockstep.stream = stream
            self._greedy = lockstep.follow_sampler() if self.following else lockstep.lead_sampler(greedy_sampler)
        self.cache = cache
        # the memory other models of the process hold (the pool's measure of them),
        # and what is asked to unload idle ones with the bytes a request lacks before
        # it is refused (whether it freed any)
        self.elsewhere, self.relieve = elsewhere, relieve
        self._inflight: dict[bytes, str] = {}  # block key -> request now prefilling it
        # block keys of the requests waiting for a prefix in flight: a 32k-token
        # prompt takes ~1.5 ms to hash, and they are looked up again every step
        self._deferred_keys: dict[str, list[bytes]] = {}
        # (request or None, tokens, caches) computed in the last step, stored at the
        # start of the next one: the step's outputs go out without waiting for it
        self._to_store: list[tuple[_Running | None, list[int], list]] = []
        self._stream = stream
        self._incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: set[str] = set()
        self._aborts_lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        # ids of the requests added and not yet ended: the engine checks that every
        # request it waits for is among them (none is ever left without an answer)
        self.live: set[str] = set()
        self._missing: set[str] = set()  # live ids found nowhere at the last `find_lost`
        self._faults: dict[str, str] = {}  # request id -> what its sampler or processors raised
        self._next_stall_check = 0.0
        self.running: dict[int, _Running] = {}  # by BatchGenerator uid
        self._uid_of: dict[str, int] = {}
        self.counters = SchedulerCounters()
        # called once per admitted request as it leaves the batch, on this thread:
        # (request, its first token's time or None, tokens generated, whether it
        # completed); the latency histograms of /metrics hang here
        self.on_request_end: Callable[[Request, float | None, int, bool], None] | None = None
        self.stage_log = StageLog()  # where recent requests' time went to their first token
        self.load = {"running": 0, "prefilling": 0, "waiting": 0}
        # One output per request, added to token by token until `take_outputs`:
        # no object per token, and the event loop gets one piece per request per
        # hand-off. `urgent`: something a client waits for (a first token, an end).
        self._outbox: dict[str, RequestOutput] = {}
        self.urgent = False
        # tests only: every step this much slower, so a race that needs a long
        # prefill gets it from configuration, not from a slow machine
        self._test_step_delay_s = float(os.environ.get("TIERLM_TEST_STEP_DELAY_S", "0"))
        self._gen = self._new_generator()
        self._bytes_table = byte_level_table(tokenizer.detokenizer)

    def _new_generator(self) -> BatchGenerator:
        options = dict(
            completion_batch_size=self.config.max_running,
            prefill_batch_size=min(self.config.prefill_batch_size, self.config.max_running),
            prefill_step_size=self.config.prefill_step_size,
            stream=self._stream,
        )
        draft = self.config.draft_model
        gen = SpeculativeGenerator(self.model, draft_model=draft,
                                   vocab_size=len(self.tokenizer.vocab) if draft is not None else None, **options)
        gen.speculation.counters = self.counters
        gen.fold_limit = self._fold_limit()
        if not self.config.speculative_tokens:  # off for this model: plain steps, mlx-lm's own KV layout
            gen.speculation.enabled = False
        if os.environ.get("TIERLM_TEST_DRAFT_ALWAYS"):  # tests only: drafts that do not depend on the clock
            gen.speculation.draft_always()
        return gen

    def _fold_limit(self) -> int:
        """The longest prompt end computed in one pass with its last token: a
        prefill chunk (an agent's tool output after a hit: one pass over the
        context, not a prompt pass and then a step over the context again). An
        end longer than a block has its blocks stored right after that pass
        (`_advance`), for requests that came meanwhile with the same start."""
        return self.config.prefill_step_size if can_fold(self.model) else 0

    def _draft_limit(self, params) -> int:
        """Draft tokens the request's sequence may verify a step (0: none): its
        own number if it sent one, where the model speculates at all."""
        wanted = params.speculative_tokens
        if not self.config.speculative_tokens or wanted is None:
            return self.config.speculative_tokens
        return wanted

    # ---- any thread -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.live.add(request.request_id)
        self._incoming.put(request)

    def abort(self, request_id: str) -> None:
        with self._aborts_lock:
            self._aborts.add(request_id)

    def speculation_rates(self) -> dict[str, dict[str, float]]:
        """Tokens a second the batch measured drafting and plain, by its number
        of sequences (speculation_switch): which way each size runs."""
        rates = dict(self._gen.speculation.switch.rates)  # a copy: the worker writes it
        out: dict[str, dict[str, float]] = {}
        for (drafting, rows), rate in sorted(rates.items(), key=lambda item: item[0][1]):
            out.setdefault(str(rows), {})["drafting" if drafting else "plain"] = round(rate, 1)
        return out

    def has_work(self) -> bool:
        # the leader's ends still to be shared: followers free those rows at once
        return bool(not self._incoming.empty() or self.waiting or self.running or self._aborts or self._to_store
                    or self._ended)

    # ---- worker thread ----------------------------------------------------

    def step(self, plan: StepPlan | None = None) -> None:
        """One scheduler step: aborts, admission, then one decode step plus one
        prefill chunk of everything admitted. Blocks computed by the previous step
        are stored first, before admission looks for them. What it produced waits
        in the outbox (`take_outputs`). A follower rank steps by the leader's `plan`."""
        if self._test_step_delay_s:
            time.sleep(self._test_step_delay_s)
        self._flush_stores()
        if self.following:
            self._follow(plan)
        elif self.lockstep is not None:
            self._lead()
        else:
            self._take_incoming()
            self._apply_aborts()
            self._insert_all(self._admit())
        if self.running:
            tic = time.perf_counter()
            self._advance()
            self.counters.steps += 1
            self.counters.step_seconds += time.perf_counter() - tic
        self._gen.speculation.left_behind = None  # a row's whole KV, not taken by its end: freed

    def _take_incoming(self) -> None:
        while not self._incoming.empty():
            request = self._incoming.get_nowait()
            self.waiting.append(request)
            if self.lockstep is not None:
                self._unshared.append(request)

    def _lead(self) -> None:
        """The leader's step start: its decisions, then the plan every rank follows."""
        self._take_incoming()
        self._apply_aborts()
        chosen = self._admit()
        plan = StepPlan([self._follower_copy(r) for r in self._unshared], self._ended,
                        [(r.request_id, lookup.tokens if lookup else 0) for r, lookup in chosen])
        self._unshared, self._ended = [], []
        self.lockstep.share(plan)
        self._insert_all(self._agree(chosen))

    def _follow(self, plan: StepPlan) -> None:
        """A follower's step start: the leader's arrivals, ends and admissions."""
        for request in plan.arrived:
            self.live.add(request.request_id)
            self.waiting.append(request)
        for request_id in plan.ended:
            self._drop(request_id)
        waiting = {r.request_id: r for r in self.waiting}
        chosen = []
        for request_id, _ in plan.admitted:
            request = waiting[request_id]
            self.waiting.remove(request)
            chosen.append((request, self._lookup(request)))
        self._insert_all(self._agree(chosen))

    def _agree(self, chosen: list) -> list:
        """Every rank's lookups cut to the shortest hit of any rank: a block one rank
        could not read (gone, damaged) is computed by all."""
        if not chosen or self.cache is None:
            return chosen
        agreed = self.lockstep.agree_min([lookup.tokens if lookup else 0 for _, lookup in chosen])
        for (_, lookup), tokens in zip(chosen, agreed):
            if lookup is not None:
                lookup.cut(tokens, self.cache.block_size)
        return chosen

    def _drop(self, request_id: str) -> None:
        """A follower: a request the leader ended, gone from the batch or the queue."""
        self.live.discard(request_id)
        uid = self._uid_of.get(request_id)
        if uid is not None:
            self._remove([uid])
            self._finish(uid, completed=False)
            return
        for request in [r for r in self.waiting if r.request_id == request_id]:
            self.waiting.remove(request)

    def _follower_copy(self, request: Request) -> Request:
        """The request as followers run it: what ends it from the token ids alone
        (the same stop ids), and nothing that only shapes sampling or output
        (grammar, stop strings, logprobs: the leader's; it ends them by plan)."""
        params = dataclasses.replace(request.params, stop=[], constraint=None, logprobs=None, ignore_eos=True,
                                     stop_token_ids=self._stop_ids(request.params))
        return Request(request.request_id, request.prompt_tokens, params)

    def find_lost(self) -> list[str]:
        """Between bursts: the requests added and not ended that are neither queued,
        waiting nor running (a bug lost them). An id must be missing at two calls in
        a row: one being added while this runs is not in the queue yet. They are
        forgotten here; the engine answers their readers."""
        self._take_incoming()
        known = {r.request_id for r in self.waiting} | self._uid_of.keys()
        missing = self.live - known
        lost, self._missing = missing & self._missing, missing - self._missing
        self.live -= lost
        return sorted(lost)

    def waiting_for_prefix(self) -> int:
        """Worker thread: how many waiting requests hold off for a prefix another
        request is computing now, their block keys kept for the next look-up (an
        abort or their admission forgets them)."""
        return len(self._deferred_keys)

    def take_outputs(self) -> list[RequestOutput]:
        """Everything produced since the last call, one output per request."""
        failed = {}
        for uid, state in self.running.items():
            if state.new:
                try:
                    self._emit(state)
                except Exception as e:  # its detokenizer: it ends now, alone
                    failed[uid] = f"detokenizing failed: {e}"
            state.out = None
        self._fail_in_batch(failed)
        outputs, self._outbox, self.urgent = list(self._outbox.values()), {}, False
        self._publish_load()
        return outputs

    def fail_running(self, message: str) -> None:
        """After a step raised in a way no one request can be blamed for: end the
        requests in the batch with an error and rebuild the batch state. Blocks
        computed before the failure stay cached; waiting requests are served next."""
        for uid, state in list(self.running.items()):
            self._finish(uid, completed=False)
            self._error(state.request, message)
            self.counters.failed_requests += 1
        self._faults.clear()
        if self.cache is not None:
            self.cache.last = None
        try:
            self._flush_stores()
        except Exception:
            log.warning("blocks computed before the failure were not stored", exc_info=True)
            self._to_store.clear()
        try:
            self._gen.close()
        except Exception:
            log.warning("closing the failed batch raised", exc_info=True)
        if repair_random_state():  # a compiled sampler failed outside its guard
            log.warning("the global random state was broken by the failure: reseeded")
        self._gen = self._new_generator()

    def close(self) -> None:
        if self.lockstep is not None and self.lockstep.leader and not self.lockstep.broken:
            try:
                self.lockstep.share(StepPlan(stop=True))  # the followers end too
            except RuntimeError as e:  # a rank is gone already
                log.warning("the other ranks could not be told to stop: %s", e)
        self._flush_stores()
        self._gen.close()
        if self.cache is not None:
            self.cache.close()

    def _apply_aborts(self) -> None:
        with self._aborts_lock:
            ids, self._aborts = self._aborts, set()
        if not ids:
            return
        for request in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(request)
            self._deferred_keys.pop(request.request_id, None)
            self._end(request, FinishReason.ABORT)
            self.counters.aborted_requests += 1
        for request_id in ids:
            uid = self._uid_of.get(request_id)
            if uid is not None:
                self._remove([uid])  # what it computed stays cached: a client that stops and asks again
                state = self._finish(uid, completed=False)
                self._end(state.request, FinishReason.ABORT).completion_tokens = state.completion_tokens
                self.counters.aborted_requests += 1

    def _admit(self) -> list[tuple[Request, object]]:
        """The waiting requests this step admits, with their lookups, in order; the
        others wait, or end refused."""
        chosen: list[tuple[Request, object]] = []
        if not self.waiting:
            return chosen
        # what running requests may still grow into, plus what this step admits
        promised, deferred = self._growth_ahead(), []
        while self.waiting and len(self.running) + len(chosen) < self.config.max_running:
            request = self.waiting.popleft()
            n, max_tokens = len(request.prompt_tokens), request.params.max_tokens
            try:
                self.guard.check_alone(n, max_tokens)
            except MemoryGuardError as e:
                self.counters.refused_requests += 1
                self._error(request, str(e), error_type="memory")
                continue
            kept = self._reach_of_last(request)
            # a request continuing the last sequence writes into its buffers, already held
            full = self.guard.request_bytes(n, max_tokens)
            needed = max(0, full - self.cache.last.nbytes) if kept else full
            if (self.running or promised) and not self._make_room(needed, promised, keep_last=bool(kept)):
                self.waiting.appendleft(request)
                break  # it fits alone: wait until running requests free memory
            if not (self.running or promised) and (missing := self._beside_others(needed)):
                self.counters.refused_requests += 1
                self._error(request, str(MemoryGuardError(self.guard.limit + missing, self.guard.limit, n,
                                                          max_tokens)), error_type="memory")
                continue
            lookup = self._lookup(request)
            if lookup and self._prefix_in_flight(lookup):
                deferred.append(request)  # another request is computing this prefix now
                self._deferred_keys[request.request_id] = lookup.keys
                continue
            if kept and kept >= lookup.tokens:  # its turn's KV as it is, rather than the blocks
                lookup.kept, lookup.kept_tokens, self.cache.last = self.cache.last, kept, None
            elif kept:  # the blocks hold more: it is rebuilt, its whole KV new
                self.cache.last, needed = None, full
            promised += needed
            chosen.append((request, lookup))
            if lookup:  # a later request of this step with the same prefix waits for it
                for key in lookup.keys[len(lookup.blocks) :]:
                    self._inflight.setdefault(key, request.request_id)
        self.waiting.extendleft(reversed(deferred))
        return chosen

    def _insert_all(self, chosen: list[tuple[Request, object]]) -> None:
        for i, (request, lookup) in enumerate(chosen):
            request.stages.mark("queue")
            try:
                self._insert(request, lookup)
                request.stages.mark("restore")
            except BaseException as e:
                if lookup:  # no request waits for a prefix this one will not compute
                    for key in lookup.keys:
                        if self._inflight.get(key) == request.request_id:
                            del self._inflight[key]
                if not isinstance(e, _RequestFault):  # the batch failed: the rest wait for the next
                    self.waiting.extendleft(reversed([r for r, _ in chosen[i + 1 :]]))
                    raise
                log.warning("request %s refused at admission: %s", request.request_id, e)
                self.counters.failed_requests += 1
                self._error(request, str(e))

    def _reach_of_last(self, request: Request) -> int:
        """How much of the request's prompt the last sequence's KV holds (0: none,
        and the last sequence is dropped: it is kept only for its next turn). A
        few shared tokens (a chat template's first ones) are no hit, as for a
        part block alone."""
        last = self.cache.last if self.cache is not None else None
        if last is None:
            return 0
        reach = last.reach(request.prompt_tokens)
        if reach < MIN_PART_TOKENS:
            self.cache.last, reach = None, 0
        return reach

    def _lookup(self, request: Request):
        if self.cache is None:
            return None
        return self.cache.lookup(request.prompt_tokens, self._deferred_keys.pop(request.request_id, None))

    def _growth_ahead(self) -> int:
        """What running requests may still add. One decoding: the KV of the tokens it
        may still generate. One still prefilling: all it was promised at admission
        less the KV it has prefilled, since its prefill runs over several steps and
        memory it has yet to take is not free for another (on a slow CPU requests
        were admitted between one's chunks, three prefills at once past the limit)."""
        return sum(self.may_still_take(s) for s in self.running.values())

    def may_still_take(self, state: _Running) -> int:
        max_tokens = state.request.params.max_tokens
        if state.first_token_time is not None:
            return self.guard.decode_bytes(max_tokens - state.completion_tokens)
        promised = self.guard.request_bytes(len(state.request.prompt_tokens), max_tokens)
        return max(0, promised - self.guard.profile.kv_bytes_per_token * state.prefilled_tokens)

    def _make_room(self, needed: int, promised: int, keep_last: bool = False) -> bool:
        """Whether a request of `needed` bytes fits now, evicting cached blocks if
        that is what it takes (and the last sequence first, unless the request
        continues it: `keep_last`)."""
        missing = self.guard.shortfall(needed, promised)
        if missing and not keep_last and self.cache is not None and self.cache.last is not None:
            self.cache.last = None  # cheaper to lose than blocks: its blocks are cached too
            missing = self.guard.shortfall(needed, promised)
        if missing and self.cache is not None and self.cache.hot.nbytes:
            self.cache.hot.evict_to(max(0, self.cache.hot.nbytes - missing))
            missing = self.guard.shortfall(needed, promised)
        return missing == 0

    def _beside_others(self, needed: int) -> int:
        """With nothing of this engine's running: the bytes a request of `needed`
        lacks beside the weights of the other models loaded here (0: it fits),
        after asking for idle ones to be unloaded (the pool's prefill-eviction
        hook). Their weights, not MLX's live count: what this engine's last batch
        leaves behind for a moment is not theirs."""
        if self.elsewhere is None:
            return 0
        own = self.guard.profile.weight_bytes
        missing = max(0, own + self.elsewhere() + needed - self.guard.limit)
        if missing and self.relieve is not None and self.relieve(missing):
            missing = max(0, own + self.elsewhere() + needed - self.guard.limit)
        return missing

    def _prefix_in_flight(self, lookup) -> bool:
        hit = len(lookup.blocks)
        return hit < len(lookup.keys) and lookup.keys[hit] in self._inflight

    def _insert(self, request: Request, lookup) -> None:
        params = request.params
        prompt = request.prompt_tokens
        hit = lookup.tokens if lookup else 0
        try:  # what is built for this request alone: if it raises, the request fails alone
            on_fault = self._fault_reporter(request.request_id)
            stop_ids = self._stop_ids(params)
            sampler = self._sampler(params, on_fault)
            processors = [] if self.following else make_request_processors(params, on_fault)
            c = self.config
            plain = self._plain_kv  # the batch keeps the KV as the rebuild gives it
            room = _room_for(len(prompt) - hit) if plain else 0
            if lookup and lookup.kept is not None:  # the last sequence's buffers (engine/last_sequence.py)
                hit, caches = lookup.kept_tokens, [lookup.kept.take(lookup.kept_tokens)]
            else:
                caches = [self.cache.rebuild(lookup.blocks, lookup.part, lookup.part_tokens, room)] if hit else None
            if not plain:
                caches = [batch_slots(caches[0] if caches else make_prompt_cache(self.model), c.kv_bits, c.kv_half,
                                      c.key_scales, c.kv_tail)]
            text = IncrementalText(self.tokenizer.detokenizer, params.stop, self._bytes_table,
                                   params.keep_leading_space)
        except Exception as e:
            raise _RequestFault(f"could not start generation: {e}") from e
        try:
            (uid,) = self._gen.insert_segments(
                [self._segments(prompt, hit)],
                max_tokens=[params.max_tokens],
                caches=caches,
                all_tokens=[prompt[:hit]],
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[StopSequences([[t] for t in stop_ids])],
            )
        except Exception as e:  # the batch may be half changed: the engine rebuilds it
            self._error(request, f"generation failed: {e}")
            self.counters.failed_requests += 1
            raise
        state = _Running(request, text, cached_tokens=hit, progress=(0, 0, time.monotonic()),
                         deferrable=not text.watches_stops and params.logprobs is None)
        if self.cache is not None:
            state.folded_blocks = len(self._gen.folds.by_uid.get(uid, ())) > self.cache.block_size
        if limit := self._draft_limit(params):
            self._gen.speculation.limits[uid] = limit
        if lookup:
            state.keys, state.stored_blocks, state.hit_blocks = lookup.keys, len(lookup.blocks), lookup.held
            self.cache.acquire(lookup.held)
            self.cache.record(lookup, len(prompt))
            for key in lookup.keys[len(lookup.blocks) :]:
                self._inflight.setdefault(key, request.request_id)
            self._log_lookup(request, lookup)
        self.running[uid] = state
        self._uid_of[request.request_id] = uid
        self.counters.prompt_tokens += len(prompt)

    def _stop_ids(self, params) -> list[int]:
        """The token ids that end a request where they are sampled."""
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos or params.constraint is not None:
            stop_ids += sorted(self.tokenizer.eos_token_ids)
        return stop_ids

    def _sampler(self, params, on_fault):
        """The request's sampler; over several ranks, the leader's tokens on every
        rank (greedy rows share one sampler, as on one rank)."""
        if params.is_greedy:
            return self._greedy
        if self.following:
            return self.lockstep.follow_sampler()
        sampler = make_request_sampler(params, on_fault)
        return self.lockstep.lead_sampler(sampler) if self.lockstep is not None else sampler

    def _segments(self, prompt: list[int], start: int) -> list[list[int]]:
        """Cut the uncached part of the prompt where blocks should be stored: at
        every block boundary for snapshot caches (their state exists only where
        prefill pauses), at prefill-chunk boundaries for sliceable KV (not at all
        where what is left fits one chunk: its blocks are stored when it ends)."""
        if self.cache is None:
            return [prompt[start:]]
        size = self.cache.block_size
        step = size if not self.cache.sliceable else max(size, self.config.prefill_step_size // size * size)
        if self.cache.sliceable and len(prompt) - start <= step:
            # A hit's remainder that fits one chunk is one pass, even across a chunk
            # boundary: a cut there cost a second pass and a copy of the whole
            # prefix to store one block (an H100, 20k-token context: 150 ms, not 40).
            return [prompt[start:]]
        cuts = list(range((start // step + 1) * step, len(prompt), step))
        bounds = [start, *cuts, len(prompt)]
        return [prompt[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def _log_lookup(self, request: Request, lookup) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        n = len(request.prompt_tokens)
        if lookup.diverged_at is None:
            log.debug("%s: %d of %d prompt tokens from cache", request.request_id, lookup.tokens, n)
        else:
            log.debug("%s: %d of %d prompt tokens from cache; diverged from the nearest cached "
                      "prefix at token %d", request.request_id, lookup.tokens, n, lookup.diverged_at)

    def _advance(self) -> None:
        prompt_responses, gen_responses = self._gen.next()
        for r in prompt_responses:
            state = self.running.get(r.uid)
            if state is None:
                continue
            state.prefilled_tokens = r.progress[0]
            if self.cache is None or not r.end_of_segment:
                continue
            if r.end_of_prompt and state.folded_blocks:
                # its blocks, stored at the next step's start (after the first token
                # went out); requests for them wait till then
                self._store(state, *self._folded_prompt_kv(r.uid, state.request.prompt_tokens))
                continue
            if r.end_of_prompt and self._prompt_end_can_wait(state):
                # The prompt's last token enters the cache with the first decode
                # step: only a block ending there (a prompt of whole blocks) is new
                # now. Extracting the cache would copy the whole prefix again and
                # wait for the step in flight. Others may compute it meanwhile.
                self._release_inflight(state, state.stored_blocks)
                continue
            # a segment's end, or a snapshot cache's last whole block
            caches, tokens = self._gen.extract_cache([r.uid])[r.uid]
            self._store(state, tokens, caches)
        if self.following:
            self._follow_generated(gen_responses)
            return
        stopped, scored = [], None
        for r in gen_responses:
            state = self.running.get(r.uid)
            if state is None:
                continue
            if state.fast and r.finish_reason is None:  # most tokens: see _Running.fast
                state.completion_tokens += 1
                state.new.append(r.token)
                continue
            if state.request.params.logprobs is not None and r.finish_reason != "stop":
                scored = scored or []  # a stop token (EOS) is never shown: it gets no entry
                scored.append((state, r))
            try:
                ended = self._on_token(state, r.token, r.finish_reason)
            except Exception as e:  # its detokenizer or stop matcher: this request's alone
                ended = self._fault(state, r.finish_reason is None, f"detokenizing failed: {e}")
            if ended:
                if r.finish_reason is None:
                    stopped.append(r.uid)  # a stop string: BatchGenerator still runs it
                elif self.cache is not None:
                    self._store(state, r.all_tokens, self._kept_whole(r.uid, r.all_tokens, r.prompt_cache))
                self._finish(r.uid)
        if scored:
            self._record_logprobs(scored)
        if stopped:
            self._remove(stopped)
        self.counters.generated_tokens += len(gen_responses)
        if self._faults:
            self._end_faulted()
        self._check_stalls()

    def _follow_generated(self, gen_responses) -> None:
        """A follower's tokens: only what the generator ends itself (a stop token, the
        length) ends a request here; every other end comes in the leader's plan."""
        for r in gen_responses:
            state = self.running.get(r.uid)
            if state is None:
                continue
            state.completion_tokens += 1
            if r.finish_reason is not None:
                if self.cache is not None:
                    self._store(state, r.all_tokens, r.prompt_cache)
                self._finish(r.uid)
        self.counters.generated_tokens += len(gen_responses)

    def _record_logprobs(self, scored: list) -> None:
        """The chosen token's logprob and the top alternatives, for the requests that
        asked, in one evaluation for the whole step. BatchGenerator's `logprobs` is
        the log-softmax of the logits after the request's processors (logit_bias,
        penalties, a grammar's mask) and before its sampler (temperature, top_p,
        top_k, min_p), as vLLM's "processed" logprobs; for a request with no
        processor they are the model's own log-softmax."""
        k = max(state.request.params.logprobs for state, _ in scored)
        with mx.stream(self._stream):
            rows = mx.stack([r.logprobs for _, r in scored]).astype(mx.float32)
            tokens = mx.array([[r.token] for _, r in scored])
            arrays = [mx.take_along_axis(rows, tokens, axis=-1)[:, 0]]
            if k:
                top = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
                arrays += [top, mx.take_along_axis(rows, top, axis=-1)]
            values = [a.tolist() for a in arrays]
        for i, (state, r) in enumerate(scored):
            out = state.out
            if out is None:  # its detokenizer failed before the output began: it ends in error
                continue
            n = state.request.params.logprobs
            alternatives = []
            if n:
                pairs = zip(values[1][i], map(_finite, values[2][i]))
                alternatives = sorted(pairs, key=lambda p: -p[1])[:n]
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.append((r.token, _finite(values[0][i]), alternatives))

    def _fault_reporter(self, request_id: str):
        """What a request's sampler and processors call with what they raised."""
        return lambda message: self._faults.setdefault(request_id, message)

    def _fault(self, state: _Running, in_batch: bool, message: str) -> bool:
        """A request whose own piece raised ends with an error; whether it ended now
        (else it leaves the batch with the other faulted ones, `_end_faulted`)."""
        if in_batch:
            self._faults.setdefault(state.request.request_id, message)
            return False
        log.warning("request %s failed: %s", state.request.request_id, message)
        self.counters.failed_requests += 1
        self._error(state.request, message)
        return True

    def _end_faulted(self) -> None:
        """Take the requests whose sampler, processors or detokenizer raised out of
        the batch, each with its error; the others go on."""
        faults, self._faults = self._faults, {}
        self._fail_in_batch({self._uid_of[rid]: message for rid, message in faults.items()
                             if rid in self._uid_of})

    def _fail_in_batch(self, messages: dict[int, str]) -> None:
        """End these running requests (by uid) with their errors; what they computed stays cached."""
        if not messages:
            return
        self._remove(list(messages))
        for uid, message in messages.items():
            self._fault(self._finish(uid, completed=False), False, message)

    def _check_stalls(self) -> None:
        """About once a second: a running request that has neither prefilled nor
        generated anything for `stall_timeout_s` ends with an error (a watchdog
        for a request the batch has stopped serving)."""
        now = time.monotonic()
        if now < self._next_stall_check:
            return
        self._next_stall_check = now + 1.0
        stalled = {}
        for uid, state in self.running.items():
            seen = (state.prefilled_tokens, state.completion_tokens)
            if seen != state.progress[:2]:
                state.progress = (*seen, now)
            elif now - state.progress[2] > self.config.stall_timeout_s:
                stalled[uid] = f"no progress for {self.config.stall_timeout_s:g} s"
        self._fail_in_batch(stalled)

    def _prompt_end_can_wait(self, state: _Running) -> bool:
        """Whether the end of the prompt can wait for the request's end: sliced KV
        keeps every block to the end, and a snapshot cache has no block to store
        there unless the prompt is whole blocks."""
        return self.cache.sliceable or len(state.request.prompt_tokens) % self.cache.block_size != 0

    def _remove(self, uids: list[int]) -> None:
        """Take sequences out of the batch, storing the blocks they computed."""
        extracted = self._gen.remove(uids, return_prompt_caches=self.cache is not None)
        for uid, (caches, tokens) in extracted.items():
            self._store(None, tokens, self._kept_whole(uid, tokens, caches))
        self._gen.speculation.left_behind = None  # without a prefix cache, or outside a step: freed

    def _kept_whole(self, uid: int, tokens: list[int], extracted: list) -> list:
        """The caches a leaving sequence is stored from: where it was the batch's
        last row and its KV plain, its batch buffers as they are, kept as the last
        sequence too (engine/last_sequence.py); else the copy the batch extracted."""
        behind = self._gen.speculation.take_left_behind(uid)
        whole = None if behind is None else self._buffer_views(behind, len(tokens))
        if whole is None:
            return extracted
        self.cache.last = LastSequence(list(tokens), whole)
        # Stored from views of the buffers as they are now: an abort's blocks are
        # stored a step late, and the next turn may have taken and written into
        # the buffers meanwhile (its write then copies instead of going in place).
        n = len(tokens)
        return [kv_cache(layer.keys[..., :n, :], layer.values[..., :n, :], n) for layer in whole]

    def _folded_prompt_kv(self, uid: int, prompt: list[int]) -> tuple[list[int], list]:
        """The tokens and KV of a sequence whose folded prompt end just ran, as a
        prompt batch leaves them: all but the last token (a repeat of the prompt,
        which computes at least that token, then finds the part block after its
        whole blocks by key, on the SSD tier after a restart). A lone plain row's
        are views of the batch's buffers (the store copies only the new blocks
        out, at the next step's start, before the batch writes again); others
        are extracted (a copy of the whole KV)."""
        n = len(prompt) - 1
        caches = self._buffer_views(self._gen.speculation.prompt_cache, len(prompt))
        if caches is None:
            caches, _ = self._gen.extract_cache([uid])[uid]
        return prompt[:n], [kv_cache(c.keys, c.values, n) for c in dequantized(caches)]

    def _buffer_views(self, layer_caches: list, tokens: int) -> list | None:
        """A one-row batch's KV as views of its buffers (last_sequence.whole_kv),
        where they are plain 16-bit KV on one rank; else None (extract a copy)."""
        if self.lockstep is not None or not self._plain_kv:
            return None
        return whole_kv(layer_caches, tokens)

    @property
    def _plain_kv(self) -> bool:
        """Whether the batch keeps 16-bit KV in mlx-lm's own layout (not quantized
        or halved: half_kv.batch_slots)."""
        return self.config.kv_bits == 16 and not self.config.kv_half

    def _store(self, state: _Running | None, tokens: list[int], caches: list) -> None:
        """Keep the computed blocks, at the start of the next step (`_flush_stores`)."""
        self._to_store.append((state, list(tokens), dequantized(caches)))

    def _flush_stores(self) -> None:
        """Store what the last step computed, in one evaluation; the keys a waiting
        request may be held for are released as their blocks land."""
        if not self._to_store:
            return
        pending, self._to_store = self._to_store, []
        items = [(tokens, state.keys if state else [], caches, state.stored_blocks if state else 0)
                 for state, tokens, caches in pending]
        for (state, _, _), stored in zip(pending, self.cache.store_many(items)):
            if state is not None:
                for key in state.keys[state.stored_blocks : stored]:
                    self._inflight.pop(key, None)
                state.stored_blocks = max(state.stored_blocks, stored)

    def _on_token(self, state: _Running, token: int, gen_finish: str | None) -> bool:
        """Adds a generated token to the request's output; whether it ended the request.
        Runs for the tokens the fast path does not take (`_Running.fast`), after
        those it took."""
        if state.new:
            self._emit(state)
        state.completion_tokens += 1
        out = state.out
        if out is None:
            out = state.out = self._output_of(state.request)
            out.cached_tokens = state.cached_tokens
        if state.first_token_time is None:
            state.first_token_time = out.first_token_time = time.monotonic()
            state.request.stages.mark("prefill")
            self.stage_log.add(state.request.stages)
            state.fast = state.deferrable
            self.urgent = True
        reason = None
        if gen_finish == "stop":  # a stop token: counted, never shown as text
            text, reason = state.text.finish(), FinishReason.STOP
        else:
            text = state.text.add(token)
            if state.text.stopped:
                reason, out.stop_sequence = FinishReason.STOP, state.text.matched
            elif gen_finish == "length":
                text, reason = text + state.text.finish(), FinishReason.LENGTH
        if text:
            out.text += text
        out.token_ids.append(token)
        out.completion_tokens = state.completion_tokens
        if reason is None:
            return False
        self._end(state.request, reason)
        return True

    def _emit(self, state: _Running) -> None:
        """The tokens the fast path left (`_Running.new`) go into the request's
        output, their text made in one go; what the detokenizer raises, the
        caller handles (they are gone from `new` either way)."""
        tokens, state.new = state.new, []
        request = state.request
        text = state.text.add_many(tokens)
        out = state.out or self._outbox.get(request.request_id)
        if out is None:  # its first piece since the last hand-off (the usual case): built whole
            out = self._outbox[request.request_id] = RequestOutput(
                request.request_id, text, tokens, prompt_tokens=len(request.prompt_tokens),
                completion_tokens=state.completion_tokens, cached_tokens=state.cached_tokens)
        else:
            out.text += text
            out.token_ids += tokens
            out.completion_tokens = state.completion_tokens
        state.out = out

    def _finish(self, uid: int, completed: bool = True) -> _Running:
        state = self.running.pop(uid)
        self._gen.speculation.limits.pop(uid, None)
        if state.new:  # it leaves without a last token (an abort, a fault): what it made goes out
            try:
                self._emit(state)
            except Exception:  # it ends anyway, with the reason it ends for
                log.warning("request %s: its last text failed", state.request.request_id, exc_info=True)
        del self._uid_of[state.request.request_id]
        self.counters.finished_requests += completed
        if self.on_request_end is not None:
            self.on_request_end(state.request, state.first_token_time, state.completion_tokens, completed)
        if self.cache is not None:
            self.cache.release(state.hit_blocks)
            self._release_inflight(state)
        return state

    def _release_inflight(self, state: _Running, first_block: int = 0) -> None:
        """Requests waiting for these blocks of the prompt stop waiting for this one."""
        for key in state.keys[first_block:]:
            if self._inflight.get(key) == state.request.request_id:
                del self._inflight[key]

    def _output_of(self, request: Request) -> RequestOutput:
        """The request's output in the outbox, started if it has none yet."""
        out = self._outbox.get(request.request_id)
        if out is None:
            out = self._outbox[request.request_id] = RequestOutput(
                request.request_id, prompt_tokens=len(request.prompt_tokens))
        return out

    def _end(self, request: Request, reason: FinishReason) -> RequestOutput:
        self.live.discard(request.request_id)
        if self.lockstep is not None and not self.following:
            self._ended.append(request.request_id)  # the followers end it at the next plan
        out = self._output_of(request)
        out.finished, out.finish_reason, self.urgent = True, reason, True
        return out

    def _error(self, request: Request, message: str, error_type: str = "internal") -> None:
        out = self._end(request, FinishReason.ERROR)
        out.error, out.error_type = message, error_type

    def _publish_load(self) -> None:
        # One assignment of a fresh dict: the event loop reads it without a lock.
        self.load = {
            "running": len(self.running),
            "prefilling": sum(1 for s in self.running.values() if s.first_token_time is None),
            "waiting": len(self.waiting),
        }
