"""EngineCore in-process: collectors, decode bursts, abort races, the error path."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import pytest
from engine_testing import request, run, started

from tierlm.config import Settings
from tierlm.engine import ownership, warmup
from tierlm.engine.collector import OutputCollector
from tierlm.engine.core import EngineCore
from tierlm.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from tierlm.models.random_model import tiny_model


async def eventually(condition, timeout: float = 30.0) -> None:
    """Wait for `condition()` (checked on the event loop) to hold; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)


async def abort_on_the_worker(engine, request_id: str, when, timeout: float = 60.0) -> None:
    """Abort `request_id` at the first check between two bursts (on the worker
    thread) where `when()` holds: no step runs between the check and the abort.
    With decode bursts off a burst is one step, and a check is queued behind at
    most the running burst and the one queued ahead of it, so it sees every
    state that lasts a few steps, however fast the machine steps."""

    def check() -> bool:
        if not when():
            return False
        engine.scheduler.abort(request_id)
        return True

    deadline = time.monotonic() + timeout
    while not await engine.on_worker(check):
        if time.monotonic() > deadline:
            pytest.fail(f"the state to abort in was not seen within {timeout}s")



# ---- collectors -------------------------------------------------------------


def out(n_tokens_so_far: int, text: str, finished=False) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=[0], completion_tokens=n_tokens_so_far,
                         finished=finished, finish_reason=FinishReason.STOP if finished else None)


def test_collector_merges_outputs_when_the_reader_lags():
    async def go():
        c = OutputCollector()
        for i, piece in enumerate(["a", "b", "c"], start=1):
            c.put(out(i, piece))
        merged = await c.get()
        assert (merged.text, merged.token_ids, merged.completion_tokens) == ("abc", [0, 0, 0], 3)
        assert await c.get(timeout=0.05) is None  # nothing left: a keep-alive tick

    run(go())


def test_collector_stream_interval_wakes_first_token_then_every_n():
    async def go():
        c = OutputCollector(stream_interval=3)
        c.put(out(1, "a"))
        assert (await c.get(timeout=0.05)).text == "a"  # the first token goes out at once
        c.put(out(2, "b"))
        c.put(out(3, "c"))
        assert await c.get(timeout=0.05) is None  # 2 < 3 pending tokens: not yet
        c.put(out(4, "d"))
        assert (await c.get(timeout=0.05)).text == "bcd"
        c.put(out(5, "e", finished=True))
        assert (await c.get(timeout=0.05)).finished  # a finish always wakes

    run(go())


def test_collector_reader_that_times_out_or_is_cancelled_leaves_it_working():
    """A keep-alive tick or a cancelled reader (a client gone) leaves no waiter
    behind: the next output still reaches the next reader, once."""

    async def go():
        c = OutputCollector()
        assert await c.get(timeout=0.01) is None and not c.reading
        reader = asyncio.ensure_future(c.get())
        await asyncio.sleep(0.01)
        assert c.reading
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert not c.reading
        c.put(out(1, "a"))
        assert (await c.get(timeout=1)).text == "a"
        waiting = asyncio.ensure_future(c.get(timeout=5))
        await asyncio.sleep(0.01)
        c.put(out(2, "b", finished=True))
        assert (await waiting).text == "b" and c.finished

    run(go())


# ---- bursts -----------------------------------------------------------------


def generate_once(loaded, max_tokens: int, ignore_eos: bool = False, **config):
    """One request through a fresh engine: (its output, the engine's stats)."""

    async def go():
        engine = await started(loaded, **config)
        result = await engine.generate(request(loaded, engine, max_tokens=max_tokens, ignore_eos=ignore_eos))
        stats = engine.get_stats()
        await engine.close()
        return result, stats

    return run(go())


def test_decode_burst_runs_several_steps_per_hand_off(loaded):
    result, stats = generate_once(loaded, 12, ignore_eos=True, decode_burst_ms=5000)
    assert result.completion_tokens == 12
    assert stats["steps"] > stats["bursts"]


def test_decode_burst_off_runs_one_step_per_hand_off(loaded):
    result, stats = generate_once(loaded, 6, ignore_eos=True, decode_burst_ms=0, decode_burst_ms_batched=0)
    assert result.completion_tokens == 6
    assert stats["steps"] == stats["bursts"]


