"""A failing request fails alone; a failed step is rebuilt from; no request is
left without an answer. Each test provokes one fault in a real engine on the
default model, then checks that the next requests (a batch of eight, greedy and
sampled) are served normally.

Requests go to the engine directly, past the HTTP validation that refuses the
values provoking the real faults (a top_k of the vocabulary's size, a seed out of
range): the engine must survive them even if validation one day lets one by.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_testing import request, run, started
from mlx_lm.generate import BatchGenerator

from tierlm.engine.detokenizer import IncrementalText
from tierlm.engine.request import FinishReason
from tierlm.engine.scheduler import Scheduler

# the watchdog's timeout where a test waits for it: long enough that no honest
# step (a prefill of a batch of requests on a busy 2-core machine) is taken for a stall
STALL_S = 5.0


async def next_requests_succeed(loaded, engine) -> None:
    """Eight requests at once (one batch), greedy and sampled: all finish without an
    error, and the greedy ones give the answer of the first greedy request."""
    requests = [request(loaded, engine, max_tokens=6, ignore_eos=True) for _ in range(4)]
    requests += [request(loaded, engine, max_tokens=6, temperature=0.8, top_k=40, seed=i, ignore_eos=True)
                 for i in range(4)]
    outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    assert [o.error for o in outputs] == [None] * 8
    assert all(o.completion_tokens == 6 for o in outputs)
    assert len({o.text for o in outputs[:4]}) == 1
    assert engine.degraded is None and engine.is_alive


async def beside_a_bystander(loaded, max_tokens: int, **victim_params):
    """(a greedy request's output alone, the victim's, the same greedy request's
    beside the victim), then the next requests, on a fresh engine."""
    engine = await started(loaded)
    alone = await engine.generate(request(loaded, engine, max_tokens=max_tokens))
    victim = engine.generate(request(loaded, engine, max_tokens=max_tokens, **victim_params))
    bystander = engine.generate(request(loaded, engine, max_tokens=max_tokens))
    results = await asyncio.gather(victim, bystander)
    await next_requests_succeed(loaded, engine)
    await engine.close()
    return alone, *results


@pytest.mark.slow  # one more fault of one request
def test_a_top_k_the_sampler_refuses_fails_that_request_alone(loaded):
    """A real fault: mlx-lm's compiled top-k raises for k == vocabulary size, and
    left the global random state broken for every later random draw."""
    vocab = loaded[0].model.embed_tokens.weight.shape[0]

    async def go():
        engine = await started(loaded)
        alone = await engine.generate(request(loaded, engine, max_tokens=12))
        victim = engine.generate(request(loaded, engine, max_tokens=12, temperature=1.0, top_k=vocab))
        bystander = engine.generate(request(loaded, engine, max_tokens=12))
        sampled = engine.generate(request(loaded, engine, max_tokens=12, temperature=1.0, seed=3))
        results = await asyncio.gather(victim, bystander, sampled)
        await next_requests_succeed(loaded, engine)
        stats = engine.get_stats()
        await engine.close()
        return alone, results, stats

    alone, (victim, bystander, sampled), stats = run(go())
    assert victim.finish_reason == FinishReason.ERROR and "top_k" in victim.error
    assert bystander.error is None and bystander.text == alone.text
    assert sampled.error is None and sampled.completion_tokens >= 1
    assert stats["failed_requests"] == 1


@pytest.mark.slow  # one more fault of one request
def test_a_seed_out_of_range_fails_at_admission_instead_of_hanging(loaded):
    async def go():
        engine = await started(loaded)
        bad = [engine.generate(request(loaded, engine, temperature=1.0, seed=s)) for s in (-1, 2**64)]
        beside = engine.generate(request(loaded, engine, max_tokens=8))
        outputs = await asyncio.wait_for(asyncio.gather(*bad, beside), timeout=60)
        await next_requests_succeed(loaded, engine)
        await engine.close()
        return outputs

    low, high, beside = run(go())
    for output in (low, high):
        assert output.finish_reason == FinishReason.ERROR and "could not start" in output.error
    assert beside.error is None and beside.completion_tokens == 8


class ExplodingConstraint:
    """A request's constraint (engine.constraint.TokenConstraint, applied as its
    last logits processor) that allows every token and raises on its third call."""

    def __init__(self, after: int = 3):
        self.after, self.calls = after, 0

    def consume(self, token: int) -> None:
        pass

    def allowed(self, vocab: int) -> None:
        self.calls += 1
        if self.calls == self.after:
            raise RuntimeError("injected processor fault")


@pytest.mark.slow  # one more fault of one request
def test_a_logits_processor_that_raises_fails_its_request_alone(loaded):
    """A fault we cannot cause for real (mlx-lm's processors take what validation
    lets through): one that raises mid-decode."""
    alone, victim, bystander = run(beside_a_bystander(loaded, 30, constraint=ExplodingConstraint()))
    assert victim.finish_reason == FinishReason.ERROR and "injected processor fault" in victim.error
    assert victim.completion_tokens >= 1  # what it made before the fault reached its stream
    assert bystander.error is None and bystander.text == alone.text


def test_a_detokenizer_that_raises_fails_its_request_alone(loaded, monkeypatch):
    """A fault we cannot cause for real: the text of one request's token raises."""
    real = IncrementalText.add

    def add(self, token: int) -> str:
        if self.watches_stops:  # the victim's text, the only one with a stop string
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, token)

    monkeypatch.setattr(IncrementalText, "add", add)

    alone, victim, bystander = run(beside_a_bystander(loaded, 20, stop=["<explode>"]))
    assert victim.finish_reason == FinishReason.ERROR and "detokenizing failed" in victim.error
    assert bystander.error is None and bystander.text == alone.text


