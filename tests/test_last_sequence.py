"""The last sequence's KV kept as it is (engine/last_sequence.py): a
conversation's next turn takes the buffers its last turn left in the batch,
no rebuild, and answers exactly as from blocks and as computed; anything else
drops them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_testing import run, started
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from tierlm.cache.codecs import RebuiltKVCache
from tierlm.engine.last_sequence import LastSequence, whole_kv
from tierlm.engine.request import Request, SamplingParams
from tierlm.models.random_model import tiny_model


def batch_caches(model, tokens: list[int], padding: int = 0) -> list:
    """mlx-lm's batch cache of one row after `tokens` (left-padded by `padding`)."""
    caches = [BatchKVCache([padding]) for _ in model.layers]
    model(mx.array([[0] * padding + tokens]), cache=caches)
    return caches


def test_a_lone_rows_buffers_are_kept_as_they_are():
    """(Fails loudly if mlx-lm's BatchKVCache changes the fields this reads.)"""
    model = tiny_model("llama")
    caches = batch_caches(model, list(range(1, 40)))
    whole = whole_kv(caches, 39)
    assert all(type(w) is RebuiltKVCache and w.offset == 39 for w in whole)
    assert all(w.keys is c.keys and w.values is c.values for w, c in zip(whole, caches))  # no copy
    assert all(w.keys.shape[2] == BatchKVCache.step for w in whole)  # the room after the tokens
    assert whole_kv(caches, 38) is None  # not the tokens it holds
    assert whole_kv(batch_caches(model, list(range(1, 40)), padding=3), 39) is None
    assert whole_kv([KVCache() for _ in model.layers], 0) is None


def test_mlx_lms_batch_drops_a_leaving_rows_caches():
    """Why the generation batch keeps them (LeavesLastRow): mlx-lm's filter of
    the last row empties the batch's cache list."""
    batch = GenerationBatch.empty(None, None) if hasattr(GenerationBatch, "empty") else None
    if batch is None:
        pytest.fail("mlx-lm's GenerationBatch.empty is gone: LeavesLastRow's assumptions need a look")
    batch.uids, batch.prompt_cache = [7], [object()]
    batch.tokens, batch.samplers, batch.logits_processors = [[1]], [None], [None]
    batch.max_tokens, batch.stop_sequences = [1], [None]
    batch._next_tokens, batch._next_logprobs, batch._token_context = mx.array([1]), [None], [None]
    batch._num_tokens, batch._matchers = [0], [None]
    cache_list = batch.prompt_cache
    batch.filter([])
    assert cache_list == [] and batch.uids == []


@pytest.mark.parametrize("prompt, reach", [
    (list(range(100)) + [5, 6], 100),  # continues all of it
    (list(range(100)), 99),  # the same tokens: one is left to compute
    (list(range(60)) + [999] * 50, 60),  # leaves it inside
    ([999] + list(range(1, 100)), 0),
    ([0], 0),
])
def test_how_much_of_a_prompt_the_kept_tokens_hold(prompt, reach):
    assert LastSequence(list(range(100)), []).reach(prompt) == reach


def ask(engine, tokens, max_tokens=6) -> Request:
    return Request(engine.new_request_id(), tokens, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1))


def conversation(loaded, turns: int, between=None, **settings):
    """Each turn the last prompt, its answer and new tokens; `between`: a prompt
    sent before each next turn. The answers (tokens, log-probabilities, cached
    tokens) and the cache's statistics after."""
    tokenizer = loaded[1]
    start = tokenizer.apply_chat_template([{"role": "user", "content": "Count the birds on the fence. " * 30}],
                                          add_generation_prompt=True)

    async def go():
        engine = await started(loaded, **settings)
        prompt, answers = list(start), []
        for turn in range(turns):
            out = await engine.generate(ask(engine, prompt))
            answers.append((out.token_ids, [lp for _, lp, _ in out.logprobs or []], out.cached_tokens))
            prompt = prompt + out.token_ids + tokenizer.encode(f" And then {turn} more?", add_special_tokens=False)
            if between is not None:
                await engine.generate(ask(engine, between, max_tokens=1))
        stats = await engine.cache_stats()
        await engine.close()
        return answers, stats

    return run(go())


@pytest.mark.slow  # three engines; the edited history below takes the kept KV in the fast run
def test_a_next_turn_takes_the_last_turns_kv_and_answers_as_from_blocks_and_as_computed(loaded):
    kept, stats = conversation(loaded, 3)
    blocks, block_stats = conversation(loaded, 3, between=[7] * 20)  # another prompt drops the kept KV
    computed, _ = conversation(loaded, 3, prefix_cache=False)
    assert stats["kept_hits"] == 2 and block_stats["kept_hits"] == 0
    assert stats["kept_hit_tokens"] == sum(cached for _, _, cached in kept)
    # the whole last turn (its prompt and answer) is held: only the new tokens are computed
    assert [cached for _, _, cached in kept[1:]] == [cached for _, _, cached in blocks[1:]]
    assert all(cached > 0 for _, _, cached in kept[1:])
    assert [(t, lp) for t, lp, _ in kept] == [(t, lp) for t, lp, _ in blocks]  # the same KV: the same bits
    for (tokens, logprobs, _), (want, want_lp, _) in zip(kept, computed):
        assert tokens == want and logprobs == pytest.approx(want_lp, abs=1e-3)
    assert stats["kept_sequence_bytes"] > 0 and stats["kept_sequence_tokens"] > kept[-1][2]