def test_burst_budget_grows_with_the_batch_up_to_the_single_stream_budget():
    budget = EngineCore("x", lambda: None, Settings(decode_burst_ms=100, decode_burst_ms_batched=20))
    assert [budget.burst_budget_ms(n) for n in (1, 2, 8, 16, 32, 64)] == [100, 20, 20, 40, 80, 100]
    off = EngineCore("x", lambda: None, Settings(decode_burst_ms=0, decode_burst_ms_batched=0))
    assert off.burst_budget_ms(1) == off.burst_budget_ms(32) == 0


def stream_pieces(loaded, monkeypatch, **config):
    """One 12-token request streamed through a fresh engine: (the pieces its reader
    got, the outputs the engine handed to its collector, the stats). A reader that
    lags gets several hand-offs merged into one piece (OutputCollector), so what is
    counted is the hand-offs, however fast the machine."""
    handed = []
    put = OutputCollector.put

    def counting_put(self, output):
        handed.append(output.completion_tokens)
        put(self, output)

    async def go():
        engine = await started(loaded, **config)
        pieces = [o async for o in engine.stream_outputs(request(loaded, engine, max_tokens=12, ignore_eos=True))
                  if o is not None]
        stats = engine.get_stats()
        await engine.close()
        return pieces, handed, stats

    with monkeypatch.context() as patch:
        patch.setattr(OutputCollector, "put", counting_put)
        return run(go())


def test_tokens_stream_out_during_a_burst(loaded, monkeypatch):
    """A burst long enough for the whole answer still hands its tokens out as they
    are made, in order; a flush interval longer than the burst holds them to its end."""
    pieces, handed, stats = stream_pieces(loaded, monkeypatch, decode_burst_ms=60_000, stream_flush_ms=0)
    assert stats["bursts"] <= 3  # the first token and the finish end a burst
    assert len(handed) >= 8 and sum(len(p.token_ids) for p in pieces) == 12
    assert handed == sorted(set(handed))
    assert [p.completion_tokens for p in pieces] == sorted({p.completion_tokens for p in pieces})
    held, held_handed, _ = stream_pieces(loaded, monkeypatch, decode_burst_ms=60_000, stream_flush_ms=60_000)
    assert len(held_handed) <= 3 and "".join(p.text for p in held) == "".join(p.text for p in pieces)


def test_flush_interval_grows_with_the_batch():
    engine = EngineCore("x", lambda: None, Settings(stream_flush_ms=2))
    assert [engine.flush_interval_ms(n) for n in (1, 4, 8, 32)] == [2, 2, 4, 16]


