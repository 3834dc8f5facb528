"""`tierlm bench compare` against llama-server (issue #33), without starting either
server: its arguments, the servers' commands (the same threads for both), where
the GGUF comes from, the chat prompts (each its own from the template's first
tokens on), the long-prompt, memory and machine records and their tables."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tierlm.bench import compare, report, runs, servers
from tierlm.bench.cli import add_bench_parser
from tierlm.loadgen.workloads import CHAT_OPENING, TokenSoup


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "compare", *argv])


def model_folder(tmp_path: Path, gguf_name: str = "m-q4_k_m.gguf") -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    config = {"model_type": "qwen2", "quantization": {"bits": 8, "group_size": 32},
              "gguf": {"file": gguf_name, "tensor_types": {"Q4_K": 12}}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_issue_33_command_gives_both_servers_the_same_threads_and_room_for_the_long_prompt(tmp_path):
    folder = model_folder(tmp_path)
    gguf, binary = tmp_path / "m.gguf", tmp_path / "llama-server"
    gguf.write_bytes(b"GGUF")
    binary.write_bytes(b"")
    args = parse("--model", str(folder), "--gguf", str(gguf), "--llama-server", str(binary),
                 "--servers", "tierlm,llama", "--workload", "chat", "--concurrency", "1,4,16",
                 "--output-len", "64", "--ttft-prompt-len", "2048", "--threads", "3",
                 "--llama-args", "--poll 0")
    assert (args.ttft_prompt_len, args.ttft_requests, args.ttft_output_len) == (2048, 5, 4)
    tierlm, llama = compare.server_specs(args, runs.concurrencies(args.concurrency))

    assert tierlm.threads == llama.threads == 3
    assert tierlm.env == {"TIERLM_NATIVE_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    cmd = llama.cmd
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "3"
    assert cmd[cmd.index("-m") + 1] == str(gguf) and cmd[-2:] == ["--poll", "0"]
    assert "--jinja" in cmd  # the GGUF's own chat template, as tierlm renders its import's
    slots = int(cmd[cmd.index("-np") + 1])
    assert slots == 16 and int(cmd[cmd.index("-c") + 1]) // slots >= 2048 + 4 + 64

    described = compare.describe_server(llama)
    assert described["threads"] == 3 and described["gguf"] == {"path": str(gguf), "bytes": 4}
    assert compare.model_config(folder)["gguf"]["file"] == "m-q4_k_m.gguf"


def test_threads_default_to_the_cpus_this_process_may_use(tmp_path):
    args = parse("--model", str(model_folder(tmp_path)), "--servers", "tierlm")
    (spec,) = compare.server_specs(args, [1])
    assert spec.threads == servers.cpu_count() == len(os.sched_getaffinity(0))


def test_the_gguf_is_the_one_the_folder_was_imported_from(tmp_path, monkeypatch):
    folder = model_folder(tmp_path)
    monkeypatch.setattr(servers, "CACHE", tmp_path / "cache")
    with pytest.raises(SystemExit, match="no model tierlm pulls ships"):
        servers.gguf_for(folder)
    cached = tmp_path / "cache" / "gguf" / "m-q4_k_m.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert servers.gguf_for(folder) == cached
    inside = folder / "m.gguf"  # one kept in the folder wins
    inside.write_bytes(b"GGUF")
    assert servers.gguf_for(folder) == inside
    (folder / "config.json").write_text("{}")
    inside.unlink()
    with pytest.raises(SystemExit, match="pass --gguf"):
        servers.gguf_for(folder)


def test_a_pulled_model_is_found_by_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_MODEL_DIR", str(tmp_path))
    folder = model_folder(tmp_path)
    assert servers.model_folder("m") == folder
    assert servers.model_folder(str(folder)) == folder
    with pytest.raises(SystemExit, match="qwen2.5-coder-0.5b"):
        servers.model_folder("no-such-model")


@pytest.mark.slow  # Qwen2.5-Coder's tokenizer loaded for a benchmark's prompts
def test_chat_prompts_share_no_more_than_the_templates_first_tokens(qwen_path):
    """The real template of the model issue #33 benchmarks: llama-server's slots
    reuse the longest common prefix of the prompt before, so two prompts must part
    right after `<|im_start|>system\\n` (no default system prompt in common)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    args = parse("--workload", "chat", "--input-len", "64", "--num-prompts", "3", "--ttft-prompt-len", "300",
                 "--ttft-requests", "2")
    workload = runs.build_workload(args, str(qwen_path), 1)
    long = runs.long_prompt_workload(args, str(qwen_path))
    assert workload.name == long.name == "chat" and long.params["input_len"] == 300
    requests = [r for w in (workload, long) for s in w.sessions for r in s]
    assert len(requests) == 5 and all(r.prompt is None for r in requests)
    assert [m["role"] for m in requests[0].messages] == ["system", "user"]

    tok = load_tokenizer(qwen_path)
    prompts = [list(tok.apply_chat_template(r.messages, add_generation_prompt=True)) for r in requests]
    soup = TokenSoup(qwen_path)
    for r in requests:
        assert soup.count(r.messages[0]["content"]) == CHAT_OPENING
        assert soup.count(r.messages[0]["content"]) + soup.count(r.messages[1]["content"]) == r.input_tokens

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    shared = max(common(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:])
    assert shared <= 4, shared


def stream_summary(tok_s: float, ttft: float) -> dict:
    pct = {"p50": ttft, "p90": ttft, "p99": ttft}
    return {"requests_s": 1.0, "output_tok_s": tok_s, "ttft_s": pct, "tpot_s": pct, "itl_s": pct, "e2e_s": pct,
            "mean_output_tokens": 64.0, "failed": 0, "completed": 2, "prompt_tokens": 4122, "cached_tokens": 6}


