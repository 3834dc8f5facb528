"""Presence and frequency penalties over the tokens a request generated, whatever
their number, and never over its prompt (tierlm.engine.sampling.output_penalties),
driven as BatchGenerator drives a processor: the tokens so far, one more a step."""

import mlx.core as mx

from tierlm.engine.sampling import output_penalties

VOCAB = 10


def logits_at_each_step(processor, prompt: list[int], generated: list[int]) -> list[list[float]]:
    """What the processor makes of zero logits before each token (and after the last)."""
    tokens, seen = list(prompt), []
    for token in [*generated, None]:
        seen.append(processor(mx.array(tokens, dtype=mx.int32), mx.zeros((1, VOCAB)))[0].tolist())
        if token is not None:
            tokens.append(token)
    return seen


def test_the_prompt_is_never_penalized():
    steps = logits_at_each_step(output_penalties(1.0, 0.5), prompt=[3, 3, 9, 9], generated=[1])
    assert steps[0] == [0.0] * VOCAB  # before the first token: nothing generated
    assert steps[1][3] == steps[1][9] == 0.0 and steps[1][1] == -1.5


def test_every_generated_token_counts_however_long_ago():
    generated = [1] + [2] * 30 + [1]  # token 1's first use is 31 steps back at the end
    last = logits_at_each_step(output_penalties(1.0, 0.5), prompt=[5], generated=generated)[-1]
    assert last[1] == -(1.0 + 2 * 0.5)  # presence once, frequency per use
    assert last[2] == -(1.0 + 30 * 0.5)
    assert last[5] == 0.0


def test_each_penalty_alone():
    presence = logits_at_each_step(output_penalties(2.0, 0.0), prompt=[0], generated=[4, 4, 4])[-1]
    frequency = logits_at_each_step(output_penalties(0.0, -1.0), prompt=[0], generated=[4, 4, 4])[-1]
    assert presence[4] == -2.0 and frequency[4] == 3.0  # a negative frequency penalty rewards repeats
