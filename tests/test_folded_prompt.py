"""A short prompt end runs with its last token in one pass (folded_prompt).

- The model's logits at chosen positions, its head applied there only, equal its
  full call's (tiny models of each cache type, the default model as loaded with
  its CPU backend, and Qwen2.5-Coder in the full run): this fails loudly if a model stops holding its backbone
  as `model.model`.
- The generator: rows folded, ragged, beside a row that is not, give the tokens
  and log-probabilities of the same rows unfolded (this also fails loudly if
  mlx-lm's prompt batch changes what folded_prompt reaches into).
- The engine on the default model: a chat's next turn, short or a tool output
  past a block, runs one model call before its first token's step (not two) and
  takes no copy of the cache (the blocks it completes past a block are stored
  from views of its buffers), and answers as it did unfolded.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_testing import request, run, started
from mlx_lm.models.cache import make_prompt_cache

from tierlm.engine.folded_prompt import FoldedEnds, FoldingPromptBatch, can_fold, last_position_logits
from tierlm.engine.request import Request, SamplingParams
from tierlm.engine.speculative_batch import SpeculativeGenerator
from tierlm.models.random_model import TINY, tiny_model


def logits_at_positions_match(model, inputs: mx.array, positions: list[int]) -> bool:
    full = model(inputs, cache=make_prompt_cache(model))[mx.arange(inputs.shape[0]), mx.array(positions)]
    cut = last_position_logits(model, inputs, make_prompt_cache(model), mx.array(positions))
    assert cut.shape == (inputs.shape[0], 1, full.shape[-1])
    return mx.allclose(full, cut[:, 0], atol=1e-4).item()


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_head_at_chosen_positions_gives_the_full_calls_logits_there(name):
    model = tiny_model(name)
    assert can_fold(model)
    backbone = model.model
    inputs = mx.random.randint(1, 250, (2, 9), key=mx.random.key(1))
    assert logits_at_positions_match(model, inputs, [8, 3])
    assert model.model is backbone  # put back after the call


def test_the_default_models_head_at_chosen_positions_gives_its_full_calls_logits(loaded):
    model, tokenizer = loaded
    inputs = mx.array([tokenizer.encode("The leaves fall in autumn, red and gold.")[:9]])
    assert logits_at_positions_match(model, inputs, [8])


@pytest.mark.slow  # loads Qwen2.5-Coder-0.5B
def test_qwen_coders_head_at_chosen_positions_gives_its_full_calls_logits(qwen_path):
    """The model agents are pointed at (qwen2, untied head, as imported from its GGUF)."""
    from tierlm.models.loader import load_model

    model, tokenizer = load_model(qwen_path)
    assert can_fold(model)
    inputs = mx.array([tokenizer.encode("def add(a, b):\n    return a + b\n")[:9]] * 2)
    assert logits_at_positions_match(model, inputs, [8, 4])


def test_only_a_prompt_whose_uncached_tokens_are_one_short_end_is_held_back():
    """A longer prompt's last segment stays in the prompt batch: its blocks are
    stored where its prefill ends (test_engine's requests extending it)."""
    folds = FoldedEnds()
    pending = [(0, [[1] * 10, [2]]), (1, [[1] * 64, [1] * 10, [2]]), (2, [[1] * 70, [2]]), (3, [[2]])]
    folds.hold(pending, 64)
    assert folds.by_uid == {0: [1] * 10}
    assert [len(entry[1]) for entry in pending] == [1, 3, 2, 1]


def generated(model, prompts, hits, fold_limit: int) -> tuple[list, int]:
    """Each prompt's tokens and log-probabilities (5 greedy tokens), its first
    `hits[i]` tokens prefilled into its cache beforehand as a cache hit would be."""
    gen = SpeculativeGenerator(model, completion_batch_size=4, prefill_batch_size=4, prefill_step_size=64)
    gen.fold_limit = fold_limit
    caches = []
    for prompt, hit in zip(prompts, hits):
        cache = make_prompt_cache(model)
        if hit:
            model(mx.array([prompt[:hit]]), cache=cache)
            mx.eval([c.state for c in cache])
        caches.append(cache)
    uids = gen.insert_segments([[p[h:]] for p, h in zip(prompts, hits)], max_tokens=[5] * len(prompts),
                               caches=caches, all_tokens=[p[:h] for p, h in zip(prompts, hits)])
    out = {uid: [] for uid in uids}
    while any(len(v) < 5 for v in out.values()):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append((r.token, r.logprobs))
    assert not gen.folds.by_uid
    return [out[uid] for uid in uids], gen.folds.computed


@pytest.mark.parametrize("name", sorted(TINY))
def test_folded_rows_answer_as_unfolded_ones(name):
    model = tiny_model(name)
    prompts = [list(range(10, 60)), list(range(30, 50)), list(range(5, 105))]
    hits = [40, 0, 0]  # a hit's next turn (10 tokens), a short cold prompt, a long one (not folded)
    folded, computed = generated(model, prompts, hits, fold_limit=32)
    plain, none = generated(model, prompts, hits, fold_limit=0)
    assert (computed, none) == (9 + 19, 0)
    for row_folded, row_plain in zip(folded, plain):
        assert [t for t, _ in row_folded] == [t for t, _ in row_plain]
        for (_, a), (_, b) in zip(row_folded, row_plain):
            assert mx.allclose(a, b, atol=1e-4).item()


# a short next turn (within a block of 64), and a tool output's worth (past a
# block, within a prefill chunk of 256 on the CPU)
NEXT_TURNS = {"short": "\nAnd in winter?",
              "long": "\nHere is the log:\n" + "".join(f"line {i}: ok, 12 ms\n" for i in range(14))}


@pytest.mark.parametrize("turn_kind", sorted(NEXT_TURNS))
def test_a_chats_next_turn_runs_one_model_call_before_its_first_token(loaded, monkeypatch, turn_kind):
    model = loaded[0]
    calls, copies = [], []

    async def go(fold: bool):
        engine = await started(loaded)
        gen = engine.scheduler._gen
        if not fold:
            gen.fold_limit = 0
        real_extract = gen.extract_cache
        monkeypatch.setattr(gen, "extract_cache", lambda uids: copies.append(uids) or real_extract(uids))
        first = request(loaded, engine, max_tokens=12)
        out = await engine.generate(first)
        turn = first.prompt_tokens + out.token_ids + loaded[1].encode(NEXT_TURNS[turn_kind])
        real_call = type(model).__call__
        monkeypatch.setattr(type(model), "__call__", lambda self, x, **k: calls.append(x.shape) or real_call(self, x, **k))
        calls.clear(), copies.clear()
        again = await engine.generate(Request(engine.new_request_id(), turn, SamplingParams(max_tokens=1, temperature=0)))
        monkeypatch.undo()
        await engine.close()
        return len(turn), again, list(calls), list(copies)

    length, folded, folded_calls, folded_copies = run(go(fold=True))
    _, plain, plain_calls, plain_copies = run(go(fold=False))
    remainder = length - folded.cached_tokens
    assert (1 < remainder <= 64) if turn_kind == "short" else (64 < remainder <= 256)
    # the first token comes out before a second step is sent (engine.first_token)
    # past a block, its blocks are stored after its first step, from views of the
    # lone row's buffers: no copy of the cache either way
    assert folded_calls == [(1, remainder)] and folded_copies == []
    assert plain_calls == [(1, remainder - 1), (1, 1)] and len(plain_copies) == 1
    assert folded.token_ids == plain.token_ids


def test_a_folded_ends_blocks_stored_after_its_first_step_hold_its_kv(loaded):
    """A cold prompt of ~150 tokens (past a block of 64, within a chunk of 256)
    is folded, and its blocks are stored right after its first step from views
    of the buffers the batch then goes on writing its answer into. The same
    prompt again, its kept KV dropped, takes all but its last token from those
    blocks and answers as the first time and as an engine without a cache."""
    text = [{"role": "user", "content": "Here is the log:\n" + "".join(f"line {i}: ok\n" for i in range(24))
             + "How many lines are there?"}]

    async def go(**settings):
        engine = await started(loaded, **settings)
        first = await engine.generate(request(loaded, engine, max_tokens=24, text=text))
        if engine.scheduler.cache is not None:
            engine.scheduler.cache.last = None  # another request's way: the next is rebuilt from blocks
        again = await engine.generate(request(loaded, engine, max_tokens=24, text=text))
        await engine.close()
        return first, again

    first, again = run(go())
    (plain, _) = run(go(prefix_cache=False))
    n = len(loaded[1].apply_chat_template(text, add_generation_prompt=True))
    assert 64 < n <= 256 and first.cached_tokens == 0 and again.cached_tokens == n - 1
    assert first.token_ids == again.token_ids == plain.token_ids


def test_a_prompt_batch_moving_whole_to_generation_takes_its_caches_uncopied(monkeypatch):
    """mlx-lm's split copies the moving rows' KV twice (a deep copy, then a
    gather); a lone request (the whole prompt batch) moves its caches as they
    are. A part of the batch moving still goes through mlx-lm's split (the
    answers' test above runs both)."""
    seen = []
    real_split = FoldingPromptBatch.split

    def split(self, indices):
        before = list(self.prompt_cache)
        moved = real_split(self, indices)
        seen.append((before, list(moved.prompt_cache), len(self.uids), len(moved.uids)))
        return moved

    monkeypatch.setattr(FoldingPromptBatch, "split", split)
    generated(tiny_model(sorted(TINY)[0]), [list(range(10, 60))], [40], fold_limit=32)
    before, after, left, moved = seen[0]
    assert (left, moved) == (0, 1) and len(after) == len(before)
    assert all(a is b for a, b in zip(before, after))
