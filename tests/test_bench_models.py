"""bench_lab.models_bench on two tiny random-weight models, a tiny run: every phase
runs against a real server (loads cold and warm, TTFT with and without a load,
both workload arms), and the tables, JSON and markdown have their fields. How long
anything takes is the benchmark's finding, not the test's."""

from __future__ import annotations

import json

import pytest

from bench_lab.models_bench import (
    LOAD_HEADER,
    MIXED_HEADER,
    ModelsBenchConfig,
    load_rows,
    markdown,
    mixed_rows,
    print_tables,
    run_models_bench,
    title,
)
from tierlm.bench.report import write_json
from tierlm.models.random_model import make_random_model


@pytest.mark.slow  # a benchmark run
def test_a_tiny_run_measures_every_phase_and_fills_the_tables(tmp_path, model_path, capsys):
    a = make_random_model("tiny", tmp_path / "src" / "tiny-a", model_path, "float32")
    b = make_random_model("tiny", tmp_path / "src" / "tiny-b", model_path, "float32")
    cfg = ModelsBenchConfig(
        [a, b],
        rounds=1,
        repeats=1,
        streams=2,
        requests_per_stream=1,
        input_len=16,
        output_len=4,
        ttft_max_tokens=2,
        max_model_memory="2GB",
    )
    result = run_models_bench(cfg, tmp_path / "work", on_progress=lambda line: None)

    (run,) = result["runs"]
    assert [(r["model"], r["kind"]) for r in run["loads"]] == [
        ("tiny-a", "cold"),
        ("tiny-a", "warm"),
        ("tiny-b", "cold"),
        ("tiny-b", "warm"),
    ]
    assert all(r["load_s"] > 0 and r["memory_bytes"] > 0 for r in run["loads"])
    assert [(r["model"], r["arm"]) for r in run["ttft"]] == [
        ("tiny-a", "triggers load"),
        ("tiny-a", "loaded"),
        ("tiny-b", "triggers load"),
        ("tiny-b", "loaded"),
    ]
    assert all(r["output_tokens"] == 2 for r in run["ttft"])
    arms = {m["arm"]: m for m in run["mixed"]}
    assert list(arms) == ["mixed", "single"]
    assert {k: v["streams"] for k, v in arms["mixed"]["per_model"].items()} == {"tiny-a": 1, "tiny-b": 1}
    assert {k: v["streams"] for k, v in arms["single"]["per_model"].items()} == {"tiny-a": 2}
    for arm in arms.values():
        assert arm["summary"]["failed"] == 0 and arm["summary"]["output_tokens"] == 2 * 4
    assert run["cards"]["tiny-a"]["state"] == "loaded" and run["cards"]["tiny-b"]["state"] == "loaded"

    summary = result["summary"]
    assert summary["loads"]["tiny-a"]["cold_n"] == 1 and summary["loads"]["tiny-a"]["warm_n"] == 1
    assert summary["ttft"]["tiny-b"]["triggers_load_s"] > 0 and summary["ttft"]["tiny-b"]["loaded_s"] > 0
    assert summary["mixed"]["mixed"]["output_tok_s"] > 0 and summary["mixed"]["single"]["rounds"] == 1
    assert result["cpu_flags"] and result["default_model"] == "placeholder-default"

    loads, mixed = load_rows(result), mixed_rows(result)
    assert [r[0] for r in loads] == ["tiny-a", "tiny-b"] and all(len(r) == len(LOAD_HEADER) for r in loads)
    assert all("-" not in r[3:9] for r in loads)  # every load and TTFT figure is there
    assert [r[:2] for r in mixed] == [["mixed", "1 tiny-a + 1 tiny-b"], ["single", "2 tiny-a"]]
    assert mixed[1][3] == "1.00" and all(len(r) == len(MIXED_HEADER) for r in mixed)

    print_tables(result)
    assert "cold ÷ warm" in capsys.readouterr().out

    path = write_json(tmp_path / "models-tiny.json", "models", result, "tierlm bench models")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "models" and doc["machine"]["cpus"]
    assert title(doc) == "Many models, one server: `tiny-a` + `tiny-b` on " + result["device"]
    text = markdown(doc)
    assert "| tiny-a |" in text and "| single | 2 tiny-a |" in text


def test_the_docs_render_a_models_result(tmp_path):
    from bench_lab.docs import render_docs

    rows = {"cold_s": 1.0, "warm_s": 0.5, "unload_s": 0.1, "cold_n": 1, "warm_n": 1, "memory_bytes": 2**20}
    arm = {
        "output_tok_s": 100.0,
        "ttft_p50_s": 0.1,
        "ttft_p90_s": 0.2,
        "tpot_p50_s": 0.05,
        "failed": 0,
        "rounds": 1,
        "per_model": {"a": {"streams": 8, "output_tok_s": 100.0, "ttft_p50_s": 0.1}},
    }
    doc = {
        "kind": "models",
        "date": "2025-01-01 00:00:00",
        "command": "tierlm bench models",
        "machine": {"cpu": "Some CPU", "cpus": 2, "git": "abc1234"},
        "models": [{"id": "a", "size_bytes": 2**20}, {"id": "b", "size_bytes": 2**20}],
        "device": "Device(cpu, 0)",
        "cpu_flags": "amx_bf16",
        "config": {
            "rounds": 1,
            "repeats": 1,
            "streams": 8,
            "requests_per_stream": 2,
            "input_len": 128,
            "output_len": 64,
            "ttft_max_tokens": 8,
        },
        "runs": [{"loadavg_1m_before": 1.5}],
        "summary": {
            "loads": {"a": rows, "b": rows},
            "ttft": {m: {"loaded_s": 0.1, "triggers_load_s": 0.6, "n": 1} for m in "ab"},
            "mixed": {"mixed": arm, "single": arm},
        },
    }
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    (tmp_path / "results" / "cpu" / "models-x.json").write_text(json.dumps(doc))
    text = render_docs(tmp_path / "results", tmp_path / "benchmarks.md").read_text()
    assert "### Many models, one server: `a` + `b` on Device(cpu, 0)" in text
    assert "| a | 1 | 1 | 1.00 | 0.50 | 2.00 | 0.10 | 100.0 | 600.0 | 500.0 |" in text
    assert "| single | 8 a | 100.0 | 1.00 | 100.0 | 200.0 | 50.0 | 100.0 | 0 |" in text
