"""Server options through a real server: API key, SSE keep-alives before the
first token (OpenAI's comments, the Messages API's pings), stream_interval; and
the settings layers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import openai
import pytest
from conftest import start_server, stop_server, wait_until

from tierlm.config import load_settings, parse_size

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def keyed_server(model_path, tmp_path_factory):
    """One request at a time (so that one can be made to wait), one step per
    hand-off (so that only stream_interval groups tokens)."""
    srv = start_server(model_path, tmp_path_factory.mktemp("opts") / "server.log", "--api-key", "s3cret",
                       "--sse-keepalive-s", "0.05", "--stream-interval", "4", "--no-prefix-cache",
                       "--max-concurrent-requests", "1",
                       "--decode-burst-ms", "0", "--decode-burst-ms-batched", "0")
    yield srv
    stop_server(srv)


def test_api_key_is_required(keyed_server):
    with pytest.raises(openai.AuthenticationError) as e:
        keyed_server.client(api_key="wrong").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.get(keyed_server.v1 + "/models")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in keyed_server.client(api_key="s3cret").models.list().data] == [MODEL]
    assert httpx.get(keyed_server.base_url + "/health").status_code == 200


AUTH = {"Authorization": "Bearer s3cret"}


def is_content(line: str) -> bool:
    return line.startswith("data:") and '"content": "' in line and '"role"' not in line


def test_keepalive_comments_until_the_first_token(keyed_server):
    """A stream whose first token is held up gets keep-alive comments meanwhile.
    It is held up for as long as the test wants: the server's one slot is taken
    by a long generation until the waiting stream has had its keep-alive."""
    blocker = {"model": MODEL, "stream": True, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
               "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    body = {"model": MODEL, "stream": True, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat after me: " + "all work and no play " * 150}]}
    lines = []

    def waiting_stream():
        with httpx.stream("POST", keyed_server.v1 + "/chat/completions", json=body, timeout=120,
                          headers=AUTH) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)

    with httpx.stream("POST", keyed_server.v1 + "/chat/completions", json=blocker, timeout=120,
                      headers=AUTH) as r:
        next(line for line in r.iter_lines() if is_content(line))  # it holds the slot, decoding
        waiting = threading.Thread(target=waiting_stream)
        waiting.start()
        wait_until(lambda: any(line.startswith(": keep-alive") for line in lines))
        assert not any(is_content(line) for line in lines)
    waiting.join(timeout=120)  # closing the long stream aborted it: the slot is free
    assert not waiting.is_alive()
    first_content = next(i for i, line in enumerate(lines) if is_content(line))
    assert any(line.startswith(": keep-alive") for line in lines[:first_content])
    assert lines[-1] == "data: [DONE]"


def test_stream_interval_groups_tokens(keyed_server):
    client = keyed_server.client(api_key="s3cret")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=17, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage.completion_tokens == 17
    # the first token at once, then groups of 4: 1 + 4 + 4 + 4 + 4
    assert len(content) <= 5


def test_settings_layers(tmp_path, monkeypatch):
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text('port = 9001\nmax_concurrent_requests = 3\nlog_level = "debug"\n')
    monkeypatch.setenv("TIERLM_CONFIG", str(settings_file))
    monkeypatch.setenv("TIERLM_MAX_CONCURRENT_REQUESTS", "5")
    monkeypatch.setenv("TIERLM_PREFIX_CACHE", "false")
    s = load_settings({"log_level": "warning"})
    assert (s.port, s.max_concurrent_requests, s.log_level, s.prefix_cache) == (9001, 5, "warning", False)
    settings_file.write_text("no_such_option = 1\n")
    with pytest.raises(ValueError):
        load_settings({})


def test_sizes():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("25%", total=400) == 100
    with pytest.raises(ValueError):
        parse_size("lots")


def test_health_probes_stay_out_of_the_access_log(server, client):
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=1)
    health = httpx.get(server.base_url + "/health")
    # ready; on the CPU nothing is warmed (MLX's CPU backend compiles nothing per shape)
    assert health.status_code == 200 and health.json()["warming"] is False
    assert health.json()["preloading"] is False  # its SSD folder was empty, read back at once
    log = server.log()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log  # the access log is on
    assert "GET /health" not in log  # though the fixture polled it until the model was up


@pytest.fixture(scope="module")
def slow_prefill_server(model_path, tmp_path_factory):
    """Prefill in chunks of 64 tokens, each step made 0.1 s slower (a test-only
    setting): a prompt of several hundred tokens takes over a second before its
    first token, far over the 0.05 s between keep-alives, however fast the machine."""
    srv = start_server(model_path, tmp_path_factory.mktemp("slow-prefill") / "server.log", "--sse-keepalive-s",
                       "0.05", "--prefill-step-size", "64", "--no-prefix-cache", "--no-ssd-cache",
                       env={"TIERLM_TEST_STEP_DELAY_S": "0.1"})
    yield srv
    stop_server(srv)


@pytest.mark.slow  # a server of its own, a slowed prefill
def test_keepalive_comments_while_a_long_prompt_prefills(slow_prefill_server):
    """A 750-token prompt: keep-alive comments all through its prefill."""
    body = {"model": MODEL, "stream": True, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat after me: " + "all work and no play " * 150}]}
    with httpx.stream("POST", slow_prefill_server.v1 + "/chat/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    first_content = next(i for i, line in enumerate(lines) if is_content(line))
    assert sum(line.startswith(": keep-alive") for line in lines[:first_content]) >= 5
    assert lines[-1] == "data: [DONE]"


@pytest.mark.slow  # a server of its own, a slowed prefill
def test_pings_while_a_long_prompt_prefills(slow_prefill_server):
    """The Messages API's keep-alive: the server says it is alive (pings every
    --sse-keepalive-s) while it computes a prompt that is not cached."""
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(120))
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "system": system + " Ping test.",
            "messages": [{"role": "user", "content": "Hello there " * 300}]}
    names = []
    with httpx.stream("POST", slow_prefill_server.base_url + "/v1/messages", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        names = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and "ping" in names[1:names.index("content_block_start")]


def test_compiled_kernels_are_kept_in_the_kernel_folder_unless_mlx_is_told_another(monkeypatch, tmp_path):
    from tierlm.backends import keep_compiled_kernels

    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    keep_compiled_kernels("~/kernels-here")
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(Path.home() / "kernels-here")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    keep_compiled_kernels("~/kernels-here")
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path)


def test_cuda_graphs_are_off_unless_the_setting_or_mlx_says_otherwise(monkeypatch):
    """MLX reads MLX_USE_CUDA_GRAPHS once, at its first kernel: the server and
    tierlm.LLM set it from the `cuda_graphs` setting (default off) before the
    model loads; a value MLX is already given wins."""
    from tierlm.backends import choose_cuda_graphs
    from tierlm.config import Settings

    assert Settings().cuda_graphs is False
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    choose_cuda_graphs(Settings().cuda_graphs)
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "0"
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    choose_cuda_graphs(True)
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1"
    choose_cuda_graphs(False)
    assert os.environ["MLX_USE_CUDA_GRAPHS"] == "1"