@pytest.mark.slow  # its twin on the other detokenizer stays in the fast run
def test_a_detokenizer_that_raises_on_the_fast_path_fails_its_request_alone(loaded, monkeypatch):
    """The same fault where the text of several tokens is made at once (a request
    with no stop string: IncrementalText.add_many), the victim told apart by the
    leading space it keeps. It may have made its tokens; it ends with an error."""
    real_init, real_add_many = IncrementalText.__init__, IncrementalText.add_many

    def init(self, detokenizer, stop, bytes_table=None, keep_leading_space=False):
        real_init(self, detokenizer, stop, bytes_table, keep_leading_space)
        self.explodes = keep_leading_space  # the victim's text

    def add_many(self, tokens: list[int]) -> str:
        if self.explodes:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_add_many(self, tokens)

    monkeypatch.setattr(IncrementalText, "__init__", init)
    monkeypatch.setattr(IncrementalText, "add_many", add_many)

    alone, victim, bystander = run(beside_a_bystander(loaded, 20, keep_leading_space=True, ignore_eos=True))
    assert victim.finish_reason == FinishReason.ERROR and "detokenizing failed" in victim.error
    assert bystander.error is None and bystander.text == alone.text


def failing_steps(monkeypatch, times: int, after: int = 2):
    """BatchGenerator.next raises `times` times in a row, once `after` calls went
    well: a fault in the batch that no one request can be blamed for."""
    real = BatchGenerator.next
    calls = {"n": 0}

    def next_(self):
        calls["n"] += 1
        if after < calls["n"] <= after + times:
            raise RuntimeError("injected step fault")
        return real(self)

    monkeypatch.setattr(BatchGenerator, "next", next_)


def test_a_failed_step_fails_the_batch_keeps_its_blocks_and_serves_the_queue(loaded, monkeypatch):
    failing_steps(monkeypatch, times=1)
    long_question = [{"role": "user", "content": "Tell me about the sea. " * 40}]

    async def go():
        engine = await started(loaded, max_concurrent_requests=2, cache_block_size=32)
        running = [engine.generate(request(loaded, engine, max_tokens=40, text=long_question)) for _ in range(2)]
        queued = engine.generate(request(loaded, engine, max_tokens=8))  # waits for a slot
        failed = await asyncio.gather(*running)
        served = await queued
        again = await engine.generate(request(loaded, engine, max_tokens=8, text=long_question))
        await next_requests_succeed(loaded, engine)
        stats = engine.get_stats()
        await engine.close()
        return failed, served, again, stats

    failed, served, again, stats = run(go())
    for output in failed:
        assert output.finish_reason == FinishReason.ERROR and "injected step fault" in output.error
    assert served.error is None and served.completion_tokens == 8
    assert again.error is None and again.cached_tokens > 0  # its prefill was stored before the fault
    assert stats["failed_requests"] == 2


