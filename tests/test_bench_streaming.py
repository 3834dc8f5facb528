"""bench_lab.streaming's cold starts: every run sends prompts of its own, so
no run is timed on blocks an earlier one left in the prefix cache."""

from __future__ import annotations

import itertools

from bench_lab import streaming
from tierlm.bench import runs


def test_each_run_draws_new_prompts_of_the_same_lengths(model_path):
    args = streaming.parser().parse_args(["--input-len", "300", "--output-len", "8", "--min-prompts", "4",
                                          "--warmup", "2"])
    seeds = itertools.count(1)
    first, second = streaming.new_prompts(args, seeds), streaming.new_prompts(args, seeds)
    assert first.warmup == second.warmup == 0  # the first request timed is the first the server sees
    workloads = [runs.build_workload(a, str(model_path), 4) for a in (args, first, second)]
    prompts = [[r.prompt for s in w.sessions for r in s] for w in workloads]
    lengths = [[r.input_tokens for s in w.sessions for r in s] for w in workloads]
    assert lengths[0] == lengths[1] == lengths[2]
    firsts = [{p[:200] for p in ps} for ps in prompts]  # even their first block differs
    assert not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2]) and not (firsts[0] & firsts[2])
