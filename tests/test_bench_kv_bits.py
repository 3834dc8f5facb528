"""bench_lab.kv_bits: both engines take the `--speculation` setting it is
given, the quantized one drafting too (engine/ragged_quantized_kv.py), and
the result records it beside the two rates."""

from __future__ import annotations

import json

import pytest

from bench_lab import kv_bits
from tierlm.bench import engine_overhead


@pytest.mark.slow  # two engines of the default model, one calibrating its keys
def test_both_engines_draft_as_told_and_the_result_says_so(model_path, tmp_path, monkeypatch):
    engines = []
    start = engine_overhead.EngineRunner.__init__

    def kept(runner, *args, **config):
        start(runner, *args, **config)
        engines.append(runner.engine)

    monkeypatch.setattr(engine_overhead.EngineRunner, "__init__", kept)
    out = tmp_path / "kv-bits.json"
    assert kv_bits.main(["--model", str(model_path), "--batch", "2", "--context", "64", "--tokens", "4",
                         "--rounds", "1", "--speculation", "prompt-lookup", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["speculation"] == "prompt-lookup"
    assert sorted(e.kv_bits for e in engines) == [8, 16] and all(e._speculates() for e in engines)
    [context] = doc["contexts"]
    assert context["context"] == 64 and context["median_tok_s"]["8"] > 0 and context["median_tok_s"]["16"] > 0
