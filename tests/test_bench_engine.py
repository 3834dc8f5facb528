"""The in-process engine-overhead benchmark on the default model: both runners do
the same work, and the engine stays up (and its prefix cache is emptied) between
rounds."""

import math

from tierlm.bench.engine_overhead import EngineRunner, random_prompts, run_overhead
from tierlm.bench.step_timing import step_accounted_ratio


def test_engine_and_bare_produce_every_token_in_alternating_rounds(model_path):
    saved = []
    result = run_overhead(str(model_path), [1, 2], prompt_len=16, max_tokens=6, rounds=2, save=saved.append)
    # saved after each batch size: a run cut short keeps what it finished
    assert [[r["batch"] for r in s["runs"]] for s in saved] == [[1] * 4, [1] * 4 + [2] * 4]
    assert [s["complete"] for s in saved] == [False, False] and result["complete"]
    runners = [(r["batch"], r["runner"]) for r in result["runs"]]
    assert runners == [(1, "bare"), (1, "engine"), (1, "engine"), (1, "bare"),
                       (2, "bare"), (2, "engine"), (2, "engine"), (2, "bare")]
    for row in result["summary"]:
        assert row["bare"]["total_tok_s"] > 0 and row["engine"]["total_tok_s"] > 0
        assert row["total_ratio"] > 0
    # every run timed its full-batch decode steps; the engine's also its event loop's CPU
    for run in result["runs"]:
        steps = run["steps"]
        assert steps["steps"] >= 2 and steps["next"] > 0 and steps["between"] > 0
        assert ("main_cpu" in steps) == (run["runner"] == "engine")
    # a ratio of timings, on a machine shared with other runs: how near 1 it is is the
    # benchmark's finding, not something a test can hold it to
    assert all(0 < row["step_ratio"] < math.inf for row in result["summary"])
    assert result["event_loop"] == "uvloop"  # the loop `tierlm serve` runs on (uvicorn's default)


def test_step_accounted_ratio_charges_the_engine_its_between_and_its_event_loop():
    bare = {"next": 900.0, "between": 10.0}
    engine = {"next": 1000.0, "between": 40.0, "main_cpu": 20.0}
    # the engine's step: 1000 + 40; the bare loop's on the same model step: 1000 - 20 + 10
    assert step_accounted_ratio(bare, engine) == 990 / 1040
    assert step_accounted_ratio(bare, dict(engine, between=10.0, main_cpu=0.0)) == 1.0


def test_engine_runner_reuses_one_engine_and_starts_each_run_with_an_empty_cache(loaded):
    model, tokenizer = loaded  # the default model as tierlm loads it, shared with the engine tests
    runner = EngineRunner(model, tokenizer, batch=2, prefill_step_size=256)
    try:
        prompts = random_prompts(1000, 2, 300, seed=1)  # a full 256-token block each
        first, second = runner.run(prompts, 4), runner.run(prompts, 4)
        stats = runner.engine.get_stats()
        assert stats["finished_requests"] == 4 and stats["generated_tokens_total"] == 16
        assert stats["steps"] > 0 and stats["step_seconds_total"] > 0
        cache = runner.loop.run_until_complete(runner.engine.cache_stats())
        assert cache["stored_blocks"] >= 2  # each run stored its prompts ...
        assert cache["hit_tokens"] == 0  # ... and the second computed them again
        assert first.total_tok_s > 0 and second.total_tok_s > 0
    finally:
        runner.close()
