"""Part blocks: a hit continues past its last full block with the first tokens of
a cached block after it (the tokens a sequence ended with, or a sibling the prompt
leaves inside), so a chat's next turn computes its new tokens only."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from test_prefix_cache_unit import computed

from tierlm.cache.codecs import codecs_for
from tierlm.cache.prefix_cache import MIN_PART_TOKENS, PrefixCache
from tierlm.models.random_model import tiny_model

BLOCK = 32


def new_cache(model, **kwargs) -> PrefixCache:
    return PrefixCache(b"fingerprint", codecs_for(make_prompt_cache(model)), BLOCK, 2**30, **kwargs)


def continues_as_computed(model, pc, lookup, prompt) -> bool:
    """The rest of `prompt` over the rebuilt hit gives the logits of the whole prompt computed."""
    rebuilt = pc.rebuild(lookup.blocks, lookup.part, lookup.part_tokens)
    assert rebuilt[0].offset == lookup.tokens
    got = model(mx.array([prompt[lookup.tokens :]]), cache=rebuilt)[:, -1]
    expected = model(mx.array([prompt]), cache=make_prompt_cache(model))[:, -1]
    return mx.allclose(expected, got, atol=1e-4).item()


def test_a_next_turn_hits_the_tokens_its_last_turn_ended_with():
    model = tiny_model("llama")
    turn = list(range(1, 91))  # two full blocks and 26 tokens after them
    pc = new_cache(model)
    assert pc.store(turn, [], computed(model, turn), 0) == 2
    assert pc.stats.stored_blocks == 2 and pc.stats.stored_parts == 1
    next_turn = turn + [200, 201, 202, 203]
    lookup = pc.lookup(next_turn)
    assert (len(lookup.blocks), lookup.part_tokens, lookup.tokens) == (2, 26, 90)
    assert continues_as_computed(model, pc, lookup, next_turn)
    pc.record(lookup, len(next_turn))
    assert pc.stats.part_hit_tokens == 26 and pc.stats.hit_tokens == 90


def test_the_same_prompt_again_computes_only_its_last_token():
    model = tiny_model("llama")
    prompt = list(range(1, 91))
    pc = new_cache(model)
    pc.store(prompt, [], computed(model, prompt), 0)
    assert pc.lookup(prompt).tokens == 89


def test_a_prompt_leaving_a_cached_block_inside_it_hits_up_to_where_it_leaves():
    model = tiny_model("llama")
    earlier = list(range(1, 97))  # three full blocks
    pc = new_cache(model)
    pc.store(earlier, [], computed(model, earlier), 0)
    edited = earlier[:85] + [250] * 20  # leaves the third block after 21 of its tokens
    lookup = pc.lookup(edited)
    assert (len(lookup.blocks), lookup.part_tokens, lookup.diverged_at) == (2, 21, 85)
    assert continues_as_computed(model, pc, lookup, edited)


def test_after_full_blocks_any_shared_token_counts_and_alone_a_part_needs_the_minimum():
    model = tiny_model("llama")
    earlier = list(range(1, 97))
    pc = new_cache(model)
    pc.store(earlier, [], computed(model, earlier), 0)
    assert pc.lookup(earlier[:66] + [250] * 10).tokens == 66
    assert pc.lookup(earlier[: MIN_PART_TOKENS - 1] + [250] * 10).tokens == 0  # a template's start, say
    assert pc.lookup(earlier[:MIN_PART_TOKENS] + [250] * 10).tokens == MIN_PART_TOKENS


def test_a_cut_hit_keeps_the_part_only_while_the_run_is_whole():
    model = tiny_model("llama")
    turn = list(range(1, 91))
    pc = new_cache(model)
    pc.store(turn, [], computed(model, turn), 0)
    lookup = pc.lookup(turn + [7])
    lookup.cut(80, BLOCK)
    assert (len(lookup.blocks), lookup.part_tokens, lookup.tokens) == (2, 16, 80)
    lookup.cut(40, BLOCK)
    assert (len(lookup.blocks), lookup.part, lookup.tokens) == (1, None, 32)


def test_an_8_bit_part_block_is_quantized_and_continues_closely():
    model = tiny_model("llama")
    turn = list(range(1, 85))  # 20 tokens after the full blocks: groups of 64 (a full block's are 128)
    pc = new_cache(model, kv_bits=8)
    pc.store(turn, [], computed(model, turn), 0)
    lookup = pc.lookup(turn + [5, 6])
    assert lookup.part_tokens == 20 and lookup.part.packed[2] == 64
    rebuilt = pc.rebuild(lookup.blocks, lookup.part, lookup.part_tokens)
    exact = computed(model, turn)
    assert all(mx.abs(r.keys[..., :84, :] - e.keys[..., :84, :]).max().item() < 0.1 for r, e in zip(rebuilt, exact))


def test_a_part_block_on_ssd_serves_a_restart(tmp_path):
    model = tiny_model("llama")
    turn = list(range(1, 91))
    ssd = {"ssd_dir": tmp_path, "ssd_bytes": 2**30, "write_through": True}
    pc = new_cache(model, **ssd)
    pc.store(turn, [], computed(model, turn), 0)
    pc.close()
    restarted = new_cache(model, **ssd)
    restarted.ssd.scanned.wait(5)
    next_turn = turn + [200, 201]
    lookup = restarted.lookup(next_turn)
    assert (len(lookup.blocks), lookup.part_tokens) == (2, 26)
    assert restarted.stats.ssd_hit_tokens == 90
    assert continues_as_computed(model, restarted, lookup, next_turn)
    restarted.close()
