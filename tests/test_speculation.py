"""Speculative decoding inside the continuous batch: prompt-lookup drafts
verified for every running sequence in one forward pass.

- Drafts and the cost model alone (no model).
- The batch on a tiny random model: a rejected draft leaves each row's KV as a
  fresh prefill of the tokens it kept would (this also fails loudly if
  mlx-lm's generation batch or BatchKVCache change the fields it reaches into).
- Real models: greedy answers equal with speculation on and off, token for
  token, over code edits, prose, stop strings, length limits, logprobs, tool
  calls, schemas and a batch (SmolLM2 in process; Qwen2.5-Coder over HTTP),
  where the backend's products are batch-invariant (elsewhere batching itself
  moves float rounding, and the test says so); the prefix cache read back
  after a request whose drafts were partly rejected holds exactly its tokens'
  KV; bad draft lengths are a 400 in each API's shape; /metrics and /stats
  count drafts.
"""

from __future__ import annotations

import asyncio
import colorsys
import inspect

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from engine_testing import run, started
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from tierlm import backends
from tierlm.engine.draft_model import check_draft_model
from tierlm.engine.drafts import Acceptance, PromptLookup
from tierlm.engine.ragged_kv import RaggedBatchKVCache, RaggedWindowKVCache
from tierlm.engine.request import Request, SamplingParams
from tierlm.engine.sampling import RandomSampler
from tierlm.engine.speculation_switch import SpeculationSwitch
from tierlm.engine import warmup
from tierlm.engine.speculative_batch import (AlternateDrafting, SpeculativeGenerator, StepCosts, WidestSteps,
                                             padded_width, rollback_supported)
from tierlm.models.random_model import make_random_model, tiny_model
from tierlm.structured.grammar import ModelGrammars, json_schema_grammar

SOURCE = inspect.getsource(colorsys)  # a real module of 166 lines, on every Python
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
SHORT = SOURCE[: SOURCE.index("def rgb_to_hls")]  # its first 70 lines: a shorter prompt for the fast run
SHORT_EDIT = [{"role": "user", "content": f"```python\n{SHORT}```\nRename rgb_to_yiq to rgb_to_ntsc and return "
                                          "the whole file."}]


# ---- drafts and costs ------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    look = PromptLookup([5, 1, 2, 3, 4, 6, 1, 2, 3, 9, 1, 2], ngram_min=2, ngram_max=3)
    assert look.propose(3, last=3) == [9, 1, 2]  # (1, 2, 3) last seen before 9, not before 4
    assert look.propose(3, last=77) == []  # (2, 77) never occurred
    assert PromptLookup([4, 5, 6], 2, 3).propose(2, last=5) == []  # one token alone is no match
    # a draft running into the sequence's end continues with the sampled token
    assert PromptLookup([1, 2, 3, 1, 2], 2, 3).propose(4, last=3) == [1, 2, 3]
    look.extend([3, 9])  # appended tokens are indexed as they come
    assert look.propose(2, last=1) == [2, 3]  # (9, 1) now last seen before 2, 3


def test_acceptance_learns_from_drafts_and_forgets_slowly():
    a = Acceptance()
    assert a.expected(2) == pytest.approx(0.6 + 0.36)  # the prior
    for _ in range(5):
        a.record(proposed=6, accepted=6)
    assert a.alpha > 0.9 and a.expected(6) > 4.5
    for _ in range(10):
        a.record(proposed=6, accepted=0)
    assert a.alpha < 0.35


def test_step_costs_estimate_unmeasured_widths_and_pick_the_best_rate():
    costs = StepCosts(probe_every=10**6)
    assert costs.best_width(1, [1.0, 1.9, 2.7]) == 1  # nothing measured: a plain step first
    costs.record(1, 0.030)
    assert costs.estimate(2) == pytest.approx(0.0375)  # past the largest: a quarter of a token's average cost
    costs.record(2, 0.5)  # a first step at three times its estimate compiled kernels (a GPU): not counted
    assert 2 not in costs.seconds
    costs.record(8, 0.100)
    assert costs.estimate(4) == pytest.approx(0.030 + 0.070 * 3 / 7)  # between measured sizes
    costs.record(4, 0.040)
    assert costs.estimate(12) == pytest.approx(0.100 + 0.015 * 4)  # the slope of the last two
    # widths pay while the tokens they are expected to make grow faster than their cost
    assert costs.best_width(1, [1.0, 1.9, 2.7, 3.4]) == 4
    assert costs.best_width(1, [1.0, 1.05, 1.1, 1.15]) == 1