def test_an_edited_history_takes_what_it_still_shares_and_clearing_drops_it(loaded):
    """A prompt that leaves the kept tokens part-way takes them up to there (more
    than its blocks hold) and answers as computed; clearing the cache drops them."""
    tokenizer = loaded[1]
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Name the rivers of Europe. " * 10}],
                                          add_generation_prompt=True)

    async def go(**settings):
        engine = await started(loaded, cache_block_size=64, **settings)
        out = await engine.generate(ask(engine, first, max_tokens=20))
        edited = first + out.token_ids[:10] + [7, 7, 7]  # the answer cut short, then other tokens
        again = await engine.generate(ask(engine, edited))
        stats = await engine.cache_stats()
        await engine.clear_cache()
        cleared = await engine.cache_stats()
        await engine.close()
        return len(first), again, stats, cleared

    n, again, stats, cleared = run(go())
    _, computed, _, _ = run(go(prefix_cache=False))
    assert stats["kept_hits"] == 1 and again.cached_tokens == n + 10  # past the last full block (64)
    assert again.token_ids == computed.token_ids
    assert [lp for _, lp, _ in again.logprobs] == pytest.approx([lp for _, lp, _ in computed.logprobs], abs=1e-3)
    assert cleared["kept_sequence_bytes"] == 0


def scheduler_run(loaded, steps):
    """`steps(scheduler)` on an engine's worker thread (blocks of 16 tokens, no drafts)."""

    async def go():
        engine = await started(loaded, cache_block_size=16, speculation="off")
        try:
            return await engine.on_worker(steps, engine.scheduler)
        finally:
            await engine.close()

    return run(go())


def rivers(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the rivers of Europe, " * 3}],
                                         add_generation_prompt=True)


def drain(s) -> list:
    outputs = []
    while s.has_work():
        s.step()
        outputs += s.take_outputs()
    return outputs


def test_an_aborted_turns_blocks_keep_its_kv_when_the_next_turn_writes_into_its_buffers(loaded):
    """An abort's blocks are stored a step late: the next turn, admitted in the
    same step, takes the buffers and writes into them first. The blocks stored
    for the aborted tokens still hold their own KV (as computed afresh)."""
    model, tokenizer = loaded
    prompt = rivers(tokenizer)

    def steps(s):
        s.add_request(Request("r1", prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
        got = []
        while len(got) < 40:
            s.step()
            got += [t for o in s.take_outputs() for t in o.token_ids]
        s.abort("r1")
        s.add_request(Request("r2", prompt + got[:5] + [1234] * 40, SamplingParams(max_tokens=3, temperature=0)))
        s.step()  # the abort queues r1's blocks and keeps its KV; r2 takes it and is written in place
        stored = s._to_store[0][1]
        kept_hits = s.cache.stats.kept_hits
        drain(s)
        lookup = s.cache.lookup(stored + [0])
        rebuilt = s.cache.rebuild(lookup.blocks, lookup.part, lookup.part_tokens)
        fresh = [KVCache() for _ in rebuilt]
        model(mx.array([stored]), cache=fresh)
        n = lookup.tokens
        return kept_hits, n, len(stored), all(mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-2).item()
                                              for a, b in zip(rebuilt, fresh))

    kept_hits, hit, stored, same = scheduler_run(loaded, steps)
    assert kept_hits == 1 and hit == stored and same


def test_a_memory_shortfall_in_the_step_a_turn_takes_the_kept_kv_leaves_it_with_the_turn(loaded, monkeypatch):
    """Memory short for a later request of the same step (a shortfall forced
    once: it cannot be timed for real) drops what is kept, not the KV the next
    turn was admitted with; both requests answer."""
    prompt = rivers(loaded[1])

    def steps(s):
        s.add_request(Request("r1", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        got = [t for o in drain(s) for t in o.token_ids]
        s.add_request(Request("r2", prompt + got + [5] * 20, SamplingParams(max_tokens=2, temperature=0)))
        s.add_request(Request("r3", [9] * 50, SamplingParams(max_tokens=2, temperature=0)))
        calls = []

        def shortfall(needed, promised=0):
            calls.append(promised)
            return 1 if promised and len(calls) == 1 else 0

        monkeypatch.setattr(s.guard, "shortfall", shortfall)
        s.step()
        monkeypatch.undo()
        outputs = s.take_outputs() + drain(s)
        return s.cache.stats.kept_hits, [(o.request_id, o.error) for o in outputs if o.finished]

    kept_hits, ends = scheduler_run(loaded, steps)
    assert kept_hits == 1 and sorted(ends) == [("r2", None), ("r3", None)]
