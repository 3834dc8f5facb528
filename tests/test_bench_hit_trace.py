"""bench_lab.hit_trace: a hot hit's host work as a timeline; a hit from the
kept sequence has no rebuild, one from blocks has; what it wraps is put back."""

from __future__ import annotations

import json

import pytest

from bench_lab import hit_trace
from tierlm.engine.scheduler import Scheduler


@pytest.mark.slow  # a lab instrument over a model
def test_a_hits_timeline_shows_a_rebuild_only_from_blocks_and_the_engine_is_put_back(model_path, tmp_path):
    step = Scheduler.step
    out = tmp_path / "trace.json"
    assert hit_trace.main(["--model", str(model_path), "--context", "200", "--rounds", "2", "--show", "1",
                           "--json", str(out)]) == 0
    kept, blocks = json.loads(out.read_text())["rows"]
    names = [{name for _, _, _, name, _ in row["events"]} for row in (kept, blocks)]
    assert (kept["via"], blocks["via"]) == ("kept", "blocks")
    assert "PrefixCache.rebuild" not in names[0] and "PrefixCache.rebuild" in names[1]
    assert all({"Scheduler.step", "Scheduler._admit", "Scheduler._advance"} <= n for n in names)
    assert all(0 <= start <= row["ms"] for row in (kept, blocks) for start, _, _, _, _ in row["events"])
    assert Scheduler.step is step
