"""Per-request samplers and logits processors, built from mlx-lm's pieces."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from tierlm.engine.request import SamplingParams


def make_request_sampler(params: SamplingParams):
    """Greedy requests share mlx-lm's one greedy sampler, so BatchGenerator can
    sample the whole batch in one call. Random sampling gets its own function with
    its own PRNG key, so a `seed` makes a request reproducible even when batched."""
    if params.is_greedy:
        return greedy_sampler
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

    return sample


def make_request_processors(params: SamplingParams):
    return make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
