"""docs/benchmarks.md shows, per machine and benchmark, only the newest result;
the older files of the same benchmark are named as data."""

from __future__ import annotations

import json
import re

from bench_lab.docs import render_docs

PCT = {"p50": 0.1, "p90": 0.1, "p99": 0.1}
SUMMARY = {"requests_s": 1.0, "output_tok_s": 10.0, "ttft_s": PCT, "tpot_s": PCT, "itl_s": PCT,
           "e2e_s": PCT, "mean_output_tokens": 8.0, "failed": 0}
MEDIAN = {"output_tok_s": 10.0, "requests_s": 1.0, "ttft_p50": 0.1, "ttft_p99": 0.1, "tpot_p50": 0.1,
          "itl_p50": 0.1, "e2e_p50": 0.1, "mean_output_tokens": 8.0, "failed": 0}


def compare(date: str, input_len: int, threads: int = 1) -> dict:
    llama = ["llama-server", "-m", "m.gguf", "-t", str(threads)]
    return {"kind": "compare", "date": date, "command": f"tierlm bench compare  # {date}",
            "machine": {"cpu": "Test CPU", "git": f"c{input_len}-{date[8:10]}"},
            "servers": [{"name": "tierlm", "cmd": ["tierlm"]}, {"name": "llama-server", "cmd": llama}],
            "concurrencies": [1], "rounds": 2, "workload": "random",
            "medians": {"tierlm@1": MEDIAN, "llama-server@1": MEDIAN},
            "runs": [{"concurrency": 1, "workload": "random", "summary": SUMMARY,
                      "workload_params": {"num_prompts": 2, "input_len": input_len, "output_len": 8}}]}


def engine(date: str, rounds: int, model: str = "/m/tiny", queue: bool = False) -> dict:
    side = {"decode_tok_s": 100.0, "total_tok_s": 100.0}
    summary = {"batch": 1, "bare": side, "engine": side, "decode_ratio": 1.0, "total_ratio": 1.0}
    if queue:
        summary |= {"bare-queue": {"total_tok_s": 90.0}, "engine-queue": {"total_tok_s": 90.0}}
    return {"kind": "engine", "date": date, "command": f"tierlm bench engine  # {date}", "machine": {},
            "model": model, "device": "cpu", "rounds": rounds, "prompt_len": 4, "max_tokens": 8,
            "runs": [], "summary": [summary]}


def serve(date: str) -> dict:
    return {"kind": "serve", "date": date, "command": f"tierlm bench serve  # {date}", "machine": {},
            "base_url": "http://127.0.0.1:1",
            "runs": [{"concurrency": 1, "workload": "random", "summary": SUMMARY,
                      "workload_params": {"num_prompts": 4, "input_len": 16, "output_len": 8}}]}


