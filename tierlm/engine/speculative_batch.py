"""Speculative decoding inside the continuous batch.

mlx-lm's `GenerationBatch` feeds each running sequence one token per step. Here
a step may feed every sequence its last sampled token followed by draft tokens
(drafts.PromptLookup): one forward pass scores all of them, each sequence keeps
the longest prefix of its draft that its own sampling agrees with, and the KV of
the tokens it rejected is taken back out of the batch's cache (each row ends
where it ends: ragged_kv, and ragged_quantized_kv for KV kept at 8 or 4 bits)
before anything, the prefix cache included, can read it. A sequence without a
draft takes part in the same pass with its one token.

This module, ragged_kv and folded_prompt are where tierlm reaches inside mlx-lm's
batch generation (the generation batch's fields, BatchKVCache's buffers, the
prompt batch's hand-over); tests/test_speculation.py and
tests/test_folded_prompt.py fail loudly if they change.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from tierlm.engine.draft_model import DraftModelSource
from tierlm.engine.drafts import Acceptance, PromptLookup
from tierlm.engine.first_token import FirstTokensFirst
from tierlm.engine.folded_prompt import FoldedEnds, FoldingPromptBatch
from tierlm.engine.quantized_kv import QuantizedBatchKVCache
from tierlm.engine.half_kv import HalfBatchKVCache, RaggedHalfBatchKVCache
from tierlm.engine.last_sequence import LeavesLastRow
from tierlm.engine.ragged_kv import RaggedBatchKVCache, RaggedWindowKVCache
from tierlm.engine.ragged_quantized_kv import RaggedQuantizedBatchKVCache
from tierlm.engine.sampling import RandomSampler
from tierlm.engine.speculation_switch import SpeculationSwitch

log = logging.getLogger(__name__)


@dataclass
class SpeculationCounters:
    proposed_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of them, kept
    speculative_steps: int = 0  # steps that verified drafts


def rollback_supported(model) -> str | None:
    """Why the model's KV cannot take back rejected tokens (None: it can).
    Attention KV can, sliding windows included (ragged_kv); a recurrent state
    cannot without keeping a copy of it per token."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds <= {KVCache.__name__, RotatingKVCache.__name__}:
        return None
    return f"its cache ({', '.join(sorted(kinds))}) cannot drop rejected tokens"


class StepCosts:
    """Seconds a step takes by the tokens it feeds (sequences times width),
    averaged over recent steps of that size, and the width that makes the most
    tokens a second. A size not measured yet is estimated from its measured
    neighbours, beyond the largest at the slope of the last two (at first, a
    quarter of the average cost of a token): widths are tried a step wider at a
    time while they pay, so trying costs little where they do not. A size's
    first few steps are not counted when one took over three times its
    estimate (on a GPU they compile kernels: tens of milliseconds, and seconds
    for a process's first verification). Now and then
    (`probe_every`) the runner-up is tried again, as costs move with the
    context's length and the machine's load."""

    def __init__(self, weight: float = 0.3, probe_every: int = 50):
        self.seconds: dict[int, float] = {}
        self.weight, self.probe_every = weight, probe_every
        self._choices = 0
        self._seen: dict[int, int] = {}  # tokens -> steps of that size so far

    def record(self, tokens: int, seconds: float) -> None:
        seen = self._seen[tokens] = self._seen.get(tokens, 0) + 1
        if seen <= 3 and self.seconds and seconds > 3 * self.estimate(tokens):
            return  # one of its first steps compiled kernels (a GPU): not what the size costs
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else old + self.weight * (seconds - old)

    def estimate(self, tokens: int) -> float:
        known = self.seconds
        if tokens in known:
            return known[tokens]
        below = sorted(n for n in known if n < tokens)
        above = [n for n in known if n > tokens]
        if not below:  # smaller than anything measured: what the smallest costs
            return known[min(above)]
        lo = below[-1]
        if above:
            hi = min(above)
            return known[lo] + (known[hi] - known[lo]) * (tokens - lo) / (hi - lo)
        slope = (known[lo] - known[below[-2]]) / (lo - below[-2]) if len(below) > 1 else known[lo] / lo / 4
        return known[lo] + max(0.0, slope) * (tokens - lo)

    def best_width(self, rows: int, made: list[float]) -> int:
        """The width (1: a plain step) of the most tokens a second for `rows`
        sequences, `made[w - 1]` being the tokens a step of width w is expected
        to make."""
        if rows not in self.seconds:
            return 1  # measure a plain step first
        rates = sorted(((tokens / self.estimate(rows * w), w) for w, tokens in enumerate(made, 1)), reverse=True)
        self._choices += 1
        if len(rates) > 1 and self._choices % self.probe_every == 0:
            return rates[1][1]
        return rates[0][1]


