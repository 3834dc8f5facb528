"""One model over two ranks on this machine: MLX's ring backend over loopback,
started by MLX's own launcher, as `tierlm serve` runs over several GPUs or
hosts. Rank 0 serves HTTP and decides every step; rank 1 holds the other half
of every layer (mlx-lm's tensor-parallel shard) and follows. Its answers are
one rank's; prefix hits, aborts and grammars work as on one; a rank that dies
ends every request with an error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import Server, start_server, stop_server

from tierlm.bench.servers import ServerSpec, free_port
from tierlm.models.loader import shard_model

pytestmark = pytest.mark.slow  # two ranks of a 0.5B model and a server to compare with
MODEL = "qwen2.5-coder-0.5b-instruct"
LAUNCHER = Path(sys.executable).parent / "mlx.launch"
SYSTEM = ("You are a careful assistant for a team that maintains a payroll service written in Python. "
          "Answer briefly, in plain sentences, and name the function you would change. ") * 3
ASKED = {
    "plain": {"messages": [{"role": "user", "content": "Write a Python function that checks whether a number "
                                                       "is prime."}], "max_tokens": 12},
    "stop string": {"messages": [{"role": "user", "content": "List three colors, one per line."}],
                    "max_tokens": 40, "stop": ["\n\n"]},
    "json schema": {"messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 16,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {
                        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                         "age": {"type": "integer"}},
                        "required": ["name", "age"], "additionalProperties": False}}}},
    "seeded": {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8,
               "temperature": 0.8, "seed": 7},
    "shared prefix 1": {"messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "Where would overtime be computed?"}],
                        "max_tokens": 8},
    "shared prefix 2": {"messages": [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "Where would taxes be withheld?"}],
                        "max_tokens": 8},
}


def ask(server: Server, name: str) -> dict:
    body = {"model": MODEL, "temperature": 0, **ASKED[name]}
    resp = httpx.post(server.v1 + "/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def answer(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def start_ranks(model_path: Path, folder: Path, timeout: float = 300) -> Server:
    """`mlx.launch -n 2 --backend ring -- tierlm serve ...`: both ranks on this machine."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [str(LAUNCHER), "-n", "2", "--backend", "ring", "--starting-port", str(free_port()), "--",
           sys.executable, "-m", "tierlm.cli", "serve", "--model", str(model_path), "--port", "{port}",
           "--model-dir", str(folder / "models"), "--ssd-cache-dir", str(folder / "ssd"),
           "--cache-block-size", "32"]
    (folder / "models").mkdir(exist_ok=True)
    spec = ServerSpec("tierlm-2-ranks", cmd, env={"HF_HUB_CACHE": str(folder / "hf-cache")}, ready_path="/health")
    return Server(spec, log_path=folder / "ranks.log").start(timeout)


@pytest.fixture(scope="module")
def one_rank(qwen_path, tmp_path_factory):
    """The same model on one rank, with what two ranks run too: MLX's own products
    (the CPU backend's kernels would replace the sharded layers')."""
    folder = tmp_path_factory.mktemp("one-rank")
    srv = start_server(qwen_path, folder / "server.log", "--no-cpu-kernels", "--no-cpu-amx", "--no-ssd-cache")
    try:
        return {name: ask(srv, name) for name in ASKED}
    finally:
        stop_server(srv)  # its answers are all the tests need


@pytest.fixture(scope="module")
def two_ranks(qwen_path, tmp_path_factory):
    srv = start_ranks(qwen_path, tmp_path_factory.mktemp("two-ranks"))
    yield srv
    stop_server(srv)


def test_both_ranks_start_and_rank_0_serves(two_ranks):
    log = two_ranks.log()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log and "following rank 0" in log
    assert httpx.get(two_ranks.base_url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("name", ["plain", "stop string", "json schema", "seeded"])
def test_answers_over_two_ranks_are_one_ranks(two_ranks, one_rank, name):
    """Greedy, a stop string and a JSON schema (the grammar runs on rank 0 alone; its
    tokens reach rank 1 inside the step), and a seeded sample."""
    assert answer(ask(two_ranks, name)) == answer(one_rank[name])


def test_a_prefix_computed_over_two_ranks_is_a_hit_on_both(two_ranks, one_rank):
    """Each rank keeps its own half of every block; the second question reads both
    halves back."""
    first = ask(two_ranks, "shared prefix 1")
    second = ask(two_ranks, "shared prefix 2")
    assert first["usage"]["prompt_tokens"] > 96
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert answer(first) == answer(one_rank["shared prefix 1"])
    assert answer(second) == answer(one_rank["shared prefix 2"])


def test_an_abort_mid_stream_leaves_the_ranks_in_step(two_ranks, one_rank):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 300, "stream": True,
            "messages": [{"role": "user", "content": "Write a long essay about the history of computing."}]}
    with httpx.stream("POST", two_ranks.v1 + "/chat/completions", json=body, timeout=120) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 4:
                break  # the client goes away: the request is aborted on every rank
    deadline = time.monotonic() + 30
    while two_ranks.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert two_ranks.stats()["running"] == 0
    assert answer(ask(two_ranks, "seeded")) == answer(one_rank["seeded"])


class _Ranks:
    """Stands for a group of two ranks: the check refuses before the group is used."""

    def size(self) -> int:
        return 2


def test_a_model_whose_heads_do_not_divide_among_the_ranks_is_refused(model_path):
    """SmolLM2-135M has 9 attention heads: two ranks cannot split them (a start-up
    error before any rank holds a wrong shard)."""
    from tierlm.models.random_model import build_model

    model = build_model(json.loads((model_path / "config.json").read_text()))
    with pytest.raises(ValueError, match="9 attention heads do not divide among 2 ranks"):
        shard_model(model, _Ranks())


def _rank_pid(server: Server, rank: int) -> int:
    found = re.search(rf"rank {rank} of 2 \(pid (\d+)\)", server.log())
    assert found, server.log()[-2000:]
    return int(found.group(1))


def test_a_rank_that_dies_ends_every_request_with_an_error(two_ranks):
    """Rank 1 killed while two streams run: each ends with an error event in the
    API's shape (no hang, no clean finish); the launcher then stops rank 0. Last:
    the module's ranks end here."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Write a long essay about the history of computing."}]}
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as streams:
        lines = [streams.enter_context(client.stream("POST", two_ranks.v1 + "/chat/completions", json=body))
                 .iter_lines() for _ in range(2)]
        for it in lines:  # both running
            while not next(it).startswith("data:"):
                pass
        os.kill(_rank_pid(two_ranks, 1), signal.SIGKILL)
        for it in lines:
            events = [json.loads(line[5:]) for line in it if line.startswith("data:") and "[DONE]" not in line]
            assert events and "error" in events[-1], events[-3:]
            assert events[-1]["error"]["type"] == "server_error"
            assert "out of step" in events[-1]["error"]["message"]