def rendered(tmp_path, machine: str, files: dict[str, dict]) -> str:
    """docs/benchmarks.md rendered from these result files of one machine's folder."""
    folder = tmp_path / "results" / machine
    folder.mkdir(parents=True)
    for name, doc in files.items():
        (folder / name).write_text(json.dumps(doc))
    return render_docs(tmp_path / "results", tmp_path / "benchmarks.md").read_text()


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^### ", text, flags=re.MULTILINE)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_only_the_newest_result_of_each_benchmark_is_shown(tmp_path):
    files = {
        # one benchmark, two results: the newer one shows
        "compare-a.json": compare("2026-01-01 10:00:00 UTC", 32),
        "compare-b.json": compare("2026-01-02 10:00:00 UTC", 32),
        # another request shape, and another llama-server thread count: benchmarks of their own
        "compare-c.json": compare("2026-01-01 09:00:00 UTC", 500),
        "compare-d.json": compare("2026-01-01 08:00:00 UTC", 32, threads=2),
        # engine overhead per model; a one-round file is no overhead result
        "engine-old.json": engine("2026-01-01 10:00:00 UTC", 3),
        "engine-new.json": engine("2026-01-03 10:00:00 UTC", 2),
        "engine-other-model.json": engine("2026-01-01 10:00:00 UTC", 2, model="/m/big"),
        "engine-once.json": engine("2026-01-04 10:00:00 UTC", 1),
        # served vs bare: serve-X with engine-X is one run; the newer run shows
        "serve-r1.json": serve("2026-01-01 10:00:00 UTC"),
        "engine-r1.json": engine("2026-01-01 09:59:00 UTC", 1, queue=True),
        "serve-r2.json": serve("2026-01-02 10:00:00 UTC"),
        "engine-r2.json": engine("2026-01-02 09:59:00 UTC", 1, queue=True),
    }
    text = rendered(tmp_path, "testbox", files)

    assert text.startswith("# Benchmarks") and "Tools" in text
    assert "## testbox: Test CPU" in text
    found = sections(text)
    assert len(found) == len(set(found)) == 6  # no two titled alike
    compares = {t: s for t, s in found.items() if t.startswith("Side by side")}
    assert len(compares) == 3
    newest = compares["Side by side: random workload, 32 → 8 tokens; tierlm vs llama-server (1 thread)"]
    assert "2026-01-02 10:00:00 UTC" in newest and "`compare-b.json`" in newest
    assert "tierlm bench compare  # 2026-01-02 10:00:00 UTC" in newest  # its command
    assert "commit `c32-02`" in newest
    assert "Older results of this benchmark, kept as data: `compare-a.json`." in newest
    assert "2026-01-01 10:00:00" not in newest  # the older result's tables are not rendered

    tiny = found["Engine overhead: `tiny` on cpu"]
    assert "`engine-new.json`" in tiny and "kept as data: `engine-old.json`." in tiny
    assert "Older" not in found["Engine overhead: `big` on cpu"]

    served = found["Served vs bare `BatchGenerator` vs roofline: `tiny`"]
    assert "`serve-r2.json`" in served and "`engine-r2.json`" in served
    assert "kept as data: `engine-r1.json`, `serve-r1.json`." in served

    assert "Other files here, of no benchmark above (kept as data): `engine-once.json`." in text


def smooth_row(c: int, itl: float, tpot: float, tok_s: float) -> dict:
    return {"concurrency": c, "output_tok_s": tok_s, "ttft_p50": 0.2, "tpot_p50": tpot, "itl_p50": itl,
            "itl_p99": itl, "failed": 0}


def test_streaming_results_show_itl_against_tpot_and_cold_starts(tmp_path):
    cold = {"concurrency": 8, "kernels": "kept", "first": smooth_row(8, 0.01, 0.01, 900.0),
            "second": smooth_row(8, 0.01, 0.01, 1000.0), "ratio": 0.9,
            "warmup_at_ready": {"shapes_left": 2, "seconds": 4.25}, "warmup_after": None}
    doc = {"kind": "streaming", "date": "2026-01-01 10:00:00 UTC", "command": "tierlm bench streaming",
           "machine": {}, "model": "/m/llama-1b", "base_tree": "/b", "shape": {"input_len": 500, "output_len": 256},
           "smoothness": {"base": [smooth_row(1, 0.100, 0.004, 230.0)], "this": [smooth_row(1, 0.005, 0.005, 240.0)]},
           "cold_start": [cold, {**cold, "ratio": 0.7}, {**cold, "ratio": 1.0}]}
    text = rendered(tmp_path, "gpu", {"streaming-llama-1b.json": doc})
    (section,) = sections(text).values()
    assert section.startswith("Streaming and cold start: `llama-1b`, 500-token prompts, 256 tokens out, at 1 streams, "
                              "against an earlier tree")
    assert "| 1 | 100.0 | 4.0 | 25.00 | 230.0 | 5.0 | 5.0 | 1.00 | 240.0 | 1.04 |" in section
    assert "| 8 | kept | 900.0 | 1000.0 | 0.90 | 200.0 | 200.0 | 4.2 s | 2 |" in section
    assert "Median first ÷ second: 8 streams, kept kernels: 0.90 (3 starts, 0.70–1.00)." in section


