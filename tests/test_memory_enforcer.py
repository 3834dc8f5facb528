"""Many models, one memory budget: the memory enforcer (soft and hard marks) and
the engine's prefill-eviction hook, on real servers over tiny random models.

The process's memory cannot be made to cross a mark for real in a test: the
enforcer's servers here read it from a file the test writes
(TIERLM_TEST_MEMORY_FILE, tierlm.pool.enforcer). That reading is the only thing
faked; the pool, the engines, the HTTP routes and the clients are real. The
prefill hook needs no fake: a small --memory-limit makes a long prompt fit only
once another model's weights are gone.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from conftest import start_server, stop_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tierlm.models.random_model import PRESETS, make_random_model

pytestmark = pytest.mark.slow  # servers of their own under memory marks

ASK = [{"role": "user", "content": "Name three colours."}]
GiB = 2**30
LOW, ABOVE_SOFT, ABOVE_HARD = 1 * GiB, 80 * GiB, 200 * GiB  # against marks of 64 GB and 96 GB


def models(srv) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(srv.v1 + "/models").json()["data"]}


def load(srv, name: str) -> None:
    assert httpx.post(srv.v1 + f"/models/{name}/load", timeout=60).status_code == 200


# ---- the enforcer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def enforced(tmp_path_factory, model_path):
    root = tmp_path_factory.mktemp("enforcer")
    for name in ("tiny0", "tiny1", "tiny2"):
        make_random_model("tiny", root / "models" / name, model_path, "float32")
    memory = root / "memory"
    memory.write_text(str(LOW))
    srv = start_server(root / "models" / "tiny0", root / "server.log", "--model-dir", str(root / "models"),
                       "--no-ssd-cache", "--keep-alive=-1", "--memory-soft-mark", "64GB",
                       "--memory-hard-mark", "96GB", env={"TIERLM_TEST_MEMORY_FILE": str(memory)})
    srv.memory = memory
    yield srv
    stop_server(srv)


def set_memory(srv, value: int) -> None:
    srv.memory.write_text(str(value))


def waiting_for_memory(srv) -> float:
    """How many requests wait out the pause now (/metrics)."""
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "tierlm:requests_waiting_for_memory")


def test_soft_mark_unloads_idle_models_and_new_requests_wait_until_memory_drops(enforced):
    load(enforced, "tiny1")
    load(enforced, "tiny2")
    set_memory(enforced, ABOVE_SOFT)
    try:
        wait_until(lambda: all(models(enforced)[n]["state"] == "available" for n in ("tiny1", "tiny2")))
        assert models(enforced)["tiny0"]["state"] == "pinned", "a pinned model stays"
        log = enforced.log()
        assert "above the soft mark" in log and "unloading tiny1: process memory" in log
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(lambda: enforced.client().chat.completions.create(
                model="tiny0", messages=ASK, max_tokens=4, temperature=0))
            # it reached the pool, past everything that comes before a model is lent, and waits there
            wait_until(lambda: waiting_for_memory(enforced) == 1)
            assert not reply.done(), "a new request waits while memory is above the soft mark"
            set_memory(enforced, LOW)
            assert reply.result(timeout=60).usage.completion_tokens > 0
        assert waiting_for_memory(enforced) == 0
        assert "new requests start again" in enforced.log()
    finally:
        set_memory(enforced, LOW)


def _stream_raw(srv, model: str, lines: list[str]) -> None:
    """A streamed chat completion read line by line into `lines` (the raw SSE)."""
    body = {"model": model, "messages": ASK, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)


def test_hard_mark_ends_requests_in_flight_with_an_error_and_the_server_goes_on(enforced):
    load(enforced, "tiny1")
    lines: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_raw, enforced, "tiny1", lines)
        whole = pool.submit(lambda: httpx.post(enforced.v1 + "/chat/completions", timeout=60, json={
            "model": "tiny1", "messages": ASK, "max_tokens": 4000, "ignore_eos": True}))
        wait_until(lambda: models(enforced)["tiny1"]["in_flight"] == 2 and len(lines) > 3)
        set_memory(enforced, ABOVE_HARD)
        try:
            streamed.result(timeout=60)
            answer = whole.result(timeout=60)
        finally:
            set_memory(enforced, LOW)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "hard mark" in error["message"], error
    assert answer.status_code == 503 and "hard mark" in answer.json()["error"]["message"]
    assert "above the hard mark" in enforced.log() and "aborted 2 request(s) of tiny1" in enforced.log()
    wait_until(lambda: "new requests start again" in enforced.log())
    reply = enforced.client().chat.completions.create(model="tiny1", messages=ASK, max_tokens=4)
    assert reply.usage.completion_tokens > 0, "the server serves again once memory is back down"


# ---- the prefill-eviction hook --------------------------------------------------


# a random llama with small weights (~18 MB) and 32 KiB of KV per token: a few
# hundred prompt tokens make a request of tens of MB against a 100 MB limit
KV_HEAVY = {**PRESETS["tiny"], "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
            "head_dim": 64}
# prompt tokens: the request (its KV three times over while its blocks are stored,
# plus a chunk's scratch: ~104 KiB a token) fits the 100 MB limit beside the
# model's own 17 MiB of weights, not beside another's: between ~600 and ~760
LONG = 680


@pytest.fixture(scope="module")
def hooked(tmp_path_factory, model_path):
    root = tmp_path_factory.mktemp("hook")
    for name in ("a", "b"):
        make_random_model(KV_HEAVY, root / "models" / name, model_path, "float32")
    config = root / "settings.toml"
    config.write_text("")
    # without AMX's bfloat16 copies, which only some CPUs make, the weights are the same size everywhere
    srv = start_server(root / "models" / "a", root / "server.log", "--model-dir", str(root / "models"),
                       "--config", str(config), "--no-ssd-cache", "--keep-alive=-1", "--memory-limit", "100MB",
                       "--no-cpu-amx")
    srv.config = config
    yield srv
    stop_server(srv)


def long_prompt(srv, token: int):
    return srv.client().completions.create(model="a", prompt=[token] * LONG, max_tokens=1, temperature=0)


def test_a_prefill_that_does_not_fit_unloads_an_idle_model_first(hooked):
    load(hooked, "b")
    assert models(hooked)["b"]["state"] == "loaded"
    reply = long_prompt(hooked, 5)
    assert reply.usage.prompt_tokens == LONG
    assert models(hooked)["b"]["state"] == "available"
    assert "unloading b: a request to a needs" in hooked.log()


def test_with_the_other_model_pinned_the_prefill_is_refused(hooked):
    hooked.config.write_text('[models."b"]\npinned = true\n')
    wait_until(lambda: models(hooked)["b"]["state"] in ("pinned", "available") and "settings reloaded" in hooked.log())
    load(hooked, "b")
    assert models(hooked)["b"]["state"] == "pinned"
    with pytest.raises(openai.BadRequestError) as e:
        long_prompt(hooked, 6)
    assert e.value.body["code"] == "memory_limit" and "memory limit of" in e.value.body["message"]
    assert models(hooked)["b"]["state"] == "pinned", "a pinned model is never unloaded for a request"
    assert hooked.client().completions.create(model="a", prompt=[7] * 20, max_tokens=2).usage.completion_tokens
