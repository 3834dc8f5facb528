"""`tierlm bench speculation`, the command users run: one server, each
workload with drafts and with `speculative_tokens: 0`, the same text both ways
and the server's draft counters per run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierlm.bench import speculation_bench


def test_a_code_edit_asks_for_a_real_module_back_with_one_function_renamed():
    from tierlm.loadgen.edits import WORKLOADS, module_source

    workload = WORKLOADS["code-edit"](2, 24)
    assert workload.num_requests == 2 and workload.params["modules"] == ["colorsys", "fnmatch"]
    source, function = module_source("colorsys")
    (request,) = workload.sessions[0]
    ask = request.messages[0]["content"]
    assert source in ask and f"Rename the function {function} to {function}_v2" in ask and request.max_tokens == 24


@pytest.mark.slow  # a server, two stories asked twice (the code edits' 1.8k-token prompts took ~30 s)
def test_the_speculation_benchmark_runs_and_counts_drafts(model_path, tmp_path):
    out = tmp_path / "speculation.json"
    done = subprocess.run([sys.executable, "-m", "tierlm.cli", "bench", "speculation", "--model", str(model_path),
                           "--workloads", "prose", "--concurrency", "1", "--prompts", "2", "--rounds", "1",
                           "--max-tokens", "24", "--threads", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["workload"] == "prose" and row["same_text"] and row["prompts"] == 2
    assert len(row["on"]["texts"]) == len(row["off"]["texts"]) == 2  # two requests over one stream
    assert speculation_bench.table([row])[1][0][1] == "1 (2 requests)"
    assert row["on"]["summary"]["failed"] == row["off"]["summary"]["failed"] == 0
    assert set(row["drafts"]) >= {"proposed_tokens", "accepted_tokens", "steps"}
    assert all(isinstance(v, int) and v >= 0 for v in row["drafts"].values())


def test_the_step_trace_times_every_step_and_lists_what_was_compiled(tmp_path):
    """bench_lab.speculation_trace on a tiny model: every token of every
    sequence is in some step, verifying steps are marked, and the kernels that
    appear in the folder while a step runs are listed beside it."""
    from mlx_lm.generate import BatchGenerator

    from bench_lab.speculation_trace import trace
    from tierlm.engine.speculative_batch import SpeculativeGenerator
    from tierlm.models.random_model import tiny_model

    model = tiny_model("llama")
    prompts = [list(range(10, 30)) * 3, [7, 8, 9] * 12]
    folder = tmp_path / "kernels"
    folder.mkdir()
    plain = trace(BatchGenerator(model), prompts, 12, 4, str(folder))
    gen = SpeculativeGenerator(model)
    step = gen.next
    kernel = folder / "compiled.ptx"

    def compiling_first():  # its first step compiles a kernel, as a GPU's may
        if not kernel.exists():
            kernel.write_text("")
        return step()

    gen.next = compiling_first
    drafting = trace(gen, prompts, 12, 4, str(folder))
    assert sum(s["tokens"] for s in plain) == sum(s["tokens"] for s in drafting) == 2 * 12
    assert not any(s["verified"] for s in plain) and any(s["verified"] for s in drafting)
    assert drafting[0]["compiled"] == ["compiled.ptx"] and "compiled" not in drafting[1]


def test_the_step_trace_warms_as_asked_or_as_a_server_does():
    from bench_lab.speculation_trace import warm_jobs
    from tierlm.engine import warmup

    assert warm_jobs("1,4") == [(1, warmup.SHORT_PROMPT), (4, warmup.SHORT_PROMPT)]
    server = warm_jobs("server:8")
    shapes = [(job.batch, job.prompt_len) for job in warmup.warm_shapes(8, compiles=True) if not job.requests]
    assert server == shapes and (8, warmup.LONG_PROMPT) in server