def test_two_replicas_show_the_hit_from_the_others_blocks_and_the_sessions_routed(tmp_path):
    rounds = [{"cold_s": 13.0 + r, "replica_hit_s": 1.5, "replica_cached_tokens": 3840, "hot_s": 1.3} for r in range(3)]
    sessions = [{"header": "session-id", "replicas": [i % 2, i % 2], "first_s": 12.0, "second_s": 1.1,
                 "second_hot_hit_tokens": 3840 if i else 0} for i in range(4)]
    doc = {"kind": "replicas", "date": "2026-01-01 10:00:00 UTC", "command": "python -m bench_lab.replicas",
           "machine": {}, "model": "/m/SmolLM2", "prompt_tokens": 4000,
           "replicas": {"rounds": rounds, "median_cold_s": 14.0, "median_replica_hit_s": 1.5, "median_hot_s": 1.3,
                        "replica_hit_over_cold": 1.5 / 14, "hot_over_cold": 1.3 / 14},
           "nginx": {"sessions": sessions, "both_replicas_used": True, "every_session_kept": False}}
    text = rendered(tmp_path, "cpu", {"replicas-smollm2.json": doc})
    (section,) = sections(text).values()
    assert section.startswith("Two replicas sharing one SSD folder, agent sessions through nginx, SmolLM2: "
                              "a 4000-token prompt")
    assert "| 14.000 s | 1.500 s (0.107) | 1.300 s (0.093) | 3840 |" in section
    assert "3 of 4 agent sessions kept on one replica" in section and "both replicas used: yes" in section


def test_the_machine_heading_names_the_hardware_of_the_results_shown(tmp_path):
    """A folder may hold runs of two machines of its kind; a newer file of no
    benchmark (data only) does not name the machine of the tables."""
    other_cpu = compare("2026-01-03 10:00:00 UTC", 500) | {"machine": {"cpu": "Other CPU", "git": "x"}}
    files = {"compare-a.json": compare("2026-01-02 10:00:00 UTC", 32), "compare-b.json": other_cpu,
             "embeddings-later.json": {"kind": "embeddings", "date": "2026-01-04 10:00:00 UTC",
                                  "machine": {"cpu": "Data-only CPU"}}}
    text = rendered(tmp_path, "cpu", files)
    assert "## cpu: Other CPU / Test CPU\n" in text
    assert "Data-only CPU" not in text


def test_a_compare_against_llama_server_shows_long_prompts_memory_and_the_cpu(tmp_path):
    """Issue #33's run: the long prompts' TTFT, each server's memory, the CPU's
    features and tierlm's CPU backend go with the tables; both servers' threads
    name the benchmark."""
    doc = compare("2026-01-05 10:00:00 UTC", 128, threads=2)
    doc["workload"] = "chat"
    doc["servers"][0] |= {"threads": 2, "env": {"TIERLM_NATIVE_THREADS": "2"}}
    doc["runs"] = [doc["runs"][0] | {"workload": "chat", "phase": "streams"},
                   {"concurrency": 1, "workload": "chat", "phase": "long-prompt", "summary": SUMMARY,
                    "workload_params": {"num_prompts": 5, "input_len": 2048, "output_len": 4}}]
    long = {"ttft_p50": 2.0, "ttft_p90": 2.5, "mean_prompt_tokens": 2061.0, "mean_cached_tokens": 3.0, "failed": 0}
    doc["long_prompt"] = {"prompt_len": 2048, "requests": 5, "output_len": 4,
                          "medians": {"tierlm": long, "llama-server": long | {"ttft_p50": 1.0}}}
    mem = {"after_load": 500 * 2**20, "end": 600 * 2**20, "end_anon": 550 * 2**20, "end_file": 50 * 2**20,
           "peak": 610 * 2**20}
    doc["memory"] = {"tierlm": mem, "llama-server": mem}
    doc["machine"]["cpu_features"] = {"avx2": True, "avx512f": True, "amx_tile": False, "hypervisor": True}
    doc["machine"]["max_cpu_isa"] = "avx2"  # taken under TIERLM_MAX_CPU_ISA
    doc["tierlm_backend"] = {"name": "cpu", "quantized_kernels": "on (avx512-vnni)", "calls": {"qmm": 9}}
    text = rendered(tmp_path, "cpu", {"compare-qwen-coder.json": doc})

    (title, section), = sections(text).items()
    assert title == ("Side by side: chat workload, 128 → 8 tokens, TTFT of 2048-token prompts; "
                     "tierlm (2 threads) vs llama-server (2 threads)")
    assert '"requests (or conversations) per concurrency": {"1": 2}' in section  # the long prompts apart
    assert "- tierlm: `TIERLM_NATIVE_THREADS=2 tierlm`" in section
    assert "| llama-server | 2061 | 1000.0 | 2500.0 | 3 | 0 | 2.00 |" in section
    assert "| tierlm | 500 | 600 | 550 | 50 | 610 |" in section
    assert ("CPU features, under a hypervisor: avx2 avx512f; absent: amx_tile. "
            "tierlm's kernels capped at TIERLM_MAX_CPU_ISA=avx2.") in section
    assert '`{"name": "cpu", "quantized_kernels": "on (avx512-vnni)"}`' in section  # the counters left out
    assert "tierlm bench compare --model qwen2.5-coder-0.5b --servers tierlm,llama" in text  # the command, on top


