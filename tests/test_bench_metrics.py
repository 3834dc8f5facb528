"""The benchmark's metric math, on fake timestamps (no server, no model)."""

import math

import pytest

from tierlm.loadgen.metrics import RequestRecord, percentile, steady_decode_rate, summarize


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_ttft_tpot_itl_e2e_of_one_request():
    r = RequestRecord(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], end=11.2, output_tokens=4)
    assert r.ok
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])


def test_usage_counts_beat_chunk_counts():
    # two chunks carrying 5 tokens (a server that batches tokens per chunk)
    r = RequestRecord(start=0.0, chunk_times=[1.0, 2.0], end=2.0, output_tokens=5)
    assert r.n_output == 5
    assert r.tpot == pytest.approx(1.0 / 4)
    r.output_tokens = None
    assert r.n_output == 2


def test_summary_counts_failures_and_rates():
    ok1 = RequestRecord(start=0.0, chunk_times=[0.1, 0.2, 0.3], end=0.3, prompt_tokens=10, output_tokens=3)
    ok2 = RequestRecord(start=0.0, chunk_times=[0.3, 0.5], end=0.5, prompt_tokens=10, output_tokens=2)
    bad = RequestRecord(start=0.0, error="HTTP 500: boom")
    s = summarize([ok1, ok2, bad], duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["output_tokens"] == 5
    assert s["output_tok_s"] == pytest.approx(2.5)
    assert s["requests_s"] == pytest.approx(1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)
    assert s["e2e_s"]["p99"] == pytest.approx(0.3 + 0.2 * 0.99)
    # TPOT per request: (0.3 - 0.1) / 2 = 0.1 and (0.5 - 0.3) / 1 = 0.2
    assert s["tpot_s"]["p50"] == pytest.approx(0.15)
    # ITLs pooled over requests: 0.1, 0.1, 0.2
    assert s["itl_s"]["p50"] == pytest.approx(0.1)


def test_steady_decode_rate_counts_the_full_batch_window():
    # request A: tokens every 0.1 s from t=1; B joins at t=2 and also steps at 0.1 s
    a = [1.0 + 0.1 * i for i in range(31)]  # 1.0 .. 4.0
    b = [2.0 + 0.1 * i for i in range(16)]  # 2.0 .. 3.5
    rate = steady_decode_rate([a, b])
    # window (2.0, 3.5]: 15 tokens of each over 1.5 s
    assert rate == pytest.approx(30 / 1.5, rel=1e-6)
    assert math.isnan(steady_decode_rate([]))


def test_engine_table_shows_each_rounds_ratio_and_their_geometric_mean(tmp_path):
    from bench_lab.docs import render_engine

    def run(runner, decode):
        return {"batch": 8, "runner": runner, "decode_tok_s": decode, "total_tok_s": decode, "mean_ttft_s": 0.1}

    doc = {
        "model": "/m/tiny", "device": "cpu", "rounds": 2, "prompt_len": 4, "max_tokens": 8,
        "runs": [run("bare", 100.0), run("engine", 90.0), run("engine", 110.0), run("bare", 100.0)],
        "summary": [{"batch": 8, "bare": {"decode_tok_s": 100.0, "total_tok_s": 100.0},
                     "engine": {"decode_tok_s": 100.0, "total_tok_s": 100.0},
                     "decode_ratio": 1.0, "total_ratio": 1.0}],
    }
    row = next(line for line in render_engine(doc, tmp_path / "e.json").splitlines() if line.startswith("| 8 "))
    assert "| 0.90–1.10 |" in row
    assert "| 0.995 ± 0.100 |" in row  # sqrt(0.9 * 1.1), and the s.e. of the two logs
    from tierlm.loadgen.metrics import geometric_mean_se

    assert all(math.isnan(x) for x in geometric_mean_se([1.2]))  # one pair: no error to give


def test_engine_table_checks_the_target_on_the_wall_clock_pairs_not_the_step_accounted_ratio(tmp_path):
    from bench_lab.docs import render_engine

    def run(runner, decode, steps):
        return {"batch": 8, "runner": runner, "decode_tok_s": decode, "total_tok_s": decode,
                "mean_ttft_s": 0.1, "steps": steps}

    bare = {"next": 1000.0, "between": 10.0}
    engine = {"next": 1000.0, "between": 20.0, "main_cpu": 10.0}  # (1000 - 10 + 10) / 1020
    doc = {
        "model": "/m/tiny", "device": "gpu", "rounds": 2, "prompt_len": 4, "max_tokens": 8,
        "runs": [run("bare", 100.0, bare), run("engine", 90.0, engine),
                 run("engine", 90.0, engine), run("bare", 100.0, bare)],
        "summary": [{"batch": 8, "bare": {"decode_tok_s": 100.0, "total_tok_s": 100.0},
                     "engine": {"decode_tok_s": 90.0, "total_tok_s": 90.0},
                     "decode_ratio": 0.9, "total_ratio": 0.9, "step_ratio": 1000 / 1020}],
    }
    row = next(line for line in render_engine(doc, tmp_path / "e.json").splitlines() if line.startswith("| 8 "))
    assert "| 0.980 ± 0.000 |" in row  # the step-accounted pairs: a diagnostic, shown
    assert "| **no** |" in row and "| 0.900 ± 0.000 |" in row  # the target, on the wall-clock pairs
    faster = dict(doc, runs=[run("bare", 100.0, bare), run("engine", 98.0, engine),
                             run("engine", 99.0, engine), run("bare", 100.0, bare)])
    row = next(line for line in render_engine(faster, tmp_path / "e.json").splitlines() if line.startswith("| 8 "))
    assert "| yes |" in row  # pairs 0.98 and 0.99, though the summary's median says 0.9