def test_medians_keep_the_long_prompt_runs_apart():
    results = [
        {"server": "tierlm", "concurrency": 1, "phase": "streams", "summary": stream_summary(20.0, 0.1)},
        {"server": "tierlm", "concurrency": 1, "phase": "long-prompt", "summary": stream_summary(1.0, 2.0)},
        {"server": "tierlm", "concurrency": 1, "phase": "long-prompt", "summary": stream_summary(1.0, 4.0)},
        {"server": "llama-server", "concurrency": 1, "summary": stream_summary(40.0, 0.2)},  # a file of before
        {"server": "llama-server", "concurrency": 1, "phase": "long-prompt", "summary": stream_summary(1.0, 1.0)},
    ]
    names = ["tierlm", "llama-server"]
    table = compare.medians(results, names, [1])
    assert table["tierlm@1"]["ttft_p50"] == 0.1 and table["llama-server@1"]["output_tok_s"] == 40.0
    long = compare.long_prompt_medians(results, names)
    assert long["tierlm"]["ttft_p50"] == 3.0 and long["llama-server"]["ttft_p50"] == 1.0
    assert long["tierlm"]["mean_prompt_tokens"] == 2061 and long["tierlm"]["mean_cached_tokens"] == 3
    header, rows = compare.long_prompt_rows(long, names)
    assert rows == [["tierlm", "2061", "3000.0", "3000.0", "3", "0", ""],
                    ["llama-server", "2061", "1000.0", "1000.0", "3", "0", "3.00"]]


def test_memory_is_each_servers_median_over_its_starts():
    def start(name, load_mib, end_mib):
        mem = {"rss_bytes": end_mib * 2**20, "rss_anon_bytes": 2**20, "rss_file_bytes": 2**20,
               "peak_rss_bytes": end_mib * 2**20}
        return {"server": name, "memory_after_load": {"rss_bytes": load_mib * 2**20}, "memory_end": mem}

    starts = [start("tierlm", 500, 700), start("tierlm", 700, 900), start("llama-server", 400, 450)]
    memory = compare.memory_medians(starts, ["tierlm", "llama-server", "mlx_lm.server"])
    assert memory["tierlm"]["after_load"] == 600 * 2**20 and memory["tierlm"]["end"] == 800 * 2**20
    assert memory["mlx_lm.server"]["end"] is None  # no start of it: nothing measured, not nan
    _, rows = compare.memory_rows(memory, ["tierlm", "llama-server"])
    assert rows == [["tierlm", "600", "800", "1", "1", "800"], ["llama-server", "400", "450", "1", "1", "450"]]


def test_a_process_and_its_children_are_measured():
    """A process with one child of its own (the test process may have any number:
    the suite's shared servers are its children)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); print('ready', flush=True);"
                               " time.sleep(60)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        mem = servers.process_memory(parent.pid)
        assert mem["processes"] == 2 and mem["rss_bytes"] > 0
        assert mem["rss_bytes"] <= mem["peak_rss_bytes"]
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert servers.process_memory(2**22 + 12345) == {}  # past pid_max: no such process


def test_every_result_names_the_cpus_features():
    features = report.cpu_features()
    if not features:
        pytest.skip("no /proc/cpuinfo")
    assert set(report.CPU_FEATURES) | {"hypervisor"} == set(features)
    assert report.machine_info()["cpu_features"] == features
    flags = report.cpu_flags().split()
    assert {f for f, on in features.items() if on and f != "hypervisor"} <= set(flags)


def test_a_result_taken_under_a_max_cpu_isa_says_so(monkeypatch):
    """/proc/cpuinfo says what the CPU has; under TIERLM_MAX_CPU_ISA tierlm's
    kernels used less, and the machine's record and the flags say which cap."""
    monkeypatch.setenv("TIERLM_MAX_CPU_ISA", "avx2")
    assert report.machine_info()["max_cpu_isa"] == "avx2"
    assert report.cpu_flags().endswith(" (tierlm's kernels under TIERLM_MAX_CPU_ISA=avx2)")
    for unset in ("native", ""):
        monkeypatch.setenv("TIERLM_MAX_CPU_ISA", unset)
        assert "max_cpu_isa" not in report.machine_info() and "TIERLM_MAX_CPU_ISA" not in report.cpu_flags()


def test_llama_servers_build_switches_are_read_from_its_cmake_cache(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "CMakeCache.txt").write_text("GGML_AVX512:BOOL=ON\nGGML_AMX_TILE:BOOL=OFF\n"
                                            "GGML_NATIVE:BOOL=OFF\nLLAMA_CURL:BOOL=OFF\nGGML_AVX2:STRING=x\n")
    assert servers.llama_build(tmp_path / "bin" / "llama-server") == {
        "GGML_AVX512": "ON", "GGML_AMX_TILE": "OFF", "GGML_NATIVE": "OFF"}
    assert servers.llama_build(tmp_path / "bin" / "bin" / "llama-server") == {}


def test_requests_name_the_model_tierlm_was_started_with(tmp_path):
    """tierlm's /v1/models lists every model in its folders (its default first):
    the bench names the one its /health names, whatever a listing's order."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"status": "ok", "model": "qwen2.5-coder-0.5b-instruct"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        spec = servers.ServerSpec("tierlm", [], ready_path="/health")
        running = servers.RunningServer(spec, port=httpd.server_address[1], log_dir=tmp_path)
        assert running.served_model_id() == "qwen2.5-coder-0.5b-instruct"
        spec.model_id = "named"
        assert running.served_model_id() == "named"
    finally:
        httpd.shutdown()