@pytest.mark.slow  # a fault kept up over many steps
def test_steps_that_keep_failing_make_the_engine_degraded_until_one_works(loaded, monkeypatch):
    failing_steps(monkeypatch, times=3, after=0)

    async def go():
        engine = await started(loaded, degrade_after_failures=3)
        outputs = [await engine.generate(request(loaded, engine)) for _ in range(3)]
        degraded = engine.degraded
        await next_requests_succeed(loaded, engine)  # the fourth step works again
        await engine.close()
        return outputs, degraded

    outputs, degraded = run(go())
    assert all(o.finish_reason == FinishReason.ERROR for o in outputs)
    assert degraded and "injected step fault" in degraded


@pytest.mark.slow  # waits out a watchdog
def test_a_request_that_stops_progressing_is_ended_by_the_watchdog(loaded, monkeypatch):
    """A fault we cannot cause for real: the batch stops returning one request's tokens."""
    real_insert, real_next = BatchGenerator.insert_segments, BatchGenerator.next
    victim_max_tokens = 100_000  # tells the victim apart where the batch takes it in
    victim_uids: list[int] = []
    starved: set[int] = set()

    def insert_segments(self, segments, max_tokens=None, **kwargs):
        uids = real_insert(self, segments, max_tokens, **kwargs)
        victim_uids.extend(uid for uid, most in zip(uids, max_tokens or []) if most == victim_max_tokens)
        return uids

    def next_(self):
        prompts, tokens = real_next(self)
        return prompts, [r for r in tokens if r.uid not in starved]

    monkeypatch.setattr(BatchGenerator, "insert_segments", insert_segments)
    monkeypatch.setattr(BatchGenerator, "next", next_)

    async def go():
        engine = await started(loaded, stall_timeout_s=STALL_S)
        victim = request(loaded, engine, max_tokens=victim_max_tokens, ignore_eos=True)
        collector = engine.add_request(victim)
        await collector.get()  # its first token: it is running
        starved.update(victim_uids)
        beside = await engine.generate(request(loaded, engine, max_tokens=8))
        ended = await asyncio.wait_for(collector.get(), timeout=60)
        while not ended.finished:
            ended = await asyncio.wait_for(collector.get(), timeout=60)
        await next_requests_succeed(loaded, engine)
        await engine.close()
        return ended, beside

    ended, beside = run(go())
    assert ended.finish_reason == FinishReason.ERROR and "no progress" in ended.error
    assert beside.error is None


@pytest.mark.slow  # waits out a watchdog
def test_a_request_the_scheduler_loses_is_answered_by_the_watchdog(loaded, monkeypatch):
    """A fault we cannot cause for real: the scheduler takes a request on (it is
    live: the engine waits for its answer) and drops it on the floor."""
    real = Scheduler.add_request

    def add_request(self, incoming):
        if incoming.params.seed == 404:
            self.live.add(incoming.request_id)  # taken on, and never queued
        else:
            real(self, incoming)

    monkeypatch.setattr(Scheduler, "add_request", add_request)

    async def go():
        engine = await started(loaded, stall_timeout_s=2.0)
        lost = await asyncio.wait_for(engine.generate(request(loaded, engine, seed=404)), timeout=60)
        await next_requests_succeed(loaded, engine)
        await engine.close()
        return lost

    lost = run(go())
    assert lost.finish_reason == FinishReason.ERROR and "lost" in lost.error


@pytest.mark.slow  # waits out a watchdog
def test_a_stuck_worker_degrades_the_engine_and_answers_its_readers(loaded, monkeypatch):
    """A fault we cannot cause for real: one model step that does not return."""
    real = BatchGenerator.next
    release, stuck = threading.Event(), threading.Event()

    def next_(self):
        if not release.is_set():
            stuck.set()
            release.wait(60)
        return real(self)

    monkeypatch.setattr(BatchGenerator, "next", next_)

    async def go():
        engine = await started(loaded, stall_timeout_s=STALL_S)
        waiting = await asyncio.wait_for(engine.generate(request(loaded, engine)), timeout=60)
        degraded = engine.degraded
        release.set()
        for _ in range(200):  # the step returns; the next burst that works clears it
            if engine.degraded is None and not engine.scheduler.has_work():
                break
            await asyncio.sleep(0.05)
        await next_requests_succeed(loaded, engine)
        await engine.close()
        return waiting, degraded

    waiting, degraded = run(go())
    assert stuck.is_set()
    assert waiting.finish_reason == FinishReason.ERROR and "one step" in waiting.error
    assert degraded and "one step" in degraded