def test_warm_batch_sizes_cover_each_power_of_two_and_the_size_after():
    assert warmup.batch_sizes(1) == [1]
    assert warmup.batch_sizes(8) == [1, 2, 3, 4, 5, 8]
    assert warmup.batch_sizes(32) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32]
    W = warmup.WarmJob
    requests = W(2, warmup.SHORT_REQUEST, requests=True)  # then requests, their cache their own
    assert warmup.warm_shapes(2, compiles=False) == [W(1, warmup.LONG_PROMPT), W(1, warmup.SHORT_PROMPT),
                                                     W(2, warmup.SHORT_PROMPT), requests]
    # where kernels compile per shape (a GPU), a full batch of long prompts, then requests, the linear
    # layers at each width of a prefill chunk, and one long context
    gpu_jobs = warmup.warm_shapes(2, compiles=True)
    assert W(2, warmup.LONG_PROMPT) in gpu_jobs
    assert gpu_jobs[gpu_jobs.index(W(2, warmup.LONG_PROMPT, requests=True)) + 1] == W(1, 2048, widths=True)
    assert warmup.warm_shapes(2, compiles=True, long_context=8192)[-1] == W(1, 8192)
    # and, where kernels compile, a prompt of each length cuDNN's attention sees (but the long prompt's)
    buckets = warmup.bucket_lengths(2048)
    assert buckets == [384, 512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert gpu_jobs[-len(buckets) + 1:] == [W(1, n) for n in buckets if n != 512]
    assert warmup.warm_shapes(2, compiles=False, long_context=8192)[-1] == requests
    assert W(warmup.REQUEST_ROWS, warmup.LONG_PROMPT, True) in warmup.warm_shapes(32, compiles=True)


def test_linear_widths_cover_every_count_of_a_block_then_each_step_of_sixteen():
    widths = warmup.linear_widths(2048)
    assert widths[:warmup.EVERY_WIDTH] == list(range(1, warmup.EVERY_WIDTH + 1))
    assert widths[warmup.EVERY_WIDTH:warmup.EVERY_WIDTH + 4] == [257, 272, 273, 288]
    assert widths[-3:] == [2032, 2033, 2048]
    assert warmup.linear_widths(100) == list(range(1, 101))


def test_the_warm_next_turn_is_long_enough_for_a_gpu_remainder_to_run_its_kernel():
    from tierlm.backends import gpu

    assert len(warmup.NEXT_TURN) >= gpu.PAD_FROM_QUERIES


def test_run_widths_runs_each_kind_of_linear_layer_of_the_model_at_each_width(loaded, monkeypatch):
    """The default model (4-bit): its attention's square projections are one
    kind, the keys' and values' another, the MLP's gate and up a third, its
    down a fourth; each runs once a width, on the activations' type."""
    model = loaded[0]
    kinds = warmup.distinct_linears(model)
    assert len(kinds) == 4
    assert sorted(inputs for _, inputs, _ in kinds) == sorted([model.args.hidden_size] * 3
                                                             + [model.args.intermediate_size])
    seen = []
    for cls in {type(layer) for layer, _, _ in kinds}:
        original = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, x, original=original: seen.append(
            (id(self), x.shape, x.dtype)) or original(self, x))
    assert warmup.run_widths(model, mx.default_stream(mx.default_device()), 4) > 0
    assert sorted(seen) == sorted((id(layer), (1, w, inputs), dtype) for layer, inputs, dtype in kinds
                                  for w in range(1, 5))


def test_the_long_warm_prompt_keeps_within_the_context_and_the_memory_in_whole_chunks():
    assert warmup.long_context_tokens(None, 2048, lambda n: True) == warmup.LONG_CONTEXT
    assert warmup.long_context_tokens(8192 + 100, 2048, lambda n: True) == 8192
    assert warmup.long_context_tokens(None, 2048, lambda n: n <= 10000) == 8192  # 65536 to 16384 do not fit
    assert warmup.long_context_tokens(None, 2048, lambda n: False) == 0


@pytest.mark.slow  # warms every batch shape
def test_warming_runs_while_idle_and_leaves_the_cache_and_answers_alone(loaded):
    """Warming on (as on a GPU): each shape runs, a request sent meanwhile gets the
    same answer as on an engine that never warmed, and no warm prompt is cached."""

    async def answer_and_blocks(**config):
        engine = await started(loaded, **config)
        jobs = engine.shapes_to_warm
        answer = await engine.generate(request(loaded, engine, max_tokens=8))
        await eventually(lambda: not engine.warming)
        blocks = (await engine.cache_stats())["stored_blocks"]
        await engine.close()
        return jobs, answer.text, blocks

    cold_jobs, expected, cold_blocks = run(answer_and_blocks(warmup=False))
    jobs, text, blocks = run(answer_and_blocks(warmup=True, warmup_wait_s=0, max_concurrent_requests=4))
    assert cold_jobs == [] and jobs == warmup.warm_shapes(4)
    assert text == expected and blocks == cold_blocks