def _run_switch(switch, seconds_per_token, windows, rows=4):
    """Steps of `rows` sequences on a clock where a drafting step and a plain
    step each take 10 ms and hand out what `seconds_per_token` allows; the
    share of steps that drafted."""
    now, drafted = 0.0, 0
    for _ in range(windows * switch.window):
        drafting = switch.step(now, rows)
        drafted += drafting
        switch.made(round(0.010 / seconds_per_token[drafting]))
        now += 0.010
    return drafted / (windows * switch.window)


def test_the_switch_keeps_the_faster_way_and_tries_the_other_now_and_then():
    # drafting makes 9 tokens a step where plain steps make 10 (a GPU's lost pipeline)
    losing = SpeculationSwitch()
    share = _run_switch(losing, {True: 0.010 / 9, False: 0.010 / 10}, windows=200)
    assert losing.rates[(True, 4)] == pytest.approx(900) and losing.rates[(False, 4)] == pytest.approx(1000)
    assert 0.1 < share < 0.2  # tried again every few windows: it lost by < 1.25x
    assert _run_switch(SpeculationSwitch(), {True: 0.010 / 5, False: 0.010 / 10}, windows=200) < 0.08
    # drafting makes 12 tokens a step (a file sent back): plain steps only now and then, and rarer
    winning = SpeculationSwitch()
    assert _run_switch(winning, {True: 0.010 / 12, False: 0.010 / 4}, windows=200) > 0.9


def test_the_switch_drops_a_window_that_changed_size_or_waited_on_a_prefill():
    switch = SpeculationSwitch(window=2)
    now = 0.0
    for rows, interrupted in [(2, False), (3, False), (3, True), (3, False), (3, False), (3, False), (3, False)]:
        assert switch.step(now, rows)  # drafting is measured first
        switch.made(3)
        if interrupted:
            switch.interrupted()  # a prefill ran after the step
        now += 0.1
    # the window of 2 rows was cut short, the next held a prefill, the next was its way's first
    assert [w[1:] for w in switch.recent] == [(3, 6, pytest.approx(0.2))] and not switch.rates
    switch.step(now, rows=3)  # a second whole window: 6 tokens in 0.2 s
    assert switch.rates == {(True, 3): pytest.approx(30)} and not switch.drafting  # now plain steps


def test_a_random_sampler_draws_ahead_with_the_keys_its_later_calls_use():
    """The k-th token from now draws with the k-th key ahead whichever call
    draws it: what speculation samples ahead of its turn is what plain steps
    would sample there."""
    logprobs = [mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(i)), axis=-1)) for i in range(6)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    stepwise = RandomSampler(params, print)
    plain = [stepwise(lp).item() for lp in logprobs]
    ahead = RandomSampler(params, print)
    got = [ahead(logprobs[0]).item()] + [ahead.ahead(lp, k).item() for k, lp in enumerate(logprobs[1:4])]
    ahead.advance(2)  # two of the tokens drawn ahead were kept; the third is drawn again
    got += [ahead(lp).item() for lp in logprobs[3:]]
    assert got[:4] == plain[:4] and got[4:] == plain[3:]
    assert len(set(plain)) > 1  # it does sample
    unseeded = [RandomSampler(SamplingParams(temperature=5.0), print) for _ in range(4)]
    assert len({tuple(s(lp).item() for lp in logprobs) for s in unseeded}) > 1  # fresh entropy each


# ---- the batch, on a tiny random model --------------------------------------


def _quantized_tiny(name: str = "llama"):
    model = tiny_model(name, vocab_size=512)
    nn.quantize(model, group_size=32, bits=4)
    return model


def _fresh_keys(model, tokens: list[int]) -> list[mx.array]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return [c.state[0][..., : c.offset, :] for c in cache]


class _Spoiled(PromptLookup):
    """Lookups whose every other draft is wrong from its middle on: random
    weights loop, and their loops' drafts would all be accepted."""

    calls = 0

    def propose(self, k, last):
        draft = super().propose(k, last) or [last] * k
        _Spoiled.calls += 1
        if _Spoiled.calls % 2:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 512
        return draft


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_rejected_drafts_leave_each_rows_kv_as_a_fresh_prefill_would(monkeypatch, arch):
    """Llama's attention KV, and Gemma 3's sliding-window layers (a window of
    32 tokens, passed many times over, their oldest keys dropped 8 at a time);
    then each answer continued from its extracted cache, as a prefix-cache hit
    restores it (a window then holds only its last keys)."""
    monkeypatch.setattr("tierlm.engine.speculative_batch.PromptLookup", _Spoiled)
    monkeypatch.setattr(RaggedWindowKVCache, "drop_chunk", 8)
    model = tiny_model(arch, vocab_size=512)  # float32: the same on every CPU to float rounding
    # repeated runs, so that lookups find drafts; three lengths, so rows are padded
    prompts = [list(range(10, 40)) * 3, list(range(50, 70)) * 4 + [3], [7, 8, 9, 11] * 10]
    gen = SpeculativeGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    gen.speculation.draft_always()
    ended = _run_drafting(gen, prompts, [24, 31, 40])
    counters = gen.speculation.counters
    assert counters.speculative_steps and 0 < counters.accepted_tokens < counters.proposed_tokens
    for r, prompt, limit in zip(ended, prompts, (24, 31, 40)):
        assert r.finish_reason == "length" and len(r.all_tokens) == len(prompt) + limit
        assert r.all_tokens[: len(prompt)] == prompt
        _assert_fresh(model, r)
    more = [[5, 6, 7], [9] * 6, [1, 2]]
    again = _run_drafting(gen, more, [20, 9, 33], caches=[r.prompt_cache for r in ended],
                          all_tokens=[list(r.all_tokens) for r in ended])  # (the batch extends the list it gets)
    for r, before, extra, limit in zip(again, ended, more, (20, 9, 33)):
        assert r.all_tokens[: len(before.all_tokens) + len(extra)] == before.all_tokens + extra
        assert len(r.all_tokens) == len(before.all_tokens) + len(extra) + limit
        _assert_fresh(model, r)