def test_a_result_found_wrong_keeps_its_numbers_under_a_warning(tmp_path):
    wrong = compare("2026-01-02 10:00:00 UTC", 32) | {"void": "the kernel gave wrong answers"}
    text = rendered(tmp_path, "cpu", {"compare-wrong.json": wrong, "compare-ok.json": compare("2026-01-01 10:00:00 UTC", 500)})
    shown = sections(text)
    assert sum("**Void:** the kernel gave wrong answers" in body for body in shown.values()) == 1
    assert "**Void:**" not in next(body for body in shown.values() if "500" in body.splitlines()[0])


def test_an_agent_session_shows_each_settings_cold_and_hot_turns(tmp_path):
    setting = {"name": "products", "env": {}, "turns": [], "median_cold_ttft_s": 0.444,
               "median_hot_ttft_s": 0.082, "median_hot_prefill_ms": 51.0}
    doc = {"kind": "agent_session", "date": "2026-01-01 10:00:00 UTC", "command": "python -m bench_lab.agent_session",
           "machine": {}, "model": "/m/llama-1b", "preset": "llama-1b", "first": 20000, "turns": 8, "sessions": 3,
           "same_shapes": False, "settings": [setting, setting | {"name": "cudnn", "median_hot_prefill_ms": 84.0}]}
    (body,) = [b for t, b in sections(rendered(tmp_path, "h100", {"agent.json": doc})).items() if "agent's session" in t]
    assert "| products | 0.444 | 0.082 | 51 |" in body and "| cudnn | 0.444 | 0.082 | 84 |" in body


def test_the_cache_tiers_show_each_prompts_times_and_the_read_back_where_measured(tmp_path):
    size = {"tokens": 20480, "kv_bytes": 640 * 2**20, "cold_s": 0.39, "hot_s": 0.059, "ssd_disk_s": 0.619,
            "ssd_cached_s": 0.302, "ssd_disk_restore_gbs": 1.27, "ssd_cached_restore_gbs": 3.25}
    doc = {"kind": "cache", "date": "2026-01-01 10:00:00 UTC", "command": "tierlm bench cache", "machine": {},
           "model": "/m/llama-1b", "sizes": [size | {"preload_s": 0.66, "preloaded_s": 0.082}],
           "disk": {"read_gbs": 1.4, "page_cache_gbs": 5.65}}
    older = doc | {"date": "2025-01-01 10:00:00 UTC", "sizes": [size]}  # before the read-back was measured
    (body,) = [b for t, b in sections(rendered(tmp_path, "h100", {"new.json": doc, "old.json": older})).items()
               if "prefix cache's tiers" in t]
    assert "| 20480 | 640 MiB | 0.39 s | 0.059 s | 0.619 s | 0.302 s | 1.27 GB/s | 3.25 GB/s | 0.66 s, 0.082 s |" in body
    assert "kept as data: `old.json`" in body


def test_kv_qualitys_table_says_when_answers_are_one_token_repeated():
    """Answers of end-of-text tokens only (the GPU's broken 8-bit attention once)
    are named as broken, not read as a quality figure."""
    from types import SimpleNamespace

    from bench_lab import kv_quality

    good = [SimpleNamespace(token_ids=[5, 6, 7], logprobs=None), SimpleNamespace(token_ids=[9], logprobs=None)]
    broken = [SimpleNamespace(token_ids=[0] * 8, logprobs=None), SimpleNamespace(token_ids=[9], logprobs=None)]
    assert kv_quality.degenerate(good) == 0 and kv_quality.degenerate(broken) == 1
    row = {"prompts": 2, "equal_alone": 1, "equal_batched": 1, "median_first_difference": 0,
           "max_logprob_move": 0.0}
    result = {"bits": {"8": row | {"degenerate": kv_quality.compare(broken, good)["degenerate"]}},
              "degenerate_16_bit": 0}
    assert "1 at 8: the attention is broken" in kv_quality.table(result)
    assert "Degenerate" not in kv_quality.table({"bits": {"8": row | {"degenerate": 0}}, "degenerate_16_bit": 0})