class WidestSteps(StepCosts):
    """Every step as wide as its drafts."""

    def best_width(self, rows: int, made: list[float]) -> int:
        return len(made)


class AlwaysDrafting(SpeculationSwitch):
    """Every step may draft, whatever windows measure."""

    def step(self, now: float, rows: int) -> bool:
        super().step(now, rows)
        self.drafting = True
        return True


class AlternateDrafting(SpeculationSwitch):
    """Steps that verify drafts and plain steps in turn: a warm-up's, so that a
    GPU compiles what a plain step after a verification runs (and the other
    way round) before requests need it."""

    _drafted_last = False

    def step(self, now: float, rows: int) -> bool:
        super().step(now, rows)
        self.drafting = self._drafted_last = not self._drafted_last
        return self.drafting


class SpeculativeBatch(LeavesLastRow, FirstTokensFirst):
    """A GenerationBatch whose steps verify prompt-lookup drafts. Sequences draft
    only when `limits[uid]` (their request's draft length) is set, greedy or
    sampled (a RandomSampler draws each position with the key a plain step would
    use there), grammars and penalties included; others join each step with
    their one token, exactly as in a plain step. First tokens of rows entering
    it empty go out before their second step (first_token)."""

    def configure(self, ngram_min: int, ngram_max: int, lookup=None) -> None:
        self.limits: dict[int, int] = {}  # uid -> draft tokens at most per step (the scheduler's)
        # anything with these fields (the scheduler puts its own counters here)
        self.counters = SpeculationCounters()
        self._ngrams = (ngram_min, ngram_max)
        self._lookup_class = lookup or PromptLookup
        self._lookups: dict[int, PromptLookup] = {}
        self._acceptance: dict[int, Acceptance] = {}
        self.costs = StepCosts()
        self.switch = SpeculationSwitch()  # whether drafting pays at all, window by window
        self.enabled = True
        self.pad_widths = False  # verify at widths of 2, 4, 8...: the few shapes a GPU compiled
        self.align_plain = False  # plain steps first move ragged rows to one end (ragged_kv.align)
        self._plain: tuple[int, float] | None = None  # (rows, seconds) of a plain step not yet recorded
        self._waited = 0.0
        self._dry_run = self._dry_steps = 0  # steps not to look for drafts after finding none
        self.draft_source: DraftModelSource | None = None  # a draft model, where one is set
        self._draft_seconds = 0.0  # what the draft model took this step

    def draft_alternately(self) -> None:
        """Every other step verifies its drafts at their full width (warm-up jobs)."""
        self.costs, self.switch = WidestSteps(), AlternateDrafting()

    def draft_always(self) -> None:
        """Every step verifies its drafts at their full width, whatever steps
        cost: tests and instruments whose drafts must not depend on how fast
        this machine is."""
        self.costs, self.switch = WidestSteps(), AlwaysDrafting()

    def next(self) -> list:
        if (posting := self.posting_step()) is not None:
            return posting
        if not self.enabled:  # off for this model: mlx-lm's own step, nothing measured or faded
            return super().next()
        if not self.uids:
            return []
        rows = len(self.uids)
        step = self._drafts() if self.switch.step(time.perf_counter(), rows) else None
        self._record_plain()
        tic = time.perf_counter()
        if step is None:
            for uid in self.uids:  # no new evidence: what a sequence writes changes, its record fades
                if uid in self._acceptance:
                    self._acceptance[uid].fade()
            if self.align_plain:
                for c in self.prompt_cache:
                    c.align()
            responses = super().next()
            self._plain = (rows, time.perf_counter() - tic)
        else:
            drafts, width = step
            responses = self._verify(drafts, width)
            self.costs.record(rows * width, time.perf_counter() - tic + self._draft_seconds)
        self.switch.made(len(responses))
        return responses

    def _record_plain(self) -> None:
        """The last plain step's cost, once known: a plain step starts the next
        one's forward pass and returns before it ends (mlx-lm's pipeline), so
        what a draft's wait for its sampled tokens took (`_waited`) was still
        that step's."""
        if self._plain is not None:
            rows, seconds = self._plain
            self.costs.record(rows, seconds + self._waited)
        self._plain, self._waited = None, 0.0

    # ---- drafting ---------------------------------------------------------

    def _drafts(self) -> tuple[list[list[int]], int] | None:
        """Each row's draft for this step, cut to the width that pays most, and
        the tokens a row feeds (that width, padded where `pad_widths`), or None
        for a plain step. Whether any width could pay is asked first, from
        the drafts' longest lengths: a plain step then keeps the pipelined step
        (the last sampled tokens are not waited for)."""
        if self._dry_steps:
            self._dry_steps -= 1
            return None
        limits = [self._limit(i) for i in range(len(self.uids))]
        width = self._width(limits) if any(limits) else 1
        if width == 1:
            return None
        tic = time.perf_counter()
        mx.eval(self._next_tokens)
        self._waited = time.perf_counter() - tic
        last = self._next_tokens.tolist()
        drafts = [self._lookup(i).propose(k, last[i]) if k else [] for i, k in enumerate(limits)]
        self._draft_seconds = 0.0
        if self.draft_source is not None and any(k and not d for k, d in zip(limits, drafts)):
            self._model_drafts(limits, drafts, last, width - 1)
        self._note_dry(not any(drafts))
        width = self._width([len(d) for d in drafts])
        if width == 1:
            return None
        fed = padded_width(width, 1 + max(limits)) if self.pad_widths else width  # tokens a row feeds
        return [d[: width - 1] for d in drafts], fed

    def _model_drafts(self, limits: list[int], drafts: list[list[int]], last: list[int], k: int) -> None:
        """The draft model's k tokens for the rows that found no draft in their
        own context (every drafting row's draft-model row is kept in step)."""
        tic = time.perf_counter()
        rows = [i for i, limit in enumerate(limits) if limit]
        proposed = self.draft_source.propose({self.uids[i]: self.tokens[i] for i in rows},
                                             {self.uids[i]: last[i] for i in rows}, k)
        for i in rows:
            if not drafts[i]:
                drafts[i] = proposed[self.uids[i]][: limits[i]]
        self._draft_seconds = time.perf_counter() - tic

    def _note_dry(self, dry: bool) -> None:
        """After looking for drafts and finding none, skip looking (and the wait
        for the sampled tokens it needs) for 1, 2, 4, then 8 steps: prose keeps
        its pipelined steps."""
        self._dry_run = min(8, 2 * self._dry_run or 1) if dry else 0
        self._dry_steps = self._dry_run

    def _limit(self, i: int) -> int:
        """Draft tokens row i may verify this step (0: it does not draft)."""
        limit = self.limits.get(self.uids[i], 0)
        sampler = self.samplers[i] if self.samplers else None
        if not limit or not (sampler in (None, greedy_sampler) or isinstance(sampler, RandomSampler)):
            return 0  # a sampler that cannot draw ahead of its turn
        return limit

    def _width(self, lengths: list[int]) -> int:
        """The step's width for drafts of these lengths (1: no draft)."""
        if not any(lengths):
            return 1
        made = []
        for width in range(1, 2 + max(lengths)):
            made.append(sum(1 + (self._acceptance_of(i).expected(min(width - 1, n)) if n else 0)
                            for i, n in enumerate(lengths)))
        return self.costs.best_width(len(lengths), made)

    def _acceptance_of(self, i: int) -> Acceptance:
        uid = self.uids[i]
        found = self._acceptance.get(uid)
        if found is None:
            found = self._acceptance[uid] = Acceptance()
        return found

    def _lookup(self, i: int) -> PromptLookup:
        uid = self.uids[i]
        lookup = self._lookups.get(uid)
        if lookup is None:
            lookup = self._lookups[uid] = self._lookup_class(self.tokens[i], *self._ngrams)
        elif len(lookup.tokens) < len(self.tokens[i]):  # plain steps since its last draft
            lookup.extend(self.tokens[i][len(lookup.tokens) :])
        return lookup

    # ---- verifying --------------------------------------------------------

    def _verify(self, drafts: list[list[int]], width: int) -> list:
        """One step that feeds each row its last sampled token and its draft (rows
        padded to `width` tokens), keeps what its sampling agrees with, and
        takes the rest back out of the KV."""
        self.counters.speculative_steps += 1
        last = self._next_tokens.tolist()
        last_logprobs = self._next_logprobs
        inputs = mx.array([[t, *d] + [t] * (width - 1 - len(d)) for t, d in zip(last, drafts)],
                          dtype=mx.uint32)
        logits = self.model(inputs, cache=self.prompt_cache)
        chosen, dists = self._choose(logits, last, drafts)

        emitted, finish, keep = [], [], []
        for i, (draft, row) in enumerate(zip(drafts, chosen)):
            accepted = 0
            while accepted < len(draft) and draft[accepted] == row[accepted]:
                accepted += 1
            if draft:
                self._record(i, len(draft), accepted)
            if accepted and isinstance(self.samplers[i], RandomSampler):
                self.samplers[i].advance(accepted)  # the keys of the tokens it kept
            if self.draft_source is not None:
                self.draft_source.settle(self.uids[i], [last[i], *draft[:accepted]])
            if accepted and self.logits_processors[i]:  # their context: every token fed
                self._token_context[i].update_and_fetch(mx.array(draft[:accepted], dtype=mx.uint32))
            tokens, reason = self._until_finished(i, [last[i], *draft[:accepted]])
            emitted.append(tokens)
            finish.append(reason)
            if reason is None:
                keep.append(i)
        for c in self.prompt_cache:
            c.drop([width - len(t) for t in emitted])
        for sequence, tokens in zip(self.tokens, emitted):
            sequence.extend(tokens)

        responses = []
        for i, (tokens, reason) in enumerate(zip(emitted, finish)):
            for j, token in enumerate(tokens):
                end = reason is not None and j == len(tokens) - 1
                responses.append(self.Response(
                    uid=self.uids[i], token=token, logprobs=last_logprobs[i] if j == 0 else dists[i][j - 1],
                    finish_reason=reason if end else None,
                    prompt_cache=self.extract_cache(i) if end else None,
                    all_tokens=self.tokens[i] if end else None))
        # each row's next token: what its sampling chose after the last token it kept
        self._current_tokens, self._current_logprobs = mx.array(last, dtype=mx.uint32), list(last_logprobs)
        self._next_tokens = mx.array([row[len(t) - 1] for row, t in zip(chosen, emitted)], dtype=mx.uint32)
        self._next_logprobs = [dists[i][len(t) - 1] for i, t in enumerate(emitted)]
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _choose(self, logits: mx.array, last: list[int], drafts: list[list[int]]) -> tuple[list, list]:
        """What each row's sampling chooses at each position (`chosen[i][j]`,
        after the j-th token fed), and the log-probabilities it chose from
        (`dists[i][j]`), as far as its draft is accepted.

        Rows without logits processors are done together, a position at a time,
        each normalized alone as a plain step normalizes its one (a reduction
        over the whole (rows, width, vocabulary) array sums in another order).
        A row with processors (a grammar, penalties) goes a position at a time
        while its draft holds: a processor sees a draft token only once it is
        accepted, so a grammar's state never takes a token it must give back."""
        width = logits.shape[1]
        first_logprobs, first = self._sample_first(logits[:, 0, :], last)
        logprobs = [_normalized(logits[:, j, :]) for j in range(1, width)]
        greedy = [mx.argmax(lp, axis=-1) for lp in logprobs]
        drawn = {i: [self.samplers[i].ahead(lp[i : i + 1], j) for j, lp in enumerate(logprobs[: len(draft)])]
                 for i, draft in enumerate(drafts)
                 if draft and not self.logits_processors[i] and isinstance(self.samplers[i], RandomSampler)}
        mx.eval(first, *greedy, *(t for row in drawn.values() for t in row))
        rest = mx.stack(greedy, axis=1).tolist() if greedy else [[] for _ in last]
        for i, row in drawn.items():  # a random row: the tokens its own keys draw there
            rest[i][: len(row)] = [t.item() for t in row]
        chosen = [[f, *g] for f, g in zip(first.tolist(), rest)]
        # rows split apart as mlx-lm's plain step splits them: indexing one out
        # (lp[i]) is a gather, a kernel a GPU compiled for 3.7 s at the first
        # plain step after a verification (which evaluates these)
        rows = [list(first_logprobs), *(list(lp) for lp in logprobs)]
        dists = [[r[i] for r in rows] for i in range(len(last))]
        for i, draft in enumerate(drafts):
            if draft and self.logits_processors[i]:
                chosen[i], dists[i] = self._choose_processed(i, logits[i : i + 1].squeeze(0), draft, chosen[i][0],
                                                             rows[0][i])
        return chosen, dists

    def _choose_processed(self, i: int, logits: mx.array, draft: list[int], first: int,
                          first_logprobs: mx.array) -> tuple[list[int], list[mx.array]]:
        """`_choose` for row i, whose logits processors run at each position
        after the previous draft token was accepted."""
        context = self._token_context[i].tokens  # every token fed, the last sampled one included
        chosen, dists = [first], [first_logprobs]
        for j, token in enumerate(draft, 1):
            if chosen[-1] != token:
                break
            row = logits[j : j + 1]
            seen = mx.concatenate([context, mx.array(draft[:j], dtype=context.dtype)])
            for processor in self.logits_processors[i]:
                row = processor(seen, row)
            logprobs = _normalized(row)
            sampler = self.samplers[i]
            drawn = sampler.ahead(logprobs, j - 1) if isinstance(sampler, RandomSampler) else None
            chosen.append((mx.argmax(logprobs, axis=-1) if drawn is None else drawn).item())
            dists.append(logprobs.squeeze(0))
        return chosen, dists

    def _sample_first(self, logits: mx.array, last: list[int]) -> tuple[mx.array, mx.array]:
        """Every row's token after its last sampled one, exactly as a plain step
        samples it: the row's logits processors, then its sampler."""
        if any(self.logits_processors):
            rows = []
            for e, processors in enumerate(self.logits_processors):
                row = logits[e : e + 1]
                if processors:
                    context = self._token_context[e].update_and_fetch(mx.array([last[e]], dtype=mx.uint32))
                    for processor in processors:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = _normalized(logits)
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            return logprobs, samplers[0](logprobs)
        return logprobs, mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)

    def _until_finished(self, i: int, tokens: list[int]) -> tuple[list[int], str | None]:
        """Row i's tokens of this step up to the one that ends it (its length
        limit or a stop token), and why it ended (None: it goes on)."""
        for j, token in enumerate(tokens):
            self._num_tokens[i] += 1
            reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(token):
                reason = "stop"
            if reason is not None:
                return tokens[: j + 1], reason
        return tokens, None

    def _record(self, i: int, proposed: int, accepted: int) -> None:
        self.counters.proposed_tokens += proposed
        self.counters.accepted_tokens += accepted
        self._acceptance_of(i).record(proposed, accepted)

    def extend(self, batch) -> None:
        """Sequences joining: their rows' KV as ragged rows (ragged_kv), so that
        each can give back its rejected tokens alone."""
        super().extend(batch)
        if self.enabled:
            self.prompt_cache = [ragged(c) for c in self.prompt_cache]

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        live = set(self.uids)
        for table in (self._lookups, self._acceptance):  # `limits` is the scheduler's to clear
            for uid in [u for u in table if u not in live]:
                del table[uid]


