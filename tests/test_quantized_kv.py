"""The running batch's KV at 8 or 4 bits (tierlm/engine/quantized_kv.py), on a
tiny random model: every row of a batch that sequences join, leave and enter
with a cache hit computes what mlx-lm's own single-sequence QuantizedKVCache
computes; a sequence leaves the batch as plain KV of its tokens;
and the BatchKVCache fields the module reaches into are still there.
(The default model's answers at 8 bits: tests/test_kv_bits.py.)"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from tierlm.backends.cpu import route
from tierlm.engine.quantized_kv import QuantizedBatchKVCache, QuantizedSlot, dequantized, quantized_slots, \
    why_not_quantized
from tierlm.models.random_model import TINY, build_model, tiny_model

PROMPTS = [list(range(10, 40)) * 3, [7, 8, 9, 11] * 10, list(range(60, 90)) * 2]
JOINING = [5, 6, 7] * 9  # enters the batch after a few steps
HIT = list(range(100, 170))  # its first 40 tokens come from a "cache hit"


def _model():
    """A tiny Llama whose heads hold 64 values (a group's width); its weights
    scaled up so that greedy answers do not loop on one token."""
    mx.random.seed(0)
    model = build_model(dict(TINY["llama"], hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, vocab_size=512))
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def _alone(model, bits: int, prompt: list[int], forced: list[int], hit: int = 0) -> list[mx.array]:
    """mlx-lm's QuantizedKVCache, one sequence: the log-probabilities before each
    of `forced`; the first `hit` tokens' KV taken from `_hit_slots`."""
    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    if hit:
        for c, slot in zip(cache, _hit_slots(model, bits)):
            c.keys, c.values, c.offset = slot.keys, slot.values, slot.offset
    logits = model(mx.array([prompt[hit:]]), cache=cache)[:, -1]
    out = []
    for token in forced:
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return out


def _batching_keeps_bits() -> bool:
    """Whether the tiny model's float32 products have the same bits for a row
    alone and batched in this process: so with MLX's bundled BLAS (before any
    test loads a model) and with the CPU fast path's exact products (AVX-512;
    the tiny model's products are all small enough for them), not with
    OpenBLAS's gemv against its gemm (the fast path without AVX-512, or
    TIERLM_MAX_CPU_ISA=avx2)."""
    state = route.current()
    return state is None or not state.blas.on or state.exact_attention.on


def _hit_slots(model, bits: int) -> list[QuantizedSlot]:
    """HIT's first 40 tokens as a hit brings them: computed alone, kept as plain
    KV (as the prefix cache keeps it), quantized again as they enter (which
    moves some scales: a hit's KV is not bit for bit the KV it was made from)."""
    cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    mx.eval(model(mx.array([HIT[:40]]), cache=cache))
    slots = []
    for c in cache:
        slot = QuantizedSlot(group_size=64, bits=bits)
        slot.keys, slot.values, slot.offset = c.keys, c.values, c.offset
        slots.append(slot)
    return quantized_slots(dequantized(slots), bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_each_row_computes_what_mlx_lms_quantized_cache_computes_alone(bits):
    """Rows of three lengths (left-padded), one that ends early (the batch is
    filtered), one that joins after four steps (extended) and one that starts
    from a hit: every token and log-probability of every step is the
    sequence's own run through QuantizedKVCache (to the bit, on its own)."""
    model = _model()
    gen = BatchGenerator(model, prefill_batch_size=8, completion_batch_size=8)
    wanted = {}
    for prompt, n in zip(PROMPTS, (20, 6, 20)):
        (uid,) = gen.insert([prompt], max_tokens=[n], caches=[quantized_slots(make_prompt_cache(model), bits)])
        wanted[uid] = (prompt, n, 0)
    (uid,) = gen.insert([HIT[40:]], max_tokens=[12], caches=[_hit_slots(model, bits)], all_tokens=[HIT[:40]])
    wanted[uid] = (HIT, 12, 40)
    tokens, logprobs = {uid: [] for uid in wanted}, {uid: [] for uid in wanted}
    steps = 0
    while any(len(tokens[uid]) < n for uid, (_, n, _) in wanted.items()):
        steps += 1
        if steps == 4:
            (uid,) = gen.insert([JOINING], max_tokens=[10], caches=[quantized_slots(make_prompt_cache(model), bits)])
            wanted[uid] = (JOINING, 10, 0)
            tokens[uid], logprobs[uid] = [], []
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    assert len(set(tokens[0])) > 3  # not a loop on one token: the rows really differ step by step
    for uid, (prompt, n, hit) in wanted.items():
        reference = _alone(model, bits, prompt, tokens[uid], hit)
        assert [int(mx.argmax(r).item()) for r in reference] == tokens[uid], uid  # greedy: the same tokens
        # the same values; not always the same bits, as tierlm's CPU kernels may stand in for
        # MLX's log-sum-exp in the batch (tierlm.backends.cpu) once a test has loaded a model.
        # Where batching moves a product's last bit, a key or value now and then rounds to the
        # next 8- or 4-bit step: 0.009 at most with OpenBLAS here, against 0.2-0.4 for a row that
        # sees one padded key (its padding off by one when it joins)
        atol = 1e-5 if _batching_keeps_bits() else 0.02
        assert all(mx.allclose(a.reshape(-1), b.reshape(-1), atol=atol) for a, b in zip(logprobs[uid], reference)), uid


def test_a_sequence_leaves_the_batch_as_plain_kv_close_to_its_16_bit_kv():
    """Extracted after its prompt: a QuantizedSlot of the prompt's tokens; as the
    prefix cache stores it, a KVCache whose values are within a quantization step
    of those a 16-bit batch computed."""
    model = _model()
    extracted = {}
    for bits in (8, 16):
        gen = BatchGenerator(model, prefill_batch_size=8, completion_batch_size=8)
        caches = [quantized_slots(make_prompt_cache(model), bits) for _ in PROMPTS] if bits != 16 else None
        uids = gen.insert(PROMPTS, max_tokens=[4] * 3, caches=caches)
        gen.next()
        extracted[bits] = gen.extract_cache(uids[1:2])[uids[1]]
    quantized, tokens = extracted[8]
    assert all(isinstance(c, QuantizedSlot) and c.offset == len(tokens) for c in quantized)
    plain = dequantized(quantized)
    assert all(type(c) is KVCache and c.keys.shape[2] == c.offset == len(tokens) for c in plain)
    for q, full in zip(plain, extracted[16][0]):
        step = (full.keys.max() - full.keys.min()) / 255
        assert float(mx.abs(q.keys - full.keys[..., : q.offset, :]).max()) < 4 * float(step)


def test_the_batch_keeps_fewer_bytes_and_names_its_bits():
    """8-bit KV with float32 scales (the CPU's KV dtype): 3.5x fewer bytes than
    float32's; `bits` is what sends mlx-lm's attention to its quantized path."""
    keys = mx.random.normal((1, 2, 300, 64), key=mx.random.key(0))
    plain, quantized = BatchKVCache([0]), QuantizedSlot.merge([QuantizedSlot.of(None, 8)])
    for cache in (plain, quantized):
        cache.update_and_fetch(keys, keys)
    assert quantized.bits == 8 and not hasattr(plain, "bits")
    assert plain.nbytes / quantized.nbytes >= 3.5


def test_models_whose_kv_cannot_be_quantized_say_why():
    assert why_not_quantized(_model()) is None
    assert "multiple of 64" in why_not_quantized(tiny_model("llama"))  # heads of 16 values
    assert "multiple of 64" in why_not_quantized(tiny_model("gemma3_text"))


def test_the_fields_of_mlx_lms_batch_cache_this_module_reaches_into_are_there():
    """QuantizedBatchKVCache mirrors BatchKVCache over three arrays: it relies on
    its fields and on `prepare` recording right padding for `finalize`."""
    cache = BatchKVCache([1, 0])
    for name in ("keys", "values", "offset", "left_padding", "_idx", "_right_padding", "step"):
        assert hasattr(cache, name), name
    cache.prepare(right_padding=[0, 2], lengths=[3, 1])
    assert cache._right_padding.tolist() == [0, 2]
    assert isinstance(QuantizedBatchKVCache([0], 8), BatchKVCache)  # make_mask, prepare, trim: inherited
