"""Per-request samplers and logits processors, built from mlx-lm's pieces.

Each request's sampler and processors are guarded: whatever they raise is
reported for that request alone (`on_fault`) and the batch step goes on, so one
request can never fail, or poison, the others.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from tierlm.engine.constraint import constraint_processor
from tierlm.engine.request import SamplingParams

OnFault = Callable[[str], None]


def make_request_sampler(params: SamplingParams, on_fault: OnFault):
    """Greedy requests share mlx-lm's one greedy sampler, so BatchGenerator can
    sample the whole batch in one call. Random sampling gets a RandomSampler of
    its own, so a `seed` makes a request reproducible even when batched."""
    if params.is_greedy:
        return greedy_sampler  # argmax: nothing a request sends can make it raise
    return RandomSampler(params, on_fault)


class RandomSampler:
    """A request's random sampling (temperature, top-p, min-p, top-k), drawing
    with a PRNG key of its own: from its `seed`, else from fresh entropy. Every
    token splits the key once, so the k-th token from now always draws with the
    k-th key ahead, whichever call draws it: a token sampled ahead of its turn
    (`ahead`, speculation verifying a draft) is the token a plain step would
    sample there from the same log-probabilities. A seeded request's answer is
    then the same with drafts or without, and every token keeps the model's
    distribution (accepting a draft token exactly when it is the token drawn
    accepts it with its probability, as the standard rejection rule does)."""

    def __init__(self, params: SamplingParams, on_fault: OnFault):
        self.params, self.on_fault = params, on_fault
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._key = mx.random.key(seed)
        self._subkeys: list[mx.array] = []  # the next tokens' keys, split ahead of use
        self._keys_after: list[mx.array] = []  # the key after each of them

    def __call__(self, logprobs: mx.array) -> mx.array:
        """The next token (a plain step's call), its key used up."""
        try:
            token = self._draw(logprobs, 0)
        except Exception as e:
            return self._fault(e, logprobs)
        self.advance(1)
        return token

    def ahead(self, logprobs: mx.array, k: int) -> mx.array:
        """The token k places after the next one, drawn from its `logprobs` (one
        row), no key used up."""
        try:
            return self._draw(logprobs, k)
        except Exception as e:
            return self._fault(e, logprobs)

    def advance(self, n: int) -> None:
        """n tokens were taken: their keys are used up."""
        if n:
            self._split(n)
            self._key = self._keys_after[n - 1]
            del self._subkeys[:n], self._keys_after[:n]

    def _split(self, n: int) -> None:
        while len(self._subkeys) < n:
            key = self._keys_after[-1] if self._keys_after else self._key
            after, sub = mx.random.split(key)
            self._keys_after.append(after)
            self._subkeys.append(sub)

    def _draw(self, logprobs: mx.array, k: int) -> mx.array:
        params = self.params
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        self._split(k + 1)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=self._subkeys[k])

    def _fault(self, error: Exception, logprobs: mx.array) -> mx.array:
        """Report it; the row gets the argmax as a placeholder until the
        scheduler takes the request out."""
        self.on_fault(f"sampling failed: {error}")
        return mx.argmax(logprobs, axis=-1)


def make_request_processors(params: SamplingParams, on_fault: OnFault) -> list:
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
    )
    if params.presence_penalty or params.frequency_penalty:
        processors.append(output_penalties(params.presence_penalty, params.frequency_penalty))
    if params.constraint is not None:  # last: the mask has the final word
        processors.append(constraint_processor(params.constraint))
    return [guard_processor(p, on_fault) for p in processors]


def output_penalties(presence: float, frequency: float):
    """OpenAI's presence and frequency penalties, over every token the request has
    generated so far, as OpenAI and vLLM count them: `presence` off the logit of
    each token generated at least once, `frequency` once per time it was. (mlx-lm's
    own look at the last 20 tokens of prompt and output alike: a word from the
    prompt is penalized, and one generated 21 tokens ago no longer is.)

    BatchGenerator hands a processor the request's tokens so far, one more at each
    step; at its first call none of them is generated yet (the last is the
    prompt's), so what follows that length is the output."""
    first: int | None = None  # the length at the first call

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal first
        if first is None:
            first = len(tokens)
        generated = tokens[first:]
        if len(generated) == 0:
            return logits
        if frequency:
            logits = logits.at[:, generated].subtract(frequency)  # repeats add up
        if presence:
            logits[:, generated] = logits[:, generated] - presence  # repeats write the same value: once
        return logits

    return processor


def guard_processor(processor, on_fault: OnFault):
    """`processor`, reporting what it raises; the logits pass through unchanged."""

    def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return processor(tokens, logits)
        except Exception as e:
            on_fault(f"logits processing failed: {e}")
            return logits

    return guarded


def repair_random_state() -> bool:
    """Reseed the global random state if it cannot be evaluated; whether it had to.

    mlx-lm's samplers are compiled with the global random state as an input and an
    output: one that raises while tracing leaves a placeholder in its place, and
    every later draw of every unseeded request fails on it. MLX offers no way to
    put the old key back, so unseeded requests continue from a fresh seed (seeded
    ones draw from keys of their own). Called right where a sampler raised, before
    the next request's sampler draws in the same step."""
    try:
        mx.eval(mx.random.state[0])
        return False
    except Exception:
        mx.random.seed(time.time_ns() % 2**32)
        return True