def _run_drafting(gen, prompts, limits, **insert) -> list:
    """The finished responses of these prompts, each drafting 6 tokens a step."""
    uids = gen.insert(prompts, max_tokens=limits, **insert)
    for uid in uids:
        gen.speculation.limits[uid] = 6
    ended = {}
    while len(ended) < len(uids):
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                ended[r.uid] = r
    return [ended[uid] for uid in uids]


def _assert_fresh(model, response) -> None:
    """The response's extracted cache holds what a fresh prefill of its tokens would."""
    for kept, fresh in zip(response.prompt_cache, _fresh_caches(model, response.all_tokens)):
        assert type(kept) is type(fresh) and kept.offset == fresh.offset
        kept_keys, fresh_keys = (_keys_in_order(c) for c in (kept, fresh))
        assert kept_keys.shape == fresh_keys.shape
        assert mx.allclose(kept_keys, fresh_keys, atol=1e-4).item()


def _fresh_caches(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def _keys_in_order(cache) -> mx.array:
    """A layer's keys in the order of their positions (a sliding window's last
    `max_size` of them, as mlx-lm keeps them after one step)."""
    if isinstance(cache, RotatingKVCache):
        return cache._temporal_order(cache.keys)[..., -cache.max_size :, :]
    return cache.keys[..., : cache.offset, :]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("pad_widths", [False, True])
def test_greedy_tokens_equal_plain_batching_on_random_weights_where_products_are_batch_invariant(arch, pad_widths):
    """The same tokens as mlx-lm's own BatchGenerator, drafts or not, when the
    arithmetic gives a row the same bits however many tokens it is fed (Gemma
    3: its sliding windows of 32 tokens passed several times over); and with
    widths padded to powers of two, as on a GPU."""
    model = _quantized_tiny(arch)
    from tierlm.backends import prepare

    if not prepare(model, memory_bytes=2**30).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant (rounding moves with the batch)")
    prompts = [list(range(10, 40)) * 3, [7, 8, 9, 11] * 10, list(range(60, 90)) * 3]

    def tokens(gen):  # two greedy rows and one sampled with a seed (its draws ahead use its own keys)
        sampled = RandomSampler(SamplingParams(temperature=0.8, top_k=20, seed=3), print)
        uids = gen.insert(prompts, max_tokens=[30, 30, 30], samplers=[None, None, sampled])
        if isinstance(gen, SpeculativeGenerator):
            gen.speculation.draft_always()
            gen.speculation.pad_widths = pad_widths
            for uid in uids:
                gen.speculation.limits[uid] = 6
        out = {uid: [] for uid in uids}
        while any(len(v) < 30 for v in out.values()):
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        return list(out.values())

    # drafts of the last token repeated: random weights rarely write what their context holds
    speculative = SpeculativeGenerator(model, lookup=warmup.RepeatDrafts)
    assert tokens(speculative) == tokens(BatchGenerator(model))
    assert speculative.speculation.counters.speculative_steps > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_plain_steps_that_align_the_rows_first_give_plain_batchings_tokens_and_kv(monkeypatch, arch):
    """A GPU's plain steps move ragged rows to one end first (ragged_kv.align):
    the tokens are BatchGenerator's, and each row's KV a fresh prefill's."""
    model = _quantized_tiny(arch)
    if not backends.prepare(model, memory_bytes=2**30).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant (rounding moves with the batch)")
    monkeypatch.setattr("tierlm.engine.speculative_batch.PromptLookup", _Spoiled)
    ragged = []
    align = RaggedBatchKVCache.align
    monkeypatch.setattr(RaggedBatchKVCache, "align",
                        lambda c: ragged.append(len(set(c.ends)) > 1) or align(c))
    prompts = [list(range(10, 40)) * 3, [7, 8, 9, 11] * 10, list(range(60, 90)) * 3]

    gen = SpeculativeGenerator(model)
    gen.speculation.align_plain = True
    gen.speculation.costs = WidestSteps()
    gen.speculation.switch = AlternateDrafting()  # plain steps right after verifications
    ended = _run_drafting(gen, prompts, [60, 60, 60])
    plain = _drafting_tokens(BatchGenerator(model), prompts, limit=60)
    assert [r.all_tokens[len(p) :] for r, p in zip(ended, prompts)] == plain
    assert sum(ragged) > 5 and gen.speculation.counters.speculative_steps > 5
    for r in ended:
        _assert_fresh(model, r)


def test_a_warm_job_runs_a_plain_step_after_a_verification(monkeypatch):
    """What a plain step runs after a verification is compiled at warm-up on a
    GPU: an H100 compiled a gather for 3.7 s at the first such step of a run."""
    from tierlm.engine import speculative_batch

    kinds = []
    verify, plain = speculative_batch.SpeculativeBatch._verify, speculative_batch.GenerationBatch.next
    monkeypatch.setattr(speculative_batch.SpeculativeBatch, "_verify",
                        lambda self, *a: kinds.append("verify") or verify(self, *a))
    monkeypatch.setattr(speculative_batch.GenerationBatch, "next", lambda self: kinds.append("plain") or plain(self))
    warmup.run_shape(tiny_model("llama"), mx.default_stream(mx.default_device()), 2, warmup.SHORT_PROMPT, 2048, 3)
    assert ("verify", "plain") in set(zip(kinds, kinds[1:])), kinds


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_warm_job_writes_rows_that_end_apart(monkeypatch, arch):
    """On a GPU the scatter that writes keys of rows ending at different places
    (ragged_kv) is compiled at warm-up: an H100 compiled it for ~3.5 s in the
    first requests at four streams. The drafting jobs' rows may all take their
    drafts alike, so warm-up makes rows end apart itself, in every kind of
    layer (gemma3_text: sliding windows too)."""
    from tierlm.engine import ragged_kv, speculative_batch

    monkeypatch.setattr(speculative_batch, "pads_widths", lambda: True)  # as on a GPU
    monkeypatch.setattr(warmup, "pads_widths", lambda: True)
    written = []  # (the cache's class, how many different ends its rows had) at each write
    write = ragged_kv.RaggedBatchKVCache.update_and_fetch

    def counted(self, keys, values):
        written.append((type(self).__name__, len(set(self.ends))))
        return write(self, keys, values)

    monkeypatch.setattr(ragged_kv.RaggedBatchKVCache, "update_and_fetch", counted)
    model = tiny_model(arch, vocab_size=512)
    warmup.run_shape(model, mx.default_stream(mx.default_device()), 1, warmup.SHORT_PROMPT, 2048, 3)
    apart = {kind for kind, ends in written if ends > 1}
    layers = {type(c).__name__ for c in make_prompt_cache(model)}
    assert apart == ({"RaggedBatchKVCache", "RaggedWindowKVCache"} if "RotatingKVCache" in layers
                     else {"RaggedBatchKVCache"}), (written, layers)


def test_a_padded_width_is_a_power_of_two_or_the_widest():
    assert [padded_width(w, 8) for w in range(2, 9)] == [2, 4, 4, 8, 8, 8, 8]
    assert [padded_width(w, 6) for w in range(2, 7)] == [2, 4, 4, 6, 6]
    assert warmup.draft_widths(7) == [2, 4, 8] and warmup.draft_widths(5) == [2, 4, 6]
    assert warmup.draft_widths(0) == []


def test_a_recurrent_cache_turns_speculation_off():
    assert rollback_supported(_quantized_tiny("llama")) is None
    assert rollback_supported(tiny_model("gemma3_text", vocab_size=512)) is None  # sliding windows: ragged_kv
    assert "ArraysCache" in rollback_supported(tiny_model("qwen3_next", vocab_size=512))
    gen = SpeculativeGenerator(tiny_model("qwen3_next", vocab_size=512))
    assert not gen.speculation.enabled


# ---- a draft model, on tiny random models --------------------------------------


class _NoLookup(PromptLookup):
    """Lookups that find nothing: every draft comes from the draft model."""

    def propose(self, k, last):
        return []


def _drafting_tokens(gen, prompts, limit=40) -> list[list[int]]:
    uids = gen.insert(prompts, max_tokens=[limit] * len(prompts))
    if isinstance(gen, SpeculativeGenerator):
        gen.speculation.draft_always()
        for uid in uids:
            gen.speculation.limits[uid] = 5
    out = {uid: [] for uid in uids}
    while any(len(v) < limit for v in out.values()):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    return list(out.values())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_draft_models_drafts_leave_the_tokens_as_plain_batching_gives_them(monkeypatch, arch):
    """The model drafting for itself has every draft accepted (its rows stay in
    step with the sequences); another model's drafts are mostly rejected; the
    tokens are mlx-lm's BatchGenerator's either way."""
    model = _quantized_tiny(arch)
    if not backends.prepare(model, memory_bytes=2**30).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant (rounding moves with the batch)")
    other = tiny_model(arch, seed=5, vocab_size=512)
    nn.quantize(other, group_size=32, bits=4)
    monkeypatch.setattr("tierlm.engine.speculative_batch.PromptLookup", _NoLookup)
    prompts = [[3, 17, 250, 9, 44], list(range(60, 90)), [7, 8, 9, 11, 400, 2]]
    plain = _drafting_tokens(BatchGenerator(model), prompts)
    itself = SpeculativeGenerator(model, draft_model=model, vocab_size=512)
    assert _drafting_tokens(itself, prompts) == plain
    counters = itself.speculation.counters
    assert counters.proposed_tokens > 60 and counters.accepted_tokens == counters.proposed_tokens
    another = SpeculativeGenerator(model, draft_model=other, vocab_size=512)
    assert _drafting_tokens(another, prompts) == plain
    assert another.speculation.counters.accepted_tokens < another.speculation.counters.proposed_tokens / 2


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_draft_models_rows_hold_what_a_fresh_prefill_would_after_rejections(monkeypatch, arch):
    monkeypatch.setattr("tierlm.engine.speculative_batch.PromptLookup", _NoLookup)
    monkeypatch.setattr(RaggedWindowKVCache, "drop_chunk", 8)
    model, draft = tiny_model(arch, vocab_size=512), tiny_model(arch, seed=5, vocab_size=512)
    gen = SpeculativeGenerator(model, draft_model=draft, vocab_size=512)
    gen.speculation.draft_always()
    for uid in gen.insert([list(range(10, 80)), [5, 6, 7], list(range(100, 140))], max_tokens=[60] * 3):
        gen.speculation.limits[uid] = 6
    for _ in range(12):
        gen.next()
    batch, source = gen.speculation, gen.speculation.draft_source
    assert batch.counters.accepted_tokens < batch.counters.proposed_tokens
    assert sorted(source.uids) == sorted(batch.uids)
    for row, uid in enumerate(source.uids):
        tokens = batch.tokens[batch.uids.index(uid)][: source.fed[uid]]
        for layer, fresh in zip(source.cache, _fresh_caches(draft, tokens)):
            kept = layer.extract(row)
            assert kept.offset == fresh.offset
            assert mx.allclose(_keys_in_order(kept), _keys_in_order(fresh), atol=1e-4).item()


def test_a_draft_model_that_cannot_give_tokens_back_is_refused(tokenizer):
    with pytest.raises(ValueError, match="cannot give back"):
        check_draft_model(tiny_model("qwen3_next", vocab_size=512), tokenizer, tokenizer, "recurrent")


# ---- the default model, in process ------------------------------------------


@pytest.fixture
def drafts_every_step(monkeypatch):
    """The engines a test starts verify every draft at its full width: how much
    they draft then does not depend on how fast this machine's steps are
    (adaptivity has tests of its own above)."""
    monkeypatch.setenv("TIERLM_TEST_DRAFT_ALWAYS", "1")


def _request(loaded, engine, messages, **params):
    tokens = loaded[1].apply_chat_template(messages, add_generation_prompt=True)
    return Request(engine.new_request_id(), tokens, SamplingParams(**{"temperature": 0, **params}))


async def _answers(loaded, batches, **settings):
    """Each batch of (messages, params) run together; the outputs, and the engine's counters.
    Speculation is asked for (its default, auto, leaves it off where products are not batch-invariant)."""
    engine = await started(loaded, **{"speculation": "prompt-lookup", **settings})
    outs = []
    for batch in batches:
        outs += await asyncio.gather(*[engine.generate(_request(loaded, engine, m, **p)) for m, p in batch])
    counters = engine.scheduler.counters
    await engine.close()
    return outs, counters


@pytest.mark.slow  # two engines, fifteen answers
def test_answers_of_the_default_model_equal_with_and_without_speculation(loaded, drafts_every_step):
    """Greedy: code edits, prose, a stop string, a length limit mid-draft,
    logprobs, penalties and a JSON schema (a grammar: its drafts are verified a
    token at a time against it), alone and batched. Seeded, at temperature > 0:
    a draft token is kept when it is the token the request's own key draws at
    its place, so a seed's answer is the same with drafts or without (and so is
    its distribution); the random-weight test above covers a seeded row in the
    fast run."""
    if not backends.describe(loaded[0]).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant: batching itself moves rounding")
    grammars = ModelGrammars(loaded[1])
    schema = {"type": "object", "properties": {"functions": {"type": "array", "items": {"type": "string"}}},
              "required": ["functions"]}
    listing = [{"role": "user", "content": f"```python\n{SHORT}```\nList the functions of this module as JSON."}]
    sampled = {"max_tokens": 40, "temperature": 0.3, "top_p": 0.95}

    def batches():  # a grammar's state is a request's own: fresh ones for each engine
        # the edits share one ~770-token source with the listing (prefix-cache hits)
        return [[(SHORT_EDIT, {"max_tokens": 48})], [(PROSE, {"max_tokens": 24})],
                [(listing, {"max_tokens": 40, "constraint": grammars.constraint(json_schema_grammar(schema))})],
                [(SHORT_EDIT, {"max_tokens": 40, "stop": ["0.30*r"]}),  # mid-copy, where drafts run long
                 (SHORT_EDIT, {"max_tokens": 40, "logprobs": 2}),
                 (SHORT_EDIT, {"max_tokens": 40, "presence_penalty": 0.5, "repetition_penalty": 1.1}),
                 (PROSE, {"max_tokens": 30})],
                [(SHORT_EDIT, {**sampled, "seed": 2}), (SHORT_EDIT, {**sampled, "seed": 3, "top_k": 40}),
                 (SHORT_EDIT, {"max_tokens": 40})]]

    on, counters = run(_answers(loaded, batches()))
    off, _ = run(_answers(loaded, batches(), speculation="off"))
    assert counters.accepted_tokens > 0  # it did speculate
    for a, b in zip(on, off):
        assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (b.token_ids, b.text, b.finish_reason, b.logprobs)
    assert on[2].text.startswith('{"functions"') and on[3].finish_reason == "stop"
    assert len({tuple(a.token_ids) for a in on[-3:]}) > 1  # the seeds do sample


@pytest.mark.slow  # two engines keeping KV at 8 bits, six answers
def test_answers_over_8_bit_kv_equal_with_and_without_speculation(loaded, drafts_every_step):
    """`batch_kv_bits` 8: rows whose drafts are partly rejected keep their KV
    quantized as a plain batch's (engine.ragged_quantized_kv), greedy and
    seeded, alone and batched, a second turn of the edits hitting the first's
    blocks."""
    if not backends.describe(loaded[0]).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant: batching itself moves rounding")
    sampled = {"max_tokens": 40, "temperature": 0.3, "top_p": 0.95, "seed": 2}
    batches = [[(SHORT_EDIT, {"max_tokens": 48})],
               [(SHORT_EDIT, {"max_tokens": 40, "logprobs": 2}), (PROSE, {"max_tokens": 30}),
                (SHORT_EDIT, sampled), (SHORT_EDIT, {"max_tokens": 40, "stop": ["0.30*r"]})]]
    on, counters = run(_answers(loaded, batches, batch_kv_bits=8))
    off, _ = run(_answers(loaded, batches, batch_kv_bits=8, speculation="off"))
    assert 0 < counters.accepted_tokens < counters.proposed_tokens
    for a, b in zip(on, off):
        assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (b.token_ids, b.text, b.finish_reason, b.logprobs)
    assert on[1].cached_tokens > 700  # the first edit's blocks


@pytest.mark.slow  # Gemma 3 270M loaded, two engines
def test_gemma_answers_equal_with_and_without_speculation_past_its_sliding_window(gemma_path, drafts_every_step):
    """Gemma 3's local layers see 512 tokens; these prompts are ~900 tokens
    and the answers run on past them, with drafts the windows' ragged rows give
    back, greedy and seeded, alone and batched."""
    from tierlm.models.loader import load_model

    gemma = load_model(str(gemma_path))
    if not backends.describe(gemma[0]).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant: batching itself moves rounding")
    copy = gemma[1].encode(f"{SHORT}\n\n# colorsys.py, once more:\n{SHORT[:300]}")
    story = gemma[1].encode(f"{SHORT}\n\nOnce upon a time, a lighthouse keeper")
    assert len(story) > 512 + 256  # past the window by more than a prefill chunk

    def batches():
        return [[(copy, {"max_tokens": 56})],
                [(copy, {"max_tokens": 48, "temperature": 0.5, "seed": 4}), (story, {"max_tokens": 32}),
                 (copy, {"max_tokens": 48, "stop": ["RGB: Red"]})]]  # ~35 tokens into the copy

    async def answers(**settings):
        engine = await started(gemma, **{"speculation": "prompt-lookup", **settings})
        outs = []
        for batch in batches():
            outs += await asyncio.gather(*[engine.generate(Request(
                engine.new_request_id(), tokens, SamplingParams(**{"temperature": 0, **p}))) for tokens, p in batch])
        counters = engine.scheduler.counters
        await engine.close()
        return outs, counters

    on, counters = run(answers())
    off, _ = run(answers(speculation="off"))
    assert counters.accepted_tokens > 75 and on[-1].finish_reason == "stop", on[-1].text  # 123 on the Xeon
    for a, b in zip(on, off):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def test_a_missing_draft_model_fails_the_start(loaded):
    with pytest.raises(ValueError, match="no model folder"):
        run(started(loaded, draft_model="no-such-draft-model"))


@pytest.mark.slow  # two engines, the draft model loaded beside the model
def test_the_default_model_drafting_for_itself_answers_as_without_drafts(loaded, model_path):
    """Prose, where a sequence's own context offers no drafts: the draft
    model's are verified, greedy and seeded answers equal with drafts and
    without."""
    if not backends.describe(loaded[0]).batch_invariant:
        pytest.skip("this backend's products are not batch-invariant: batching itself moves rounding")
    batches = [[(PROSE, {"max_tokens": 24})],
               [(PROSE, {"max_tokens": 24, "temperature": 0.6, "seed": 2}), (SHORT_EDIT, {"max_tokens": 24})]]
    on, counters = run(_answers(loaded, batches, draft_model=str(model_path)))
    off, _ = run(_answers(loaded, batches, speculation="off"))
    # a draft model as large as the model never pays: drafting is tried, then mostly left (adaptive)
    assert counters.accepted_tokens > 0
    assert [a.token_ids for a in on] == [b.token_ids for b in off]


@pytest.mark.slow  # needs Qwen2.5-Coder pulled
def test_a_draft_model_of_another_tokenizer_fails_the_start_saying_why(loaded, qwen_path, tmp_path):
    """A draft model with Qwen2.5-Coder's tokenizer (tiny random weights: the
    tokenizer is what the check reads, and loading the real model takes long)."""
    draft = make_random_model("tiny", tmp_path / "draft", qwen_path, "float32")
    with pytest.raises(ValueError, match="tokenizer is not the model's"):
        run(started(loaded, draft_model=str(draft)))


@pytest.mark.slow  # 80 tokens of drafts and a block-by-block prefill to compare (~10 s)
def test_the_prefix_cache_holds_only_accepted_tokens(loaded, drafts_every_step):
    """After a request whose drafts were partly rejected, every block in the
    cache holds its own tokens' KV: a fresh prefill's, to float rounding."""

    async def go():
        engine = await started(loaded, cache_block_size=16, speculation="prompt-lookup")
        request = _request(loaded, engine, SHORT_EDIT, max_tokens=80, ignore_eos=True)
        out = await engine.generate(request)
        tokens = request.prompt_tokens + out.token_ids
        # the answer's blocks are stored as the next step starts: a request extending it finds them all
        again = await engine.generate(Request(engine.new_request_id(), tokens + [28, 198],
                                              SamplingParams(max_tokens=1, temperature=0)))
        cache = engine.scheduler.cache
        lookup = cache.lookup(tokens + [0])
        stored = [c.state[0] for c in cache.rebuild(lookup.blocks, lookup.part, lookup.part_tokens)]
        counters = engine.scheduler.counters
        await engine.close()
        return tokens, again.cached_tokens, lookup, stored, counters

    tokens, cached, lookup, stored, counters = run(go())
    assert 0 < counters.accepted_tokens < counters.proposed_tokens
    n = len(tokens)
    # the answer's blocks too, and its part block
    assert cached == n == lookup.tokens and len(lookup.blocks) == n // 16
    for kept, fresh in zip(stored, _fresh_keys(loaded[0], tokens[:n])):
        assert mx.allclose(kept[..., :n, :], fresh, atol=1e-3).item()


@pytest.mark.slow  # two engines; the request field's parsing is in the fast run (the 400s below)
def test_a_request_can_turn_speculation_off_or_limit_it(loaded, drafts_every_step):
    batches = [[(SHORT_EDIT, {"max_tokens": 40, "speculative_tokens": 0})]]
    _, counters = run(_answers(loaded, batches))
    assert counters.proposed_tokens == 0
    _, counters = run(_answers(loaded, [[(SHORT_EDIT, {"max_tokens": 40, "speculative_tokens": 2})]]))
    assert 0 < counters.proposed_tokens <= 2 * counters.speculative_steps


# ---- over HTTP ----------------------------------------------------------------


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/chat/completions", {"messages": PROSE, "speculative_tokens": 17}, "openai"),
    ("/v1/chat/completions", {"messages": PROSE, "speculative_tokens": -1}, "openai"),
    ("/v1/completions", {"prompt": "hi", "speculative_tokens": "many"}, "openai"),
    ("/v1/chat/completions", {"messages": PROSE, "speculative_tokens": 2**70}, "openai"),
    ("/v1/chat/completions", {"messages": PROSE, "speculative_tokens": 2.5}, "openai"),
    ("/v1/messages", {"model": "m", "messages": PROSE, "max_tokens": 8, "speculative_tokens": 99}, "anthropic"),
    ("/v1/responses", {"input": "hi", "speculative_tokens": 17}, "openai"),
    ("/api/chat", {"messages": PROSE, "options": {"speculative_tokens": 40}}, "ollama"),
])
def test_an_out_of_range_draft_length_is_a_400_in_the_apis_shape(server, path, body, shape):
    if shape == "ollama":
        body = {"model": httpx.get(server.v1 + "/models", timeout=30).json()["data"][0]["id"], **body}
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    if shape == "openai":
        assert error["error"]["param"] == "speculative_tokens"
    elif shape == "anthropic":
        assert error["type"] == "error" and "speculative_tokens" in error["error"]["message"]
    else:
        assert "speculative_tokens" in error["error"]
    ok = httpx.post(server.v1 + "/chat/completions", timeout=60,
                    json={"messages": PROSE, "max_tokens": 2})
    assert ok.status_code == 200  # and the next request is served


