"""bench_lab.decode_step: every variant of the attention over both caches
takes a step, the result records each, and the model's own attention is back
in its module afterwards."""

from __future__ import annotations

import json

import pytest

from bench_lab import decode_step


@pytest.mark.slow  # a lab instrument: every variant over every cache
def test_each_variant_over_each_cache_takes_a_step_and_the_attention_is_put_back(model_path, tmp_path):
    from mlx_lm.models import llama  # the default model's module (SmolLM2 is a Llama)

    out = tmp_path / "decode-step.json"
    assert decode_step.main(["--model", str(model_path), "--context", "64", "--batch", "2", "--tokens", "1", "5",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["tokens"], r["cache"], r["variant"]) for r in rows) == sorted(
        (n, c, v) for n in (1, 5) for c in ("KVCache", "BatchKVCache") for v in decode_step.variants(None))
    assert all(r["ms"] > 0 and r["first_ms"] > 0 and r["context"] == 64 for r in rows)
    assert not llama.scaled_dot_product_attention.__qualname__.startswith("variants.")  # the model's own again
