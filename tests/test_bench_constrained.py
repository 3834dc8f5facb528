"""bench_lab.constrained on the default model, a tiny run: both arms run
in alternating order, every request generates its tokens, and the table has its
fields. How near 1 the ratios are is the benchmark's finding, not the test's."""

import math

import pytest

from bench_lab.constrained import HEADER, run_constrained, table_rows


@pytest.mark.slow  # a benchmark run
def test_a_tiny_run_alternates_the_arms_and_fills_the_table(model_path):
    result = run_constrained(str(model_path), [1, 2], max_tokens=6, repeats=2)
    assert [(r["batch"], r["runner"]) for r in result["runs"]] == [
        (1, "free"),
        (1, "constrained"),
        (1, "constrained"),
        (1, "free"),
        (2, "free"),
        (2, "constrained"),
        (2, "constrained"),
        (2, "free"),
    ]
    assert all(r["generated"] == [6] * r["batch"] for r in result["runs"])  # nobody stopped early
    for row in result["summary"]:
        for key in ("step_ratio", "decode_ratio"):
            assert 0 < row[key] < math.inf
    rows = table_rows(result)
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == len(HEADER) for r in rows)
    assert rows[0][4] == "≥ 0.8" and rows[0][-1] == "6 of 6"
    assert result["cpu_flags"]


def test_a_result_renders_as_markdown():
    from bench_lab.constrained import markdown, title

    arm = {
        "step_us": 1000.0,
        "step_tok_s": 1000.0,
        "decode_tok_s": 900.0,
        "generated": 8,
        "first_request_tokens": 8,
    }
    doc = {
        "model": "/m/SmolLM2",
        "device": "cpu",
        "cpu_flags": "avx512f",
        "repeats": 2,
        "prompt_len": 30,
        "max_tokens": 8,
        "summary": [{"batch": 8, "free": arm, "constrained": arm, "step_ratio": 1.0, "decode_ratio": 1.0}],
    }
    assert title(doc) == "Constrained decoding: `SmolLM2` on cpu"
    assert "| 8 | 1000 | 1000 | 1.000 | ≥ 0.9 |" in markdown(doc)
