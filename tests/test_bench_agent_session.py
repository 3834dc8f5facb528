"""bench_lab.agent_session: an agent's turns as hot hits of new lengths, each
with its remainder and the server's prefill stage."""

from __future__ import annotations

import json

import pytest

from bench_lab import agent_session


@pytest.mark.slow  # two server starts, eight turns
@pytest.mark.parametrize("same", [False, True], ids=["new-shapes", "same-shapes"])
def test_every_later_turn_is_a_hot_hit_with_its_remainder(model_path, tmp_path, same):
    out = tmp_path / "session.json"
    args = ["--model", str(model_path), "--first", "300", "--turns", "2", "--sessions", "2", "--json", str(out)]
    assert agent_session.main(args + ["--same-shapes"] * same) == 0
    (only,) = json.loads(out.read_text())["settings"]
    turns = {(r["session"], r["turn"]): r for r in only["turns"]}
    assert len(turns) == 6 and all(r["cached_tokens"] == 0 for (_, t), r in turns.items() if t == 0)
    for (session, t), r in turns.items():
        if t:  # the earlier turns' blocks, none of the other session's (each has its own system line)
            assert 0 < r["cached_tokens"] <= turns[session, t - 1]["prompt_tokens"]
            assert r["remainder"] == r["prompt_tokens"] - r["cached_tokens"] > 0 and r["prefill_ms"] > 0
    lengths = [[turns[s, t]["prompt_tokens"] for t in range(3)] for s in range(2)]
    assert (lengths[0] == lengths[1]) == same
    assert only["median_hot_prefill_ms"] > 0