@pytest.mark.slow  # a code edit answered on the shared server; drafts are counted in the engine tests
def test_metrics_and_stats_count_drafts(server):
    body = {"messages": SHORT_EDIT, "max_tokens": 64, "temperature": 0}
    assert httpx.post(server.v1 + "/chat/completions", json=body, timeout=300).status_code == 200
    if not server.stats()["backend"].get("batch_invariant"):
        pytest.skip("speculation is off by default here (auto: the backend's products are not batch-invariant)")
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    drafted = [line for line in metrics.splitlines() if line.startswith("tierlm:spec_decode_draft_tokens_total")]
    accepted = [line for line in metrics.splitlines()
                if line.startswith("tierlm:spec_decode_accepted_tokens_total")]
    assert drafted and accepted and float(drafted[0].split()[-1]) >= float(accepted[0].split()[-1]) > 0
    speculation = server.stats()["speculation"]
    assert speculation["accepted_tokens"] > 0
    # what the switch measured, by batch size: {"1": {"drafting": tok/s, "plain": tok/s}}
    for size, ways in speculation["tok_s_by_batch_size"].items():
        assert int(size) >= 1 and set(ways) <= {"drafting", "plain"} and all(v > 0 for v in ways.values())


# ---- Qwen2.5-Coder over HTTP (slow: the agent model served) --------------------


