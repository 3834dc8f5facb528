"""Per-request samplers and logits processors, built from mlx-lm's pieces.

Each request's sampler and processors are guarded: whatever they raise is
reported for that request alone (`on_fault`) and the batch step goes on, so one
request can never fail, or poison, the others.
"""

from __future__ import annotations

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
    sample the whole batch in one call. Random sampling gets its own function with
    its own PRNG key, so a `seed` makes a request reproducible even when batched."""
    if params.is_greedy:
        return greedy_sampler  # argmax: nothing a request sends can make it raise
    key = mx.random.key(params.seed) if params.seed is not None else None
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        scaled = logprobs * (1.0 / params.temperature)
        if state["key"] is None:
            return mx.random.categorical(scaled)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(scaled, key=sub)

    return guard_sampler(sample, on_fault)


def guard_sampler(sample, on_fault: OnFault):
    """`sample`, reporting what it raises instead of raising it; the faulty row
    gets the argmax as a placeholder until the scheduler takes the request out."""

    def guarded(logprobs: mx.array) -> mx.array:
        try:
            return sample(logprobs)
        except Exception as e:
            on_fault(f"sampling failed: {e}")
            repair_random_state()
            return mx.argmax(logprobs, axis=-1)

    return guarded


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
