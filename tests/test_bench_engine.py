"""The in-process engine-overhead benchmark on the default model: both runners do
the same work, and the engine stays up (and its prefix cache is emptied) between
rounds."""

import json
import math
import os

import pytest

from bench_lab.docs import render_engine
from tierlm.bench.engine_overhead import (
    EngineRunner,
    merge_results,
    pair_ratios,
    parse_cpu_list,
    pin_to_cpus,
    random_prompts,
    run_overhead,
)
from tierlm.bench.step_timing import step_accounted_ratio


@pytest.mark.slow  # a benchmark run
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


def test_a_run_whose_requests_fail_says_why(loaded):
    """Requests the engine refuses (more tokens than memory holds, caused for
    real) end the run with their error, not with an empty list of token times."""
    model, tokenizer = loaded
    runner = EngineRunner(model, tokenizer, batch=2, prefill_step_size=256)
    try:
        with pytest.raises(RuntimeError, match="2 of 2 requests failed; request 0: .*memory"):
            runner.run(random_prompts(1000, 2, 40, seed=2), 10**9)
    finally:
        runner.close()


@pytest.mark.slow  # a benchmark run
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


def _doc(batch: int, rounds: int, rate: float, **changes) -> dict:
    """A `bench engine` result file of one batch size, as written on one machine."""
    def run(runner: str, r: int) -> dict:
        return {"batch": batch, "runner": runner, "decode_tok_s": rate * (1 + r / 100), "total_tok_s": rate,
                "mean_ttft_s": 0.1, "wall_s": 1.0, "steps": {}}
    runs = [run(runner, r) for r in range(rounds) for runner in (("bare", "engine") if r % 2 == 0
                                                                  else ("engine", "bare"))]
    doc = {"kind": "engine", "date": f"2026-12-02 0{batch % 10}:00:00 UTC", "command": f"bench engine --batch {batch}",
           "machine": {"cpu": "Xeon", "gpu": "H200"}, "model": "/m/llama-1b", "batches": [batch], "prompt_len": 500,
           "max_tokens": 128, "rounds": rounds, "device": "Device(gpu, 0)", "event_loop": "uvloop",
           "engine_per_batch": True, "bare_in_thread": False, "cpus": [2, 3], "runs": runs, "complete": True}
    return doc | changes


def test_results_of_several_calls_merge_into_one_with_every_round():
    one, more, other = _doc(1, 3, 200.0), _doc(1, 2, 210.0), _doc(8, 4, 1000.0)
    merged = merge_results([one, more, other])
    assert merged["batches"] == [1, 8] and merged["rounds_per_batch"] == {1: 5, 8: 4}
    assert merged["rounds"] == 4 and len(merged["runs"]) == 18
    assert pair_ratios(merged["runs"], 1) == pair_ratios(one["runs"], 1) + pair_ratios(more["runs"], 1)
    assert [s["batch"] for s in merged["summary"]] == [1, 8]
    assert merged["machine"] == one["machine"] and merged["date"] == other["date"]  # where and when they ran
    assert [m["command"] for m in merged["merged_from"]] == [one["command"], more["command"], other["command"]]
    for changed in ({"prompt_len": 128}, {"cpus": None}, {"machine": {"cpu": "EPYC", "gpu": "H200"}}):
        with pytest.raises(ValueError, match="not one benchmark"):
            merge_results([one, _doc(8, 2, 1000.0, **changed)])


def test_merged_results_render_their_rounds_per_batch_and_every_command(tmp_path):
    merged = merge_results([_doc(1, 3, 200.0), _doc(8, 4, 1000.0)])
    page = render_engine(json.loads(json.dumps(merged)), tmp_path / "engine-x.json")  # as read back from its file
    assert "rounds per batch: 3 (batch 1), 4 (batch 8)" in page
    assert "bench engine --batch 1\nbench engine --batch 8" in page
    assert "pinned to CPUs 2,3" in page


def test_a_cpu_list_reads_as_taskset_writes_it():
    assert parse_cpu_list("2-5") == [2, 3, 4, 5]
    assert parse_cpu_list("0,2, 4-5") == [0, 2, 4, 5]
    for bad in ("", "a-b", "5-2", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_a_bad_cpu_list_is_a_usage_error(capsys):
    from tierlm.cli import build_parser

    assert build_parser().parse_args(["bench", "engine", "--cpus", "2-5"]).cpus == [2, 3, 4, 5]
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["bench", "engine", "--cpus", "5-2"])
    assert done.value.code == 2 and "not a CPU list: '5-2'" in capsys.readouterr().err


def test_pinning_takes_the_process_to_those_cpus():
    before = os.sched_getaffinity(0)
    try:
        assert pin_to_cpus([min(before)]) == [min(before)]
        assert os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)