@pytest.mark.slow
def test_qwen_coder_answers_equal_with_speculation_on_and_off(qwen_server):
    """The agent model on its own template: a code edit (greedy, and sampled
    with a seed), a tool call quoting the file (a grammar holds its shape) and
    a JSON schema, each alone with `speculative_tokens: 0`, then all at once
    in one batch with drafts (the default model's test has drafts alone)."""
    from conftest import AGENT_KEY

    from tierlm.loadgen.edits import EDIT_TOOL

    headers = {"Authorization": f"Bearer {AGENT_KEY}"}

    def stats() -> dict:
        return httpx.get(qwen_server.base_url + "/stats", headers=headers, timeout=30).json()["engines"][0]

    bodies = [
        {"messages": SHORT_EDIT, "max_tokens": 64},
        {"messages": SHORT_EDIT, "max_tokens": 64, "temperature": 0.4, "top_p": 0.9, "seed": 11},
        {"messages": [{"role": "user", "content": f"```python\n{SHORT}```\nUse edit_file on colorsys.py to "
                                                  "rename rgb_to_yiq to rgb_to_ntsc: old_string is the whole "
                                                  "function, new_string the same renamed."}],
         "tools": [EDIT_TOOL], "tool_choice": "required", "max_tokens": 160},
        {"messages": [{"role": "user", "content": f"```python\n{SHORT}```\nList its functions."}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {
             "type": "object", "properties": {"functions": {"type": "array", "items": {"type": "string"}}},
             "required": ["functions"]}}}, "max_tokens": 60},
    ]

    def answer(body, **extra):
        r = httpx.post(qwen_server.v1 + "/chat/completions", headers=headers, timeout=600,
                       json={"temperature": 0, **body, **extra})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return message.get("content"), calls

    if not stats()["backend"].get("batch_invariant"):
        pytest.skip("this backend's products are not batch-invariant: speculation is off by default (auto)")
    off = [answer(b, speculative_tokens=0) for b in bodies]
    assert off[2][1] and "rgb_to_ntsc" in off[2][1][0][1]
    before = stats()["speculation"]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(bodies)) as pool:  # with drafts, all in one batch
        assert list(pool.map(answer, bodies)) == off
    after = stats()["speculation"]
    assert after["accepted_tokens"] - before["accepted_tokens"] > 0  # drafts were kept in that batch
