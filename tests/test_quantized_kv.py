"""The running batch's KV at 8 or 4 bits (tierlm/engine/quantized_kv.py), on a
tiny random model: every row of a batch that sequences join, leave and enter
with a cache hit computes what mlx-lm's own single-sequence QuantizedKVCache
computes, with its keys scaled per channel (tierlm/engine/key_scaling.py) or
not; a sequence leaves the batch as plain KV of its tokens; and the
BatchKVCache fields the module reaches into are still there. (The default
model's and Qwen2.5-Coder's answers at 8 bits: tests/test_kv_bits.py.)"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from tierlm.backends.cpu import route
from tierlm.engine import key_scaling
from tierlm.engine.memory_guard import MemoryGuard, profile_model
from tierlm.engine.quantized_kv import QuantizedBatchKVCache, QuantizedSlot, dequantized, quantized_slots, \
    why_not_quantized
from tierlm.models.random_model import TINY, build_model, tiny_model

PROMPTS = [list(range(10, 40)) * 3, [7, 8, 9, 11] * 10, list(range(60, 90)) * 2]
JOINING = [5, 6, 7] * 9  # enters the batch after a few steps
HIT = list(range(100, 170))  # its first 40 tokens come from a "cache hit"


def _model(outliers: bool = False):
    """A tiny Llama whose heads hold 64 values (a group's width); its weights
    scaled up so that greedy answers do not loop on one token. `outliers`: two
    key channels of each layer (a RoPE pair) 30x the others, as Qwen2's are."""
    mx.random.seed(0)
    model = build_model(dict(TINY["llama"], hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=64, vocab_size=512))
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    if outliers:
        for layer in model.layers:
            weight = layer.self_attn.k_proj.weight
            layer.self_attn.k_proj.weight = weight * _channels(5, 37, 30.0)[:, None]
    mx.eval(model.parameters())
    return model


def _channels(a: int, b: int, value: float) -> mx.array:
    """64 ones, channels a and b set to `value`."""
    return mx.where((mx.arange(64) == a) | (mx.arange(64) == b), value, 1.0)


def _scales(model, scaled: bool) -> list | None:
    return key_scaling.calibrate(model, list(range(3, 300))) if scaled else None


def _alone(model, bits: int, prompt: list[int], forced: list[int], hit: int = 0, scales=None) -> list[mx.array]:
    """One sequence through mlx-lm's QuantizedKVCache (a QuantizedSlot, which
    divides the keys by `scales` where given): the log-probabilities before each
    of `forced`; the first `hit` tokens' KV taken from `_hit_slots`."""
    cache = quantized_slots(make_prompt_cache(model), bits, scales)
    if hit:
        for c, slot in zip(cache, _hit_slots(model, bits, scales)):
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


def _hit_slots(model, bits: int, scales=None) -> list[QuantizedSlot]:
    """HIT's first 40 tokens as a hit brings them: computed alone, kept as plain
    KV (as the prefix cache keeps it), quantized again as they enter (which
    moves some scales: a hit's KV is not bit for bit the KV it was made from)."""
    cache = quantized_slots(make_prompt_cache(model), bits, scales)
    mx.eval(model(mx.array([HIT[:40]]), cache=cache))
    return quantized_slots(dequantized(cache), bits, scales)


def _batched(model, bits: int, scales, tail: int = 0):
    """Rows of three lengths (left-padded), one that ends early (the batch is
    filtered), one that joins after four steps (extended) and one that starts
    from a hit, greedy: {uid: (prompt, tokens wanted, hit)}, and each row's
    tokens and log-probabilities. `tail`: decode steps each batch keeps at 16 bits."""
    gen = BatchGenerator(model, prefill_batch_size=8, completion_batch_size=8)
    slots = lambda: quantized_slots(make_prompt_cache(model), bits, scales, tail)  # noqa: E731
    wanted = {}
    for prompt, n in zip(PROMPTS, (20, 6, 20)):
        (uid,) = gen.insert([prompt], max_tokens=[n], caches=[slots()])
        wanted[uid] = (prompt, n, 0)
    hit = _hit_slots(model, bits, scales)
    for slot in hit:
        slot.tail_capacity = tail
    (uid,) = gen.insert([HIT[40:]], max_tokens=[12], caches=[hit], all_tokens=[HIT[:40]])
    wanted[uid] = (HIT, 12, 40)
    tokens, logprobs = {uid: [] for uid in wanted}, {uid: [] for uid in wanted}
    steps = 0
    while any(len(tokens[uid]) < n for uid, (_, n, _) in wanted.items()):
        steps += 1
        if steps == 4:
            (uid,) = gen.insert([JOINING], max_tokens=[10], caches=[slots()])
            wanted[uid] = (JOINING, 10, 0)
            tokens[uid], logprobs[uid] = [], []
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    return wanted, tokens, logprobs


@pytest.mark.parametrize("bits, scaled", [(8, False), (4, False), (8, True)])
def test_each_row_computes_what_mlx_lms_quantized_cache_computes_alone(bits, scaled):
    """Every token and log-probability of every step of every row is the
    sequence's own run through QuantizedKVCache (to the bit, on its own);
    `scaled`: keys divided per channel, on a model with large key channels."""
    model = _model(outliers=scaled)
    scales = _scales(model, scaled)
    wanted, tokens, logprobs = _batched(model, bits, scales)
    assert len(set(tokens[0])) > 3  # not a loop on one token: the rows really differ step by step
    for uid, (prompt, n, hit) in wanted.items():
        reference = _alone(model, bits, prompt, tokens[uid], hit, scales)
        assert [int(mx.argmax(r).item()) for r in reference] == tokens[uid], uid  # greedy: the same tokens
        # the same values; not always the same bits, as tierlm's CPU kernels may stand in for
        # MLX's log-sum-exp in the batch (tierlm.backends.cpu) once a test has loaded a model.
        # Where batching moves a product's last bit, a key or value now and then rounds to the
        # next 8- or 4-bit step: 0.009 at most with OpenBLAS here, against 0.2-0.4 for a row that
        # sees one padded key (its padding off by one when it joins)
        atol = 1e-5 if _batching_keeps_bits() else 0.02
        assert all(mx.allclose(a.reshape(-1), b.reshape(-1), atol=atol) for a, b in zip(logprobs[uid], reference)), uid


def _quantized_with_tail(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention, reading a batch cache's 16-bit tail as the GPU
    kernel does, but quantized first: what a cache without a tail would hold."""
    if getattr(cache, "tail_length", 0):
        start, n = cache._idx - cache.tail_length, cache.tail_length
        tail = cache.unquantized_tail()
        tail_keys = tail[0][..., :n, :] if cache.key_scales is None else cache.key_scales.divide(tail[0][..., :n, :])
        keys, values = ([mx.concatenate([a[..., :start, :], b], axis=2) for a, b in
                         zip(body, mx.quantize(t, group_size=cache.group_size, bits=cache.bits))]
                        for body, t in ((cache.keys, tail_keys), (cache.values, tail[1][..., :n, :])))
        keys = key_scaling.scaled_keys(tuple(keys), cache.key_scales)
        values = tuple(values)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


@pytest.mark.parametrize("bits, scaled", [(8, False), (8, True)])
def test_a_batch_with_a_16_bit_tail_decodes_as_one_without(bits, scaled, monkeypatch):
    """The batch's decode steps held at 16 bits (as on a CUDA GPU), read by an
    attention that quantizes them as it reads (so the answer is comparable):
    every row's tokens and log-probabilities, through joins, leaves and a hit,
    are those of a batch that quantized each step's token at once."""
    import mlx_lm.models.llama as llama

    model = _model(outliers=scaled)
    scales = _scales(model, scaled)
    tails = []

    def attention(queries, keys, values, cache, **kwargs):
        tails.append(getattr(cache, "tail_length", 0))
        return _quantized_with_tail(queries, keys, values, cache, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", attention)
    _, tokens_a, logprobs_a = _batched(model, bits, scales, tail=4)
    assert set(tails) == {0, 1, 2, 3, 4}  # steps read tails of every length, and prefill none
    _, tokens_b, logprobs_b = _batched(model, bits, scales, tail=0)
    assert tokens_a == tokens_b
    assert all(mx.array_equal(a, b).item() for uid in logprobs_a for a, b in zip(logprobs_a[uid], logprobs_b[uid]))


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


def _outlier_keys() -> tuple[mx.array, mx.array, mx.array]:
    """Queries of 4 heads over keys and values of 2 KV heads, 256 tokens; key
    channels 3 and 35 (a RoPE pair) 40x the others in the first head, 8 in the second."""
    q, k, v = (mx.random.normal(shape, key=mx.random.key(i))
               for i, shape in enumerate([(1, 4, 5, 64), (1, 2, 256, 64), (1, 2, 256, 64)]))
    return q, k * mx.stack([_channels(3, 35, 40.0), _channels(3, 35, 8.0)])[None, :, None], v


def test_key_factors_are_per_head_and_channel_tied_within_rope_pairs():
    """Each channel's largest |k| over its head's median channel's, at least 1;
    the channels RoPE rotates together (i, i + 32) share one factor."""
    _, keys, _ = _outlier_keys()
    factors = key_scaling.factors_of(keys).factors
    assert factors.shape == (1, 2, 1, 64)
    assert mx.array_equal(factors[..., :32], factors[..., 32:]) and float(factors.min()) >= 1
    assert 25 < float(factors[0, 0, 0, 3]) < 60 and 4 < float(factors[0, 1, 0, 35]) < 15
    assert float(mx.median(factors[0, 0, 0])) < 1.5  # most channels keep (nearly) their scale


def test_factors_calibrated_on_one_worker_serve_an_engine_on_another():
    """`calibrate` keeps a model's factors for the next engine on it, which may
    run on another worker thread and stream: nothing in them may be a lazy
    array tied to the first thread's stream (MLX: "There is no Stream(cpu, 1)
    in current thread", which failed every step of the second engine)."""
    from tierlm.engine import workers

    model = _model()
    first, second = workers.lend("calibrates"), workers.lend("serves")
    try:
        def on(worker, fn):
            def run_on_its_stream():
                with mx.stream(worker.stream):
                    return fn()
            return worker.submit(run_on_its_stream).result()

        scales = on(first, lambda: key_scaling.calibrate(model, list(range(3, 300))))
        keys = mx.random.normal((1, 1, 4, 64), key=mx.random.key(1))
        mx.eval(keys)
        back = on(second, lambda: mx.eval(out := scales[0].multiply(scales[0].divide(keys)),
                                          scales[0].queries(mx.ones((1, 2, 4, 64)))) or out)
        assert mx.allclose(back, keys, atol=1e-5)
    finally:
        workers.give_back(first)
        workers.give_back(second)


def test_scaled_keys_leave_attention_as_computed_with_a_fraction_of_the_error():
    """8-bit keys divided by their factors, queries multiplied in mlx-lm's own
    quantized attention (`key_scaling.install`): the output is that of the keys
    as computed to within a third of the error of unscaled 8-bit keys, and the
    keys come back multiplied (their small channels within a third of the
    unscaled error). Fails loudly if mlx-lm's attention stops going through the
    function `install` wraps (the queries would not be multiplied)."""
    q, k, v = _outlier_keys()
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    errors, key_errors = {}, {}
    for scaled in (False, True):
        scales = key_scaling.factors_of(k) if scaled else None
        cache = QuantizedSlot.merge([QuantizedSlot.of(None, 8, scales)])
        qk, qv = cache.update_and_fetch(k, v)
        # a copy of the queries: mlx-lm's quantized attention scales its queries in place
        out = base.scaled_dot_product_attention(mx.array(q), qk, qv, cache=cache, scale=0.125, mask=None)
        errors[scaled] = float(mx.abs(out - exact).max())
        back = dequantized([cache.extract(0)])[0].keys
        small = _channels(3, 35, 0.0) == 1  # every channel but the large pair
        key_errors[scaled] = float(mx.abs(mx.where(small, back - k, 0)).max())
    assert errors[True] < errors[False] / 3, errors
    assert key_errors[True] < key_errors[False] / 3, key_errors


def _tokens(n: int, seed: int, rows: int = 2) -> mx.array:
    return mx.random.normal((rows, 2, n, 64), key=mx.random.key(seed))


def _batch(lengths: list[int], seed: int, tail: int, scales) -> QuantizedBatchKVCache:
    slots = []
    for i, n in enumerate(lengths):
        plain = KVCache()
        plain.update_and_fetch(_tokens(n, seed + i, 1), _tokens(n, seed + 50 + i, 1))
        slots.append(QuantizedSlot.of(plain, 8, scales))
    batch = QuantizedSlot.merge(slots)
    batch.tail_capacity = tail
    return batch


def _steps(cache, seed: int, n: int) -> None:
    for i in range(n):
        rows = cache.offset.shape[0]
        cache.update_and_fetch(_tokens(1, seed + i, rows), _tokens(1, seed + 100 + i, rows))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled-keys"])
def test_a_tail_of_16_bit_decode_steps_ends_as_quantizing_each_step_would(scaled):
    """On a CUDA GPU a decode step's token waits at 16 bits in the batch
    cache's tail (its kernel reads it there) and is quantized with the rest
    when the tail fills, the batch changes or a reader of the buffers comes:
    the buffers then hold, bit for bit, what quantizing each step's token
    at once holds. The same steps, joins, trims and leaves through a cache
    with a tail of 4 and one with none, on any device."""
    scales = key_scaling.KeyScales(mx.where(mx.arange(64) < 2, 4.0, 1.0)[None, None, None] * mx.ones((1, 2, 1, 1))) \
        if scaled else None
    caches = []
    for tail in (4, 0):
        cache = _batch([5, 9], seed=0, tail=tail, scales=scales)
        _steps(cache, 10, 6)  # the tail fills once
        if tail:
            keys, values, start = cache.unquantized_tail()
            assert cache.tail_length == 2 and start.item() == cache._idx - 2 == 13
            assert mx.array_equal(keys[..., 1:2, :], _tokens(1, 15)).item()  # kept as computed
            assert cache.nbytes > _batch([5, 9], 0, 0, scales).nbytes  # the tail's bytes count
        cache.trim(1)  # a step given back
        _steps(cache, 20, 3)
        other = _batch([12], seed=5, tail=tail, scales=scales)
        _steps(other, 30, 2)
        cache.extend(other)  # a sequence joins
        _steps(cache, 40, 3)
        cache.filter([0, 2])  # one leaves
        _steps(cache, 50, 2)
        caches.append((cache, cache.extract(1)))
        if tail:
            assert cache.tail_length == 0 and cache.unquantized_tail() is None  # extract read the buffers
    (with_tail, slot_a), (without, slot_b) = caches
    assert (with_tail._idx, with_tail.offset.tolist(), with_tail.left_padding.tolist()) == \
        (without._idx, without.offset.tolist(), without.left_padding.tolist())
    for a, b in zip(with_tail.keys + with_tail.values, without.keys + without.values):
        assert mx.array_equal(a[..., : without._idx, :], b[..., : without._idx, :]).item()
    for a, b in zip(slot_a.keys + slot_a.values, slot_b.keys + slot_b.values):
        assert mx.array_equal(a, b).item()


def test_the_memory_estimate_counts_a_decoding_sequences_16_bit_tail():
    """Where the batch keeps a tail of decode steps at 16 bits (a CUDA GPU), a
    decoding sequence holds it beside its quantized KV: the guard reserves it."""
    model = _model()
    plain, quantized = profile_model(model), profile_model(model, 8, kv_tail=64)
    assert quantized.tail_bytes == 64 * plain.kv_bytes_per_token > 0
    assert profile_model(model, 8).tail_bytes == 0 and plain.tail_bytes == 0
    guard = MemoryGuard(quantized, limit=2**30, prefill_step=512)
    assert guard.decode_bytes(10) == 10 * quantized.kv_bytes_per_token + quantized.tail_bytes
    assert guard.decode_bytes(0) == 0


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
