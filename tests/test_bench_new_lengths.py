"""bench_lab.new_lengths: prompts of lengths the server has not seen, each
answered with the server's own prefill stage."""

from __future__ import annotations

import json

import pytest

from bench_lab import new_lengths


def test_settings_and_server_timing_are_read():
    assert new_lengths.setting("bucketed") == ("bucketed", {})
    assert new_lengths.setting("off:TIERLM_QUERY_BUCKET=0,A=b=c") == ("off", {"TIERLM_QUERY_BUCKET": "0", "A": "b=c"})
    assert new_lengths.server_timing("read;dur=0.5, queue;dur=0.4, prefill;dur=127.1") == \
        {"read": 0.5, "queue": 0.4, "prefill": 127.1}


@pytest.mark.slow  # a server start
def test_each_length_is_answered_with_its_prefill(model_path, tmp_path):
    out = tmp_path / "lengths.json"
    assert new_lengths.main(["--model", str(model_path), "--words", "40", "90", "60", "--json", str(out)]) == 0
    (only,) = json.loads(out.read_text())["settings"]
    tokens = [r["prompt_tokens"] for r in only["requests"]]
    assert tokens[0] < tokens[2] < tokens[1]  # more words, more tokens
    assert all(0 < r["prefill_ms"] < r["total_ms"] for r in only["requests"])
    assert only["median_prefill_ms"] > 0 and only["ready_s"] > 0


def test_its_results_are_a_benchmark_of_the_docs(tmp_path):
    """A result file of it in docs/bench-results shows in benchmarks.md with its table."""
    from bench_lab import docs

    rows = [{"prompt_tokens": n, "total_ms": ms, "prefill_ms": ms - 9} for n, ms in ((590, 61.0), (635, 42.0))]
    doc = {"kind": "new_lengths", "date": "2026-12-06 07:00:00 UTC", "command": "python -m bench_lab.new_lengths",
           "machine": {}, "model": "/m/llama-1b", "preset": "llama-1b", "words": [450, 480],
           "settings": [{"name": "bucketed", "env": {}, "ready_s": 50.0, "requests": rows,
                         "median_total_ms": 42.0, "median_prefill_ms": 33.0}]}
    machine = tmp_path / "results" / "gpu"
    machine.mkdir(parents=True)
    (machine / "new-lengths.json").write_text(json.dumps(doc))
    text = docs.render_docs(tmp_path / "results", tmp_path / "benchmarks.md").read_text()
    assert "### Prompts of lengths new to the server, random weights of llama-1b's shapes: 2 prompts" in text
    assert "| bucketed | 590, 61 (52) | 42 (33) |" in text