def test_a_requests_warm_job_stores_and_hits_in_a_cache_of_its_own(loaded):
    """The requests job's second wave finds the first wave's blocks, in a cache
    that is not the engine's: the engine's stores and finds nothing of it, and
    the engine serves the same answer after it."""

    async def go():
        engine = await started(loaded, cache_block_size=64)  # the job's CPU prompts (160, 80 tokens) hold blocks
        before = await engine.generate(request(loaded, engine, max_tokens=8))
        engine_stats = await engine.cache_stats()
        scratch = []

        def new_scheduler():
            scratch.append(engine._scratch_scheduler(engine.scheduler))
            return scratch[-1]

        await engine.on_worker(lambda: warmup.run_requests(new_scheduler, 2, warmup.SHORT_REQUEST))
        after = await engine.generate(request(loaded, engine, max_tokens=8))
        stats = (scratch[0].cache.snapshot_stats(), engine_stats, await engine.cache_stats())
        await engine.close()
        return before.text, after.text, stats

    before, after, (warm, engine_before, engine_after) = run(go())
    assert warm["stored_blocks"] >= 3  # the first wave's: two blocks of 160 tokens and one of 80
    assert warm["hit_tokens"] >= 3 * 64  # the next turns found them
    assert engine_after["stored_blocks"] == engine_before["stored_blocks"]
    # the second request's hit is the first one's KV as it was kept (engine/last_sequence.py)
    assert engine_after["hit_tokens"] - engine_before["hit_tokens"] == engine_after["kept_hit_tokens"] > 0
    assert after == before


@pytest.mark.slow  # warms batch shapes
def test_warming_before_ready_within_its_wait(loaded):
    """With time enough, every shape is warm when the engine reports ready."""

    async def go():
        engine = await started(loaded, warmup=True, warmup_wait_s=120, max_concurrent_requests=3)
        warming, stats = engine.warming, engine.get_stats()["warmup"]
        await engine.close()
        return warming, stats

    warming, stats = run(go())
    assert not warming and stats["shapes_left"] == 0 and stats["seconds"] > 0


def test_burst_and_no_burst_give_the_same_text(loaded):
    with_burst, _ = generate_once(loaded, 10, decode_burst_ms=5000)
    without, _ = generate_once(loaded, 10, decode_burst_ms=0)
    assert with_burst.text == without.text


# ---- aborts -----------------------------------------------------------------


def test_abort_races(loaded):
    async def go():
        engine = await started(loaded)
        # 1. aborted before the worker ever saw it
        r1 = request(loaded, engine, max_tokens=50)
        c1 = engine.add_request(r1)
        engine.abort_request(r1.request_id)
        o1 = await c1.get()
        # 2. aborted while running, twice; far from its end (one burst is 100 ms)
        r2 = request(loaded, engine, max_tokens=2000, ignore_eos=True)
        c2 = engine.add_request(r2)
        first = await c2.get()
        engine.abort_request(r2.request_id)
        engine.abort_request(r2.request_id)
        rest = await c2.get()
        streamed = len(first.token_ids) + len(rest.token_ids)
        while not rest.finished:
            rest = await c2.get()
            streamed += len(rest.token_ids)
        # 3. aborted after it finished: a no-op
        r3 = request(loaded, engine, max_tokens=3)
        o3 = await engine.generate(r3)
        engine.abort_request(r3.request_id)
        # 4. an unknown id
        engine.abort_request("never-existed")
        after = await engine.generate(request(loaded, engine, max_tokens=3))
        await eventually(lambda: not engine.scheduler.has_work())  # the last two aborts were applied
        stats = engine.get_stats()
        await engine.close()
        return o1, first, rest, streamed, o3, after, stats

    o1, first, rest, streamed, o3, after, stats = run(go())
    assert o1.finished and o1.finish_reason == FinishReason.ABORT and o1.completion_tokens == 0
    assert first.completion_tokens >= 1 and not first.finished
    assert rest.finish_reason == FinishReason.ABORT and rest.completion_tokens < 2000
    assert streamed == rest.completion_tokens  # tokens of the aborted burst still reach the stream
    assert o3.finish_reason == FinishReason.LENGTH
    assert after.completion_tokens == 3
    assert (stats["running"], stats["waiting"], stats["aborted_requests"]) == (0, 0, 2)


