"""One model over two ranks on this machine: MLX's ring backend over loopback,
started by MLX's own launcher, as `tierlm serve` runs over several GPUs or
hosts. Rank 0 serves HTTP and decides every step; rank 1 holds the other half
of every layer (mlx-lm's tensor-parallel shard) and follows. Its answers are
one rank's; prefix hits, aborts and grammars work as on one; a rank that dies
ends every request with an error.

The model is a tiny random-weight llama, 4-bit as imported models are: what
these tests check (the shards' products, the ranks in step, each rank's half of
a cached block) does not need real weights, and a real model's load and steps
cost most of the module's time on CI's 2 cores. Quantized, its sharded layers
are mlx's QuantizedAllToShardedLinear and QuantizedShardedToAllLinear, which
the CPU backend must dequantize like whole ones where `auto` picks float32 (on
CPUs without AVX-512): two ranks' answers and log-probabilities are one rank's
there too."""

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
from tierlm.models.random_model import LLAMA

pytestmark = pytest.mark.slow  # two ranks over loopback and a server to compare with
MODEL = "tiny-llama-4bit"
# Heads (4, and 2 key-value) divide between two ranks; the layers split on their inputs
# (o_proj: 128, down_proj: 256) keep whole 64-wide groups on each rank. Its own lm_head:
# tied to the embedding, a random model writes its last token again and again.
TINY = {**LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False}
GROUP_SIZE, BITS = 64, 4
LAUNCHER = Path(sys.executable).parent / "mlx.launch"
SYSTEM = ("You are a careful assistant for a team that maintains a payroll service written in Python. "
          "Answer briefly, in plain sentences, and name the function you would change. ") * 3
# Random weights seldom sample the end-of-sequence token, but may: every answer runs its
# max_tokens (a grammar still ends its own); "stop string" gets its stop from one rank's answer
ASKED = {
    "plain": {"messages": [{"role": "user", "content": "Write a Python function that checks whether a number "
                                                       "is prime."}], "max_tokens": 12, "logprobs": True},
    "stop string": {"messages": [{"role": "user", "content": "List three colors, one per line."}],
                    "max_tokens": 24},
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
LONG = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 4000, "stream": True,
        "messages": [{"role": "user", "content": "Write a long essay about the history of computing."}]}


def body(name: str, **more) -> dict:
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, **ASKED[name], **more}


