"""A batch keeping KV at 8 or 4 bits verifies drafts
(tierlm/engine/ragged_quantized_kv.py), on a tiny random model: its tokens are
those of mlx-lm's BatchGenerator over the same quantized KV without drafts,
greedy and seeded, with rows that end apart, leave and join; and each finished
row's KV is what a fresh prefill of its tokens quantizes to. (The default
model's answers at 8 bits with drafts and without: tests/test_kv_bits.py.)"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from tierlm import backends
from tierlm.engine import key_scaling
from tierlm.engine.drafts import PromptLookup
from tierlm.engine.quantized_kv import QuantizedBatchKVCache, quantized_slots
from tierlm.engine.ragged_quantized_kv import RaggedQuantizedBatchKVCache
from tierlm.engine.request import SamplingParams
from tierlm.engine.sampling import RandomSampler
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.models.random_model import TINY, build_model

PROMPTS = [list(range(10, 40)) * 3, [7, 8, 9, 11] * 10, list(range(60, 90)) * 2]
LIMITS = [40, 12, 40]  # the second row leaves early: the batch is filtered
JOINING = [5, 6, 7] * 9  # enters after a few steps: the batch is extended


def _model():
    """A tiny Llama whose heads hold 64 values (a group's width), its weights
    scaled up so that greedy answers do not loop on one token, then quantized
    (tierlm's CPU products of quantized weights keep a row's bits batched)."""
    mx.random.seed(0)
    model = build_model(dict(TINY["llama"], hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, vocab_size=512))
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    if not backends.prepare(model, memory_bytes=2**30).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant (rounding moves with the batch)")
    return model


class _Spoiled(PromptLookup):
    """Drafts from the context, or the last token repeated, every other one
    wrong from its middle on: rows keep different numbers of tokens a step."""

    def __init__(self, tokens, *ngrams):
        super().__init__(tokens, *ngrams)
        self.calls = 0

    def propose(self, k, last):
        draft = super().propose(k, last) or [last] * k
        self.calls += 1
        if self.calls % 2:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 512
        return draft


def _run(gen, model, bits: int, scales, alternate: bool = False) -> dict:
    """Every row's finished response (greedy but the last, seeded at a
    temperature), drafting 6 tokens a step where `gen` drafts (`alternate`:
    every other step, a plain step after each verification)."""
    slots = lambda: quantized_slots(make_prompt_cache(model), bits, scales)  # noqa: E731
    sampled = RandomSampler(SamplingParams(temperature=0.8, top_k=20, seed=3), print)
    uids = gen.insert(PROMPTS, max_tokens=LIMITS, caches=[slots() for _ in PROMPTS],
                      samplers=[None, None, sampled])
    drafting = isinstance(gen, SpeculativeGenerator)
    if drafting:
        gen.speculation.draft_alternately() if alternate else gen.speculation.draft_always()
    ended, steps = {}, 0
    while len(ended) < len(PROMPTS) + 1:
        steps += 1
        if steps == 5:
            uids += gen.insert([JOINING], max_tokens=[30], caches=[slots()])
        for uid in uids if drafting else ():
            gen.speculation.limits[uid] = 6
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                ended[r.uid] = r
    return {i: ended[uid] for i, uid in enumerate(uids)}


@pytest.mark.parametrize("bits, scaled, align", [(8, False, False), (4, False, False), (8, True, False),
                                                (8, False, True)], ids=["8", "4", "8-scaled-keys", "8-aligned"])
def test_drafting_over_quantized_kv_gives_the_tokens_and_kv_of_plain_batching(bits, scaled, align, monkeypatch):
    """`aligned`: plain steps move ragged rows to one end first, as on a GPU."""
    model = _model()
    scales = key_scaling.calibrate(model, list(range(3, 300))) if scaled else None
    ragged_writes = []
    write = RaggedQuantizedBatchKVCache.update_and_fetch
    monkeypatch.setattr(RaggedQuantizedBatchKVCache, "update_and_fetch",
                        lambda c, k, v: ragged_writes.append(len(set(c.ends)) > 1) or write(c, k, v))
    moved = []
    align_rows = RaggedQuantizedBatchKVCache.align
    monkeypatch.setattr(RaggedQuantizedBatchKVCache, "align",
                        lambda c: moved.append(len(set(c.ends)) > 1) or align_rows(c))

    speculative = SpeculativeGenerator(model, lookup=_Spoiled)
    speculative.speculation.align_plain = align
    drafted = _run(speculative, model, bits, scales, alternate=align)
    plain = _run(BatchGenerator(model), model, bits, scales)

    counters = speculative.speculation.counters
    assert 0 < counters.accepted_tokens < counters.proposed_tokens
    # rows that ended apart were written where they end, or moved to one end first
    assert sum(moved) > 0 if align else sum(ragged_writes) > 10
    assert [r.all_tokens for r in drafted.values()] == [r.all_tokens for r in plain.values()]
    for r in drafted.values():
        fed = r.prompt_cache[0].offset  # the last token too, where a verification kept it
        assert fed in (len(r.all_tokens) - 1, len(r.all_tokens))
        fresh = quantized_slots(make_prompt_cache(model), bits, scales)
        mx.eval(model(mx.array([r.all_tokens[:fed]]), cache=fresh))
        for kept, made in zip(r.prompt_cache, fresh):
            assert kept.offset == made.offset == fed
            for a, b in zip(kept.keys + kept.values, made.keys + made.values):
                assert mx.array_equal(a[..., : kept.offset, :], b[..., : made.offset, :]).item()


def test_a_quantized_batch_becomes_ragged_with_its_16_bit_tail_quantized():
    """A batch that kept decode steps at 16 bits (a GPU's) holds them quantized
    once its rows may end apart: the GPU's kernel reads one tail position for
    every row."""
    mx.random.seed(1)
    batch = QuantizedBatchKVCache([0, 2], bits=8, tail_capacity=8)
    batch.update_and_fetch(mx.random.normal((2, 1, 6, 64)), mx.random.normal((2, 1, 6, 64)))
    for _ in range(3):
        batch.update_and_fetch(mx.random.normal((2, 1, 1, 64)), mx.random.normal((2, 1, 1, 64)))
    assert batch.tail_length == 3
    ragged = RaggedQuantizedBatchKVCache.of(batch)
    assert ragged.tail_length == 0 and ragged.tail_capacity == 0 and ragged.ends == [9, 9]
    ragged.drop([2, 0])
    ragged.update_and_fetch(mx.random.normal((2, 1, 1, 64)), mx.random.normal((2, 1, 1, 64)))
    assert ragged.ends == [8, 10] and ragged.offset.tolist() == [8, 8]
    assert ragged.extract(0).offset == 8 and ragged.extract(1).offset == 8


def test_the_fields_of_the_batch_caches_this_module_reaches_into_are_there():
    batch = BatchKVCache([1, 0])
    for field in ("_idx", "left_padding", "offset", "keys", "values", "step"):
        assert hasattr(batch, field), f"mlx-lm's BatchKVCache has no {field} any more"
    quantized = QuantizedBatchKVCache([1, 0], bits=8)
    for field in ("bits", "group_size", "key_scales", "tail_capacity", "tail_length", "flush", "_grow"):
        assert hasattr(quantized, field), f"QuantizedBatchKVCache has no {field} any more"