def test_leaving_a_stream_early_aborts_the_request(loaded):
    async def go():
        engine = await started(loaded)
        stream = engine.stream_outputs(request(loaded, engine, max_tokens=2000, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        await eventually(lambda: engine.get_stats()["aborted_requests"] == 1)
        stats = engine.get_stats()
        await engine.close()
        return stats

    stats = run(go())
    assert stats["aborted_requests"] == 1 and stats["running"] == 0


# ---- ownership --------------------------------------------------------------


def test_two_engines_cannot_drive_one_model(loaded):
    async def go():
        first = await started(loaded)
        second = EngineCore("intruder", lambda: loaded, Settings(ssd_cache=False))
        with pytest.raises(ownership.ModelAlreadyOwned):
            await second.start()
        await first.close()
        # once released, another engine may take it
        third = await started(loaded)
        await third.close()

    run(go())


# ---- the prefix cache under aborts -------------------------------------------


@pytest.mark.slow  # a long prefill
def test_abort_during_prefill_stores_only_what_was_computed(loaded):
    # 769 tokens: 6 chunks of 128, 12 blocks of 64
    long_prompt = loaded[1].encode("The history of the printing press and its effects on Europe. " * 64)

    async def go():
        engine = await started(loaded, prefill_step_size=128, cache_block_size=64,
                               decode_burst_ms=0, decode_burst_ms_batched=0)
        req = Request(engine.new_request_id(), long_prompt, SamplingParams(max_tokens=5, temperature=0))
        collector = engine.add_request(req)
        cache = engine.scheduler.cache
        # some of its 6 chunks are done, the prefill is not (the abort lands at most two
        # chunks after the first: at most 6 of its 12 blocks)
        await abort_on_the_worker(engine, req.request_id, lambda: len(cache.hot) >= 2)
        aborted = await collector.get()
        while not aborted.finished:
            aborted = await collector.get()
        stored = await engine.on_worker(lambda: len(cache.hot))
        again = await engine.generate(Request(engine.new_request_id(), long_prompt,
                                              SamplingParams(max_tokens=5, temperature=0)))
        await engine.close()
        uncached = await started(loaded, prefix_cache=False)
        reference = await uncached.generate(Request(uncached.new_request_id(), long_prompt,
                                                    SamplingParams(max_tokens=5, temperature=0)))
        await uncached.close()
        return aborted, stored, again, reference

    aborted, stored, again, reference = run(go())
    assert aborted.finish_reason == FinishReason.ABORT and aborted.completion_tokens == 0
    assert 2 <= stored < len(long_prompt) // 64  # whole chunks only, not the whole prompt
    assert again.cached_tokens == stored * 64  # exactly the stored chain, verified token by token
    assert again.text == reference.text


def test_requests_waiting_for_a_prefix_in_flight_take_it_from_the_cache(loaded):
    """B and C share A's long prefix and wait while A computes it (looked up again
    every step, from their remembered block keys); C is aborted while it waits.
    B then takes the prefix from the cache, and nothing is left remembered."""
    prefix = loaded[1].encode("The history of the printing press and its effects on Europe. " * 40)

    async def go():
        engine = await started(loaded, prefill_step_size=64, cache_block_size=64,
                               decode_burst_ms=0, decode_burst_ms_batched=0)
        params = SamplingParams(max_tokens=3, temperature=0)
        a, b, c = (Request(engine.new_request_id(), prefix + [100 + i], params) for i in range(3))
        ca, cb, cc = engine.add_request(a), engine.add_request(b), engine.add_request(c)
        waiting = engine.scheduler.waiting_for_prefix
        # A prefills 8 chunks, one a step; B and C wait all along: C is aborted while it waits
        await abort_on_the_worker(engine, c.request_id, lambda: waiting() == 2)
        outputs = []
        for collector in (ca, cb, cc):
            out = await collector.get()
            while not out.finished:
                out = out.merge(await collector.get())
            outputs.append(out)
        left = await engine.on_worker(waiting)
        await engine.close()
        return outputs, left

    (out_a, out_b, out_c), left = run(go())
    assert out_a.cached_tokens == 0 and out_a.finish_reason == FinishReason.LENGTH
    assert out_b.cached_tokens == len(prefix) // 64 * 64 and out_b.finish_reason == FinishReason.LENGTH
    assert out_c.finish_reason == FinishReason.ABORT
    assert left == 0


def whole_blocks_prompt(loaded) -> list[int]:
    """4 blocks of 64 tokens exactly."""
    return loaded[1].encode("The history of the printing press and its effects on Europe. " * 40)[:256]


@pytest.mark.slow  # long prompts, an edge of the cache
def test_a_block_ending_with_the_prompt_does_not_hold_up_requests_extending_it(loaded):
    """A's prompt is exactly 4 blocks; its last block only exists once decoding has
    begun. B, which extends A's prompt, waits for A's prefill but not for A's whole
    generation: it takes the 3 blocks A's prefill stored and the part block of its
    next 63 tokens, and computes the rest."""
    prompt = whole_blocks_prompt(loaded)

    async def go():
        engine = await started(loaded, prefill_step_size=64, cache_block_size=64)
        finished = []

        async def generate(tokens, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            out = await engine.generate(Request(engine.new_request_id(), tokens, params))
            finished.append(out.request_id)
            return out

        a = asyncio.create_task(generate(prompt, 40))
        b = asyncio.create_task(generate(prompt + [100, 101, 102], 2))
        out_a, out_b = await a, await b
        await engine.close()
        return out_a, out_b, finished

    out_a, out_b, finished = run(go())
    assert out_a.cached_tokens == 0 and len(out_a.token_ids) == 40
    assert out_b.cached_tokens == 4 * 64 - 1  # A's prefill, without its last token
    assert finished.index(out_b.request_id) < finished.index(out_a.request_id)


@pytest.mark.slow  # long prompts, an edge of the cache
@pytest.mark.parametrize("ending", ["finished", "aborted"])
def test_a_block_ending_with_the_prompt_is_stored_when_the_request_ends(loaded, ending):
    """The block ending at A's last prompt token is stored with A's whole cache when
    A ends, also when it is aborted while decoding (a client that stops and asks
    again): C, extending A's prompt, finds all 4 blocks."""
    prompt = whole_blocks_prompt(loaded)

    async def go():
        engine = await started(loaded, prefill_step_size=64, cache_block_size=64)
        params = SamplingParams(max_tokens=8 if ending == "finished" else 4000, temperature=0, ignore_eos=True)
        a = Request(engine.new_request_id(), prompt, params)
        collector = engine.add_request(a)
        out = await collector.get()
        if ending == "aborted":
            assert out.token_ids and not out.finished  # decoding, far from its end
            engine.abort_request(a.request_id)
        while not out.finished:
            out = out.merge(await collector.get())
        c = await engine.generate(Request(engine.new_request_id(), prompt + [200, 201],
                                          SamplingParams(max_tokens=2, temperature=0)))
        await engine.close()
        return out, c

    out_a, out_c = run(go())
    assert out_a.finish_reason == (FinishReason.LENGTH if ending == "finished" else FinishReason.ABORT)
    assert out_c.cached_tokens == 4 * 64


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_a_prompt_of_whole_blocks_within_a_chunk_is_stored_for_every_cache_type(name, tokenizer):
    """A prompt of two whole blocks that fits a chunk: sliced KV folds it and
    stores its blocks after its first step; sliding-window and recurrent caches
    store the snapshot of its last block where their prompt ends. Either way
    the same prompt extended hits both blocks and answers as uncached."""
    model = tiny_model(name, vocab_size=len(tokenizer.vocab))
    prompt = list(range(1000, 1032))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def go(**config):
        engine = EngineCore(f"{name}-{config}", lambda: (model, tokenizer), Settings(ssd_cache=False, **config))
        await engine.start()
        outs = [await engine.generate(Request(engine.new_request_id(), p, params)) for p in (prompt, prompt + [7, 8])]
        await engine.close()
        return outs

    cached = run(go(cache_block_size=16, prefill_step_size=64))
    plain = run(go(prefix_cache=False))
    assert [o.error for o in cached] == [None, None]
    assert cached[1].cached_tokens == 32
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_prefix_cache_through_the_scheduler_for_every_cache_type(name, tokenizer):
    """Full hits, partial hits and batched hits give exactly the tokens of an
    uncached engine, for sliced KV, sliding-window and recurrent caches alike."""
    model = tiny_model(name, vocab_size=len(tokenizer.vocab))
    prompt = list(range(1000, 1100))
    variants = [prompt, prompt, prompt[:90] + [5, 6, 7]] + [prompt[:70] + [k, k + 1] for k in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def go(**config):
        engine = EngineCore(f"{name}-{config}", lambda: (model, tokenizer), Settings(ssd_cache=False, **config))
        await engine.start()
        first = [await engine.generate(Request(engine.new_request_id(), p, params)) for p in variants[:3]]
        batched = await asyncio.gather(*[engine.generate(Request(engine.new_request_id(), p, params))
                                         for p in variants[3:]])
        await engine.close()
        return first + list(batched)

    cached = run(go(cache_block_size=16, prefill_step_size=64))
    plain = run(go(prefix_cache=False))
    # sliced KV goes on into a cached block's first tokens (part blocks); snapshots stop at whole blocks
    expected = [0, 99, 90, 70, 70, 70] if name == "llama" else [0, 96, 80, 64, 64, 64]
    assert [o.cached_tokens for o in cached] == expected
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]


def test_a_hit_whose_remainder_fits_one_chunk_is_prefilled_in_one_pass(tokenizer):
    """A hit's remainder that crosses a chunk boundary but fits one chunk is one
    segment (no second pass, no copy of the whole prefix to store a block), and
    its answer is an uncached engine's; longer ones, and snapshot caches, are
    still cut at chunk (block) boundaries counted from the prompt's start."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, second = list(range(1000, 1060)), list(range(1000, 1090))  # hit 60: 30 tokens across 64

    async def go(name, **config):
        model = tiny_model(name, vocab_size=len(tokenizer.vocab))
        engine = EngineCore(f"{name}-{config}", lambda: (model, tokenizer), Settings(ssd_cache=False, **config))
        await engine.start()
        scheduler = engine.scheduler
        cuts = [[len(s) for s in scheduler._segments(list(range(n)), start)]
                for start, n in ((0, 150), (48, 90), (48, 200))]
        extracted = []  # the token count of each cache taken out of the batch
        real_extract = scheduler._gen.extract_cache

        def extract_cache(uids):
            caches = real_extract(uids)
            extracted.extend(len(tokens) for _, tokens in caches.values())
            return caches

        scheduler._gen.extract_cache = extract_cache
        outs = [await engine.generate(Request(engine.new_request_id(), p, params)) for p in (first, second)]
        await engine.close()
        return cuts, extracted, outs

    cuts, extracted, (out1, out2) = run(go("llama", cache_block_size=16, prefill_step_size=64))
    assert cuts == [[64, 64, 22], [42], [16, 64, 64, 8]]
    assert out2.cached_tokens == 60  # three blocks, then the first prompt's last 12 tokens from its part block
    # never: each end (past a block of 16) ran with its last token (folded_prompt),
    # and its blocks were stored from views of the lone row's batch buffers
    assert extracted == []
    _, _, plain = run(go("llama", prefix_cache=False))
    assert [o.token_ids for o in (out1, out2)] == [o.token_ids for o in plain]
    snapshot_cuts, _, _ = run(go("qwen3_next", cache_block_size=16, prefill_step_size=64))
    assert snapshot_cuts == [[16] * 9 + [6], [16, 16, 10], [16] * 9 + [8]]


def test_a_chats_next_turn_computes_at_most_a_cpu_blocks_worth_of_the_last_one(loaded):
    """Blocks of 64 tokens on a CPU by default (backends.cache_block_for): a
    turn that extends the last one (its prompt and answer, then a new message)
    hits all but the tokens after the last whole block, 63 at most (with
    blocks of 256, up to 255, ~0.6 s more a turn of the default model here)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the default block size asked about is the CPU's")

    async def go():
        engine = await started(loaded)
        first = request(loaded, engine, max_tokens=20)
        out = await engine.generate(first)
        turn = first.prompt_tokens + out.token_ids + loaded[1].encode("\nAnd in winter?")
        again = await engine.generate(Request(engine.new_request_id(), turn, SamplingParams(max_tokens=1)))
        block = engine.scheduler.cache.block_size
        await engine.close()
        return len(first.prompt_tokens + out.token_ids), again.cached_tokens, block

    seen, cached, block = run(go())
    assert block == 64 and seen - 63 <= cached <= seen