def ask(server: Server, request: dict) -> dict:
    resp = httpx.post(server.v1 + "/chat/completions", json=request, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def answer(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def logprobs(reply: dict) -> list[float]:
    return [entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]]


def a_stop_string_in(text: str) -> str:
    """A word the model does write: the first of `text` whose first place in it is
    past a third of it, so that the answer it stops is neither empty nor whole."""
    words = [w for w in text.split() if len(w) >= 3 and text.find(w) >= len(text) // 3]
    assert words, text
    return words[0]


def quantized_random_model(out: Path, tokenizer_dir: Path) -> Path:
    """A model folder of TINY's shapes with random weights, quantized as mlx-lm
    quantizes a model (its `quantization` in config.json, weights, scales and
    biases in model.safetensors), the embedding and lm_head too."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from tierlm.models.random_model import make_random_model

    make_random_model(TINY, out, tokenizer_dir=tokenizer_dir, dtype="float32")
    model, config = load_model(out)  # evaluated: model.safetensors can be written over
    model, config = quantize_model(model, config, group_size=GROUP_SIZE, bits=BITS)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


@pytest.fixture(scope="module")
def tiny_path(model_path, tmp_path_factory) -> Path:
    """Built once for the module; SmolLM2's tokenizer (`model_path`)."""
    return quantized_random_model(tmp_path_factory.mktemp("models") / MODEL, model_path)


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


def stop_ranks(server: Server) -> None:
    """The launcher and every rank. They share the launcher's process group (the
    server starts it in a session of its own; mlx.launch starts the ranks in its
    group): what is left of the group after stop_server's SIGTERM is killed, so
    that a rank that fails to stop cannot outlive the module."""
    stop_server(server)
    with contextlib.suppress(ProcessLookupError):  # nothing left: every rank ended on the SIGTERM
        os.killpg(server.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def one_rank(tiny_path, tmp_path_factory):
    """The same model on one rank, with what two ranks run too: MLX's own products
    (the CPU backend's kernels would replace the sharded layers'). Each question's
    request and one rank's reply; the stop string is a word of its answer without
    one."""
    folder = tmp_path_factory.mktemp("one-rank")
    srv = start_server(tiny_path, folder / "server.log", "--no-cpu-kernels", "--no-cpu-amx", "--no-ssd-cache")
    try:
        asked = {name: body(name) for name in ASKED}
        unstopped = answer(ask(srv, asked["stop string"]))
        asked["stop string"]["stop"] = [stop := a_stop_string_in(unstopped)]
        replies = {name: (request, ask(srv, request)) for name, request in asked.items()}
    finally:
        stop_server(srv)  # its answers are all the tests need
    stopped = replies["stop string"][1]
    assert answer(stopped) == unstopped[: unstopped.find(stop)], (unstopped, stop)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    return replies


@pytest.fixture(scope="module")
def two_ranks(tiny_path, tmp_path_factory):
    srv = start_ranks(tiny_path, tmp_path_factory.mktemp("two-ranks"))
    yield srv
    stop_ranks(srv)


def test_both_ranks_start_and_rank_0_serves(two_ranks):
    log = two_ranks.log()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log and "following rank 0" in log
    assert httpx.get(two_ranks.base_url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("name", ["plain", "stop string", "json schema", "seeded"])
def test_answers_over_two_ranks_are_one_ranks(two_ranks, one_rank, name):
    """Greedy (its log-probabilities too), a stop string and a JSON schema (the grammar
    runs on rank 0 alone; its tokens reach rank 1 inside the step), and a seeded sample."""
    request, expected = one_rank[name]
    reply = ask(two_ranks, request)
    assert answer(reply) == answer(expected)
    assert reply["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]
    if request.get("logprobs"):  # a shard computed otherwise (int8 products, say) moves them by 1e-3 and more
        assert logprobs(reply) == pytest.approx(logprobs(expected), abs=1e-4)


def test_a_prefix_computed_over_two_ranks_is_a_hit_on_both(two_ranks, one_rank):
    """Each rank keeps its own half of every block; the second question reads both
    halves back."""
    first = ask(two_ranks, one_rank["shared prefix 1"][0])
    second = ask(two_ranks, one_rank["shared prefix 2"][0])
    assert first["usage"]["prompt_tokens"] > 96
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert answer(first) == answer(one_rank["shared prefix 1"][1])
    assert answer(second) == answer(one_rank["shared prefix 2"][1])


def test_an_abort_mid_stream_leaves_the_ranks_in_step(two_ranks, one_rank):
    aborted = two_ranks.stats()["aborted_requests"]
    with httpx.stream("POST", two_ranks.v1 + "/chat/completions", json=LONG, timeout=120) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 4:
                break  # the client goes away: the request is aborted on every rank
    deadline = time.monotonic() + 30
    while two_ranks.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = two_ranks.stats()
    assert stats["running"] == 0
    assert stats["aborted_requests"] == aborted + 1  # ended by the abort, not by its max_tokens
    request, expected = one_rank["seeded"]
    assert answer(ask(two_ranks, request)) == answer(expected)


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
    API's shape (no hang, no clean finish), and rank 0 then stops on a SIGTERM
    (it once waited for ever to tell the dead rank to stop). Last: the module's
    ranks end here."""
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as streams:
        lines = [streams.enter_context(client.stream("POST", two_ranks.v1 + "/chat/completions", json=LONG))
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
    rank_0 = _rank_pid(two_ranks, 0)
    os.kill(rank_0, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _running(rank_0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(rank_0), two_ranks.log()[-2000:]


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