def pads_widths() -> bool:
    """Whether verifications take a few widths only: a GPU compiles kernels for
    each new width (seconds, the first time)."""
    return mx.default_device().type == mx.DeviceType.gpu


def padded_width(width: int, most: int) -> int:
    """The power of two at or above `width`, `most` at most."""
    return min(1 << (width - 1).bit_length(), max(most, width))


def ragged(cache):
    """A layer's batch cache as ragged rows (the same if it is already)."""
    if type(cache) is BatchKVCache:
        return RaggedBatchKVCache.of(cache)
    if type(cache) is BatchRotatingKVCache:
        return RaggedWindowKVCache.of(cache)
    if type(cache) is QuantizedBatchKVCache:
        return RaggedQuantizedBatchKVCache.of(cache)
    if type(cache) is HalfBatchKVCache:
        return RaggedHalfBatchKVCache.of(cache)
    return cache


def _normalized(logits: mx.array) -> mx.array:
    """Log-probabilities from logits, as GenerationBatch computes them: with the
    log-sum-exp its module calls (on the CPU, tierlm's native one may stand in
    for MLX's: tierlm.backends.cpu.kernels), so they are the same to the bit."""
    return logits - sys.modules[GenerationBatch.__module__].mx.logsumexp(logits, axis=-1, keepdims=True)


class SpeculativeGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose generation batch verifies drafts
    (SpeculativeBatch): sequences enter it as they finish their prompts."""

    def __init__(self, model, *, ngram_min: int = 2, ngram_max: int = 3, draft_model=None,
                 vocab_size: int | None = None, lookup=None, **kwargs):
        """`lookup`: the class of each sequence's lookup (drafts.PromptLookup)."""
        super().__init__(model, **kwargs)
        self._generation_batch = SpeculativeBatch.empty(self.model, self.sampler)
        self._generation_batch.configure(ngram_min, ngram_max, lookup)
        if draft_model is not None:
            self._generation_batch.draft_source = DraftModelSource(draft_model, vocab_size)
        self._generation_batch.pad_widths = pads_widths()
        if (why := rollback_supported(model)) is not None:
            self._generation_batch.enabled = False
            log.info("speculation off for this model: %s", why)
        # a prompt end of at most this many tokens runs with its last token in one
        # pass (folded_prompt); 0: never. The scheduler sets it.
        self.fold_limit = 0
        self.folds = FoldedEnds()
        self._prompt_batch = FoldingPromptBatch.empty_with(self.folds, self.model, self.sampler,
                                                           self.prefill_step_size)

    @property
    def speculation(self) -> SpeculativeBatch:
        return self._generation_batch

    def insert_segments(self, segments, *args, **kwargs):
        uids = super().insert_segments(segments, *args, **kwargs)
        if self.fold_limit:  # the entries just added, from the deque's end (not a copy of all of it)
            pending = self._unprocessed_sequences
            self.folds.hold([pending[-i] for i in range(len(uids), 0, -1)], self.fold_limit)
        return uids

    def remove(self, uids, return_prompt_caches=False):
        self.folds.drop(uids)
        return super().remove(uids, return_prompt_caches)

    def _next(self):
        prefilled = self._counters.prompt_tokens + self.folds.computed
        responses = super()._next()
        if self._counters.prompt_tokens + self.folds.computed != prefilled:  # a prefill in this step's time
            self._generation_batch.switch.interrupted()
        return responses
