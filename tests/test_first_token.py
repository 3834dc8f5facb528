"""engine.first_token: the first tokens of rows entering an empty generation
batch go out before their second step is sent, and every sequence still gets
exactly the tokens mlx-lm's pipeline gives it (a tiny random model, greedy;
this fails loudly if mlx-lm's GenerationBatch changes what first_token reads).
On a real model, tests/test_folded_prompt.py checks that a chat's next turn
runs one model call before its first token."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import StopSequences

from tierlm.engine.first_token import FirstTokensFirst
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.models.random_model import tiny_model

PROMPTS = [list(range(10, 40)), [7, 8, 9, 11] * 6, list(range(60, 75)), [3, 1, 4, 1, 5, 9, 2, 6]]
LONG = list(range(100, 190))  # its prefill takes a chunk more: it joins while the first one's token is out


def _script(model, post: bool, monkeypatch, stop_first: bool = False):
    """uid -> (tokens, finish reason), and each call's (uid, token) pairs: one
    prompt entering the batch alone and a longer one joining it while its first
    token is out, then two joining while they decode (one ending at its first
    token by length, one by a stop sequence where `stop_first`), then one more
    into the emptied batch."""
    monkeypatch.setattr(FirstTokensFirst, "post_first_tokens", post)
    gen = SpeculativeGenerator(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64)
    gen.speculation.enabled = False
    got, calls = {}, []

    def drain(until_done: bool, steps: int = 1000):
        for _ in range(steps):
            responses = gen.next()[1]
            calls.append([(r.uid, r.token) for r in responses])
            for r in responses:
                tokens, _ = got.setdefault(r.uid, ([], None))
                tokens.append(r.token)
                got[r.uid] = (tokens, r.finish_reason)
            if until_done and all(reason is not None for _, reason in got.values()) and len(got) == len(inserted):
                return

    inserted = gen.insert([PROMPTS[0], LONG], max_tokens=[12, 7])
    drain(False, steps=3)
    stop = StopSequences([[_first_token(model, PROMPTS[2])]] if stop_first else None)
    inserted += gen.insert(PROMPTS[1:3], max_tokens=[1, 9], stop_sequences=[StopSequences(), stop])
    drain(True)
    inserted += gen.insert([PROMPTS[3]], max_tokens=[5])
    drain(True)
    gen.close() if hasattr(gen, "close") else None
    return got, calls


def _first_token(model, prompt: list[int]) -> int:
    return mx.argmax(model(mx.array([prompt]))[0, -1]).item()


@pytest.mark.parametrize("stop_first", [False, True])
def test_every_sequence_gets_the_tokens_of_mlx_lms_pipeline(monkeypatch, stop_first):
    model = tiny_model("llama")
    posted, _ = _script(model, True, monkeypatch, stop_first)
    plain, _ = _script(model, False, monkeypatch, stop_first)
    assert posted == plain
    assert [len(t) for t, _ in posted.values()] == [12, 7, 1, 1 if stop_first else 9, 5]
    assert [reason for _, reason in posted.values()] == ["length", "length", "length",
                                                        "stop" if stop_first else "length", "length"]


def test_a_lone_sequences_first_token_comes_a_step_earlier(monkeypatch):
    """Alone in the batch, the first token is returned by the call after the
    one that computed it, without a second step sent (mlx-lm returns it with
    the second step in flight); the call after that returns nothing (it feeds
    the token), and from then on a token a call."""
    model = tiny_model("llama")
    calls = []
    real = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, x, **k: calls.append(x.shape) or real(self, x, **k))
    monkeypatch.setattr(FirstTokensFirst, "post_first_tokens", True)
    gen = SpeculativeGenerator(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64)
    gen.speculation.enabled = False
    gen.insert([PROMPTS[0]], max_tokens=[4])
    seen = []
    while not seen:  # the prompt's pass, then its last token's (mlx-lm feeds it alone)
        seen = gen.next()[1]
    assert len(seen) == 1 and seen[0].finish_reason is None
    assert calls == [(1, len(PROMPTS[0]) - 1), (1, 1)]  # no second decode step sent yet
    assert gen.next()[1] == [] and calls[-1] == (1, 1) and len(calls) == 3  # it feeds the first token
    assert len(gen.next()[1]) == 1 and len(calls) == 4


def test_a_rows_token_context_is_an_array_only_once_its_processors_read_it():
    """mlx-lm builds each row's TokenBuffer in GenerationBatch.__init__ (this
    fails loudly if it stops looking the name up there); tierlm's is made an
    array only when read: a row with a repetition penalty reads it every step
    and it holds every token the row fed, a row without never does."""
    import inspect

    from mlx_lm.sample_utils import make_logits_processors

    from tierlm.backends import mlx_lm_generate
    from tierlm.engine.token_context import LazyTokenBuffer

    generate = mlx_lm_generate()
    assert generate.TokenBuffer is LazyTokenBuffer
    assert "TokenBuffer(t) for t in tokens" in inspect.getsource(generate.GenerationBatch.__init__)
    model = tiny_model("llama")
    gen = SpeculativeGenerator(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=64)
    gen.speculation.enabled = False
    penalty = make_logits_processors(repetition_penalty=1.5)
    uids = gen.insert(PROMPTS[:2], max_tokens=[6, 6], logits_processors=[penalty, []])
    made = {uid: [] for uid in uids}
    for _ in range(40):
        for r in gen.next()[1]:
            made[r.uid].append(r.token)
        batch = gen._generation_batch
        if batch is not None and len(batch):
            contexts = dict(zip(batch.uids, batch._token_context))
    assert all(len(tokens) == 6 for tokens in made.values())
    penalized, plain = contexts[uids[0]], contexts[uids[1]]
    assert isinstance(plain, LazyTokenBuffer) and plain._array is None
    assert penalized._array is not None
    fed = penalized.tokens.tolist()  # the prompt, then its answer (the last token too, if it was fed)
    assert fed[: len(PROMPTS[0])] == PROMPTS[0] and len(fed) - len(PROMPTS[0]) in (5, 6)
    assert fed[len(PROMPTS[0]) :] == made[uids[0]][: len(fed) - len(PROMPTS[0])]
    row = [1, 2, 3]  # mlx-lm appends to the list it gave: the buffer holds what it held then
    late = LazyTokenBuffer(row)
    row.append(4)
    assert late.tokens.tolist() == [1, 2, 3]
    assert late.update_and_fetch(mx.array([9], dtype=mx.int32)).tolist() == [1, 2, 3, 9]
