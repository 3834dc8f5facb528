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


def _rows(tok_s: list[float], failed: int = 0) -> list[dict]:
    return [{"concurrency": c, "output_tok_s": v, "ttft_p50": 0.5, "tpot_p50": 0.05, "itl_p50": 0.05,
             "itl_p99": 0.1, "failed": failed} for c, v in zip((1, 4), tok_s)]


def test_rounds_of_two_trees_give_medians_and_each_rounds_ratio():
    rounds = [{"base": _rows([10, 30]), "this": _rows([12, 33], failed=1)},  # base served first
              {"this": _rows([9, 30]), "base": _rows([11, 33])},  # this tree first
              {"base": _rows([10, 31]), "this": _rows([11, 34])}]
    this = streaming.median_rows([r["this"] for r in rounds])
    assert [r["output_tok_s"] for r in this] == [11, 33] and this[0]["failed"] == 1
    doc = {"smoothness": {"base": streaming.median_rows([r["base"] for r in rounds]), "this": this},
           "smoothness_rounds": rounds}
    text = streaming.markdown(doc)
    assert "round 1 (base first): 1.20 / 1.10; round 2 (this first): 0.82 / 0.91" in text
    assert "| 1 | 50.0 | 50.0 | 1.00 | 10.0 | 50.0 | 50.0 | 1.00 | 11.0 | 1.10 |" in text


def test_a_cold_start_counts_the_kernels_compiled_after_ready(tmp_path):
    """The kernel folder is listed at ready and after each run (nested names
    too); the table shows how many the first run compiled, '-' for results
    from before it was recorded."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.cubin").write_bytes(b"x")
    ready = streaming._kernel_files(tmp_path)
    (tmp_path / "sub" / "b.cubin").write_bytes(b"y")
    assert ready == {"a.cubin"} and streaming._kernel_files(tmp_path) - ready == {"sub/b.cubin"}
    assert streaming._kernel_files(tmp_path / "absent") == set()
    row = _rows([10])[0]
    cold = {"concurrency": 8, "kernels": "fresh", "first": row, "second": row, "ratio": 1.0,
            "warmup_at_ready": {"seconds": 8.0, "shapes_left": 0}}
    text = streaming.markdown({"cold_start": [dict(cold, kernels_compiled_in_first=["sub/b.cubin"]), cold]})
    assert "| 8.0 s | 0 | 1 |" in text and "| 8.0 s | 0 | - |" in text


def test_the_command_line_takes_a_base_tree_and_its_rounds():
    """A before/after reads `rounds` (a run on an H100 stopped there once)."""
    assert streaming.parser().parse_args(["--base-tree", "/tmp/x"]).rounds == 1
    assert streaming.parser().parse_args(["--base-tree", "/tmp/x", "--rounds", "3"]).rounds == 3


def test_base_args_serve_this_tree_with_other_flags_against_the_same_tree():
    """A setting's before/after on one tree: base gets --base-args in place of
    --tierlm-args (no flags at all where it is empty), this tree its own."""
    p = streaming.parser()
    one, with_flags, both = (streaming.sides(p.parse_args(a)) for a in (
        ["--tierlm-args", "--batch-kv-bits 16"],
        ["--tierlm-args", "--batch-kv-bits 16", "--base-args", ""],
        ["--base-tree", "/tmp/x", "--tierlm-args", "--batch-kv-bits 16"]))
    assert one == [streaming.Side("this", None, "--batch-kv-bits 16")]
    assert with_flags == [streaming.Side("base", None, ""), streaming.Side("this", None, "--batch-kv-bits 16")]
    assert both[0].tree is not None and both[0].flags == "--batch-kv-bits 16"
    spec = streaming._spec(p.parse_args(["--base-args", ""]), with_flags[0], 4, None)
    assert spec.name == "base" and "--batch-kv-bits" not in spec.cmd
    assert "--batch-kv-bits" in streaming._spec(p.parse_args([]), with_flags[1], 4, None).cmd
    title = streaming.title({"tierlm_args": "--batch-kv-bits 16", "base_args": ""})
    assert title.endswith("`--batch-kv-bits 16`, against `no flags`")
