"""bench_lab.hit_profile: a hot hit's calls are timed (the rebuild of its
blocks, then model calls over the tokens the cache did not hold), a cold
prompt's are not rebuilt, and the model and the cache are as before after."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench_lab import gpu_kernels, hit_profile


@pytest.mark.slow  # a benchmark instrument; tests/test_last_sequence.py covers the kept path
@pytest.mark.parametrize("via", ["kept", "blocks"])
def test_a_hot_hit_is_a_pass_over_the_new_tokens_after_a_rebuild_from_blocks_or_none(model_path, tmp_path, via):
    out = tmp_path / "hit-profile.json"
    assert hit_profile.main(["--model", str(model_path), "--context", "200", "--extra", "20", "--rounds", "1",
                             "--via", via, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["kind"], r["phase"]): r for r in result["rows"]}
    assert set(rows) == {(k, p) for k in ("cold", "hot") for p in ("new", "repeat")}
    for phase in ("new", "repeat"):
        cold, hot = rows["cold", phase], rows["hot", phase]
        assert not any(c[0] == "rebuild" for c in cold["calls"])
        rebuilt = [c for c in hot["calls"] if c[0] == "rebuild"]
        if via == "blocks":
            assert hot["calls"][0][0] == "rebuild" and hot["calls"][0][1] > 0
        else:  # the cold prompt's KV as the batch left it
            assert rebuilt == []
        tokens = sum(c[1][1] for c in hot["calls"] if c[0] == "model")  # (1, n) inputs
        assert tokens < hot["prompt_tokens"] // 2  # the cached ones are not computed again
        assert tokens >= 20  # every new one is
    assert set(result["medians_ms"]) == {"cold_new", "hot_new", "cold_repeat", "hot_repeat"}
    assert result["via"] == via


def test_the_call_timer_puts_the_model_and_the_cache_back():
    class Model:
        def __call__(self, inputs):
            return inputs

    class Cache:
        def rebuild(self, blocks):
            return []

    model, cache = Model(), Cache()
    original = Model.__call__
    with hit_profile.CallTimer(model, cache):
        assert Model.__call__ is not original and "rebuild" in vars(cache)
    assert Model.__call__ is original and "rebuild" not in vars(cache)


def test_kernels_are_summed_by_name_and_the_gpus_busy_time_set_against_its_span():
    def kernel(name, start, end):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span)

    events = [kernel("gather", 0, 1000), kernel("copy", 1500, 1700), kernel("gather", 3000, 4000)]
    assert gpu_kernels.summary(events) == {"kernels": 3, "busy_ms": 2.2, "span_ms": 4.0,
                                           "top": [("gather", 2, 2.0), ("copy", 1, 0.2)]}


def test_kernels_asked_for_where_torch_cannot_profile_say_why(model_path, capsys):
    why = gpu_kernels.available()
    if why is None:
        pytest.skip("torch with CUDA is here")
    with pytest.raises(SystemExit) as stopped:
        hit_profile.main(["--model", str(model_path), "--kernels"])
    assert stopped.value.code == 2 and why in capsys.readouterr().err
