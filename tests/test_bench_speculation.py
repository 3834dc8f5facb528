"""`tierlm bench speculation`, the command users run: one server, each
workload with drafts and with `speculative_tokens: 0`, the same text both ways
and the server's draft counters per run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # a server and a code edit asked twice
def test_the_speculation_benchmark_runs_and_counts_drafts(model_path, tmp_path):
    out = tmp_path / "speculation.json"
    done = subprocess.run([sys.executable, "-m", "tierlm.cli", "bench", "speculation", "--model", str(model_path),
                           "--workloads", "code-edit", "--concurrency", "1", "--rounds", "1", "--max-tokens", "24",
                           "--threads", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["workload"] == "code-edit" and row["same_text"]
    assert row["on"]["summary"]["failed"] == row["off"]["summary"]["failed"] == 0
    assert set(row["drafts"]) >= {"proposed_tokens", "accepted_tokens", "steps"}
    assert all(isinstance(v, int) and v >= 0 for v in row["drafts"].values())
