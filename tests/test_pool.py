"""Many models in one server: a real server over a folder of tiny random-weight
models (and the default model), through the official `openai` client and HTTP."""

from __future__ import annotations

import concurrent.futures
import shutil
import signal

import httpx
import openai
import pytest
from conftest import start_server, stop_server, wait_until

from tierlm.models.random_model import make_random_model
from tierlm.pool.discovery import discover, folders_signature, read_entry
from tierlm.pool.pool import ModelPool

ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, model_path):
    """tiny0 (the server's default), tiny1, tiny2: the same small random llama,
    each in a folder of its own; `huge`: a folder whose weights on disk are far
    beyond any budget here."""
    root = tmp_path_factory.mktemp("pool")
    for name in ("tiny0", "tiny1", "tiny2"):
        make_random_model("tiny", root / "models" / name, model_path, "float32")
    huge = make_random_model("tiny", root / "models" / "huge", model_path, "float32")
    with open(huge / "model-00002.safetensors", "wb") as f:  # sparse: on disk, it claims its size
        f.truncate(64 * 2**30)
    (root / "models" / "notes").mkdir()  # not a model: skipped
    return root


@pytest.fixture(scope="module")
def pool_server(models_dir):
    config = models_dir / "settings.toml"
    config.write_text("")
    srv = start_server(models_dir / "models" / "tiny0", models_dir / "server.log",
                       "--model-dir", str(models_dir / "models"), "--config", str(config), "--no-ssd-cache",
                       "--keep-alive=-1")
    srv.config = config
    yield srv
    stop_server(srv)
    # after loads and unloads of several models (their workers reused), SIGTERM ends it
    # cleanly: uvicorn shuts the app down, then dies of the signal it caught, as it means
    # to; never an abort from MLX's threads at exit
    assert srv.process.returncode == -signal.SIGTERM, srv.log()[-2000:]
    assert "terminate called" not in srv.log()


def models(srv) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(srv.v1 + "/models").json()["data"]}


def ask(srv, model: str, **kw):
    kw.setdefault("max_tokens", 8)
    return srv.client().chat.completions.create(model=model, messages=ASK, temperature=0, **kw)


def reload_settings(srv, text: str, check) -> None:
    srv.config.write_text(text)
    wait_until(check, timeout=60)


def test_every_model_is_listed_with_its_state(pool_server):
    listed = models(pool_server)
    assert set(listed) == {"tiny0", "tiny1", "tiny2", "huge"}
    assert list(listed) == ["tiny0", "huge", "tiny1", "tiny2"]  # the default first ("huge" sorts first by name)
    assert listed["tiny0"]["state"] == "pinned"  # the default: loaded at start, kept
    assert listed["tiny1"]["state"] in ("available", "loaded")
    assert listed["tiny1"]["max_model_len"] == 131072 and listed["tiny1"]["size_bytes"] > 0
    assert "notes: skipped, not a model folder" in pool_server.log()


def test_a_request_loads_its_model(pool_server):
    unload(pool_server, "tiny1")
    assert models(pool_server)["tiny1"]["state"] == "available"
    reply = ask(pool_server, "tiny1")
    assert reply.model == "tiny1" and reply.usage.completion_tokens > 0
    assert models(pool_server)["tiny1"]["state"] == "loaded"


def test_unknown_model_is_a_404_naming_the_models(pool_server):
    with pytest.raises(openai.NotFoundError) as e:
        ask(pool_server, "gpt-5")
    assert "tiny0" in e.value.body["message"] and e.value.body["param"] == "model"


def test_too_large_is_a_507_and_the_server_goes_on(pool_server):
    with pytest.raises(openai.APIStatusError) as e:
        ask(pool_server, "huge")
    assert e.value.status_code == 507 and "huge" in e.value.body["message"]
    assert ask(pool_server, "tiny0").usage.completion_tokens > 0


def test_concurrent_first_requests_load_once(pool_server):
    unload(pool_server, "tiny2")
    before = pool_server.log().count("loading tiny2")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: ask(pool_server, "tiny2"), range(4)))
    assert all(r.model == "tiny2" for r in replies)
    assert pool_server.log().count("loading tiny2") == before + 1


@pytest.fixture(scope="module")
def real_models(pool_server, model_path, gemma_path):
    """SmolLM2 (`smol`) and Gemma 3 270M imported from its K-quants (`gemma`),
    linked into the server's model folder: found when first asked for."""
    folder = pool_server.config.parent / "models"
    for name, path in (("smol", model_path), ("gemma", gemma_path)):
        if not (folder / name).exists():
            (folder / name).symlink_to(path)
    return ("smol", "gemma")


@pytest.mark.slow  # two-model comparisons, Gemma pulled
def test_each_model_answers_as_it_does_alone(pool_server, real_models):
    """SmolLM2 and Gemma 3 270M in one server: asked in turn while both are
    loaded, each answers exactly as it did while it was the only one of the two
    loaded (greedy, 12 tokens)."""
    def answer(name: str) -> str:
        reply = ask(pool_server, name, max_tokens=12)
        assert reply.model == name and reply.usage.completion_tokens > 0
        return reply.choices[0].message.content

    alone = {}
    for name, other in (real_models, real_models[::-1]):
        unload(pool_server, other)
        alone[name] = answer(name)
    got = {name: [] for name in real_models}
    for _ in range(2):
        for name in real_models:
            got[name].append(answer(name))
    states = models(pool_server)
    assert states["smol"]["state"] == states["gemma"]["state"] == "loaded"
    assert got == {name: [text, text] for name, text in alone.items()}
    unload(pool_server, "gemma")  # the tests after this one budget for small models


@pytest.mark.slow  # more loads
def test_keep_alive_zero_unloads_after_the_request(pool_server):
    ask(pool_server, "tiny1", extra_body={"keep_alive": 0})
    wait_until(lambda: models(pool_server)["tiny1"]["state"] == "available", timeout=60)
    ask(pool_server, "tiny1", extra_body={"keep_alive": "4s"})  # long enough to be listed still loaded
    pool_listing = httpx.get(pool_server.base_url + "/stats").json()["models"]  # idle_s is there too
    listed = next(m for m in pool_listing if m["name"] == "tiny1")
    assert 0 < listed["expires_in_s"] <= 4
    # counted from the request's end, however late the listing came (both rounded to 0.1 s)
    assert listed["idle_s"] + listed["expires_in_s"] == pytest.approx(4, abs=0.11)
    wait_until(lambda: models(pool_server)["tiny1"]["state"] == "available", timeout=60)


@pytest.mark.slow  # settings-file reloads
def test_aliases_and_patterns_from_the_settings_file_apply_without_a_restart(pool_server):
    reload_settings(pool_server, '[models."tiny2"]\naliases = ["claude-*haiku*", "side"]\n',
                    lambda: "settings reloaded" in pool_server.log())
    assert ask(pool_server, "claude-3-5-haiku-20241022").model == "tiny2"
    assert ask(pool_server, "side").model == "tiny2"
    seen, errors = pool_server.log().count("settings reloaded"), pool_server.log().count("ERROR")
    reload_settings(pool_server, "this is not toml [", lambda: pool_server.log().count("ERROR") > errors)
    assert ask(pool_server, "side").model == "tiny2", "the last good settings stay"
    reload_settings(pool_server, "", lambda: pool_server.log().count("settings reloaded") > seen)
    with pytest.raises(openai.NotFoundError):
        ask(pool_server, "side")


@pytest.mark.slow  # more loads
def test_eviction_under_a_budget_that_fits_one_more_model(pool_server):
    """The budget holds the pinned default and one other: asking for a second
    evicts the least recently used idle one; the pinned one stays."""
    for name in ("tiny1", "tiny2", "smol"):
        unload(pool_server, name)
    ask(pool_server, "tiny0")
    per_model = models(pool_server)["tiny0"]["memory_bytes"]
    budget = int(per_model * 2.5)
    reload_settings(pool_server, f"max_model_memory = {budget}\n", lambda: _reloaded_budget(pool_server, budget))
    ask(pool_server, "tiny1")
    ask(pool_server, "tiny2")
    states = {n: m["state"] for n, m in models(pool_server).items()}
    assert states["tiny0"] == "pinned" and states["tiny2"] == "loaded" and states["tiny1"] == "available"
    assert "unloading tiny1: to make room for tiny2" in pool_server.log()
    reload_settings(pool_server, "", lambda: _reloaded_budget(pool_server, None))  # the default budget again


@pytest.mark.slow  # a long stream
def test_unload_waits_for_requests_in_flight_or_aborts_them(pool_server):
    client = pool_server.client()
    ask(pool_server, "tiny1")
    chunks = []

    def read_stream():
        stream = client.chat.completions.create(model="tiny1", messages=ASK, max_tokens=4000, stream=True,
                                                extra_body={"ignore_eos": True})
        chunks.extend(stream)  # chunk by chunk, as they come

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(read_stream)
        # a few tokens streamed; 4000 take seconds, so the unload comes first even on a loaded
        # machine (400 could all stream out before it arrived: a flaky "length")
        wait_until(lambda: len(chunks) > 3 or stream.done(), timeout=60)
        unloaded = httpx.post(pool_server.v1 + "/models/tiny1/unload", params={"force": True}, timeout=60)
        stream.result(timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "available"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] != "length", "the stream ended early, with a reason, not silence"


@pytest.mark.slow  # more loads
def test_a_model_copied_in_or_deleted_while_serving_is_listed_or_gone(pool_server, models_dir):
    folder = models_dir / "models"
    shutil.copytree(folder / "tiny1", folder / "tiny3")
    shutil.copytree(folder / "tiny1", folder / "tiny4")
    listed = models(pool_server)  # no request named them: the listing looked again
    assert {"tiny3", "tiny4"} <= set(listed) and listed["tiny3"]["state"] == "available"
    assert ask(pool_server, "tiny3").model == "tiny3"

    shutil.rmtree(folder / "tiny3")  # loaded: it serves on from memory, listed
    shutil.rmtree(folder / "tiny4")  # not loaded: gone at once
    with pytest.raises(openai.NotFoundError) as e:
        ask(pool_server, "tiny4")
    assert e.value.body["code"] == "model_not_found"
    listed = models(pool_server)
    assert "tiny4" not in listed and listed["tiny3"]["state"] == "loaded"
    assert ask(pool_server, "tiny3").usage.completion_tokens > 0

    unload(pool_server, "tiny3")  # now it goes
    assert "tiny3" not in models(pool_server)
    assert httpx.get(pool_server.v1 + "/models/tiny3").status_code == 404
    with pytest.raises(openai.NotFoundError):
        ask(pool_server, "tiny3")


def test_refresh_keeps_the_default_under_its_own_name(models_dir, tmp_path):
    """The default model served under another name (--served-model-name) from a
    folder the pool also looks through: a refresh never adds that folder again
    under the folder's name (it would load the same weights twice)."""
    folder = tmp_path / "models"
    shutil.copytree(models_dir / "models" / "tiny1", folder / "tiny1")
    default = read_entry(folder / "tiny1", "my-name")
    pool = ModelPool({"my-name": default}, factory=None, budget_bytes=2**30, keep_alive_s=lambda name: None,
                     default="my-name", rediscover=lambda: discover([folder], False),
                     folders_signature=lambda: folders_signature([folder], False))
    pool.refresh()
    assert set(pool.slots) == {"my-name"}
    shutil.copytree(folder / "tiny1", folder / "tiny5")
    pool.refresh()
    assert set(pool.slots) == {"my-name", "tiny5"}
    shutil.rmtree(folder / "tiny1")  # the default's folder: its slot stays, to say so when it loads
    shutil.rmtree(folder / "tiny5")
    pool.refresh()
    assert set(pool.slots) == {"my-name"}


def test_load_and_unload_by_name(pool_server):
    assert httpx.post(pool_server.v1 + "/models/tiny2/load", timeout=60).json()["state"] == "loaded"
    assert httpx.post(pool_server.v1 + "/models/tiny2/unload", timeout=60).json()["state"] == "available"
    pinned = httpx.post(pool_server.v1 + "/models/tiny0/unload", timeout=60)
    assert pinned.status_code == 409


def unload(srv, name: str) -> None:
    response = httpx.post(srv.v1 + f"/models/{name}/unload", timeout=60)
    assert response.status_code in (200, 404), response.text


def _reloaded_budget(srv, budget) -> bool:
    stats = httpx.get(srv.base_url + "/stats").json()
    return stats["budget_bytes"] == budget if budget is not None else stats["budget_bytes"] > 2**30


@pytest.mark.slow  # two command-line processes
def test_ps_and_list_show_the_models(pool_server, models_dir):
    import subprocess
    import sys

    ask(pool_server, "tiny1")
    port = pool_server.base_url.rsplit(":", 1)[1]
    ps = subprocess.run([sys.executable, "-m", "tierlm.cli", "ps", "--port", port], check=False,
                        capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0 and "tiny0" in ps.stdout and "pinned" in ps.stdout and "tiny1" in ps.stdout
    listed = subprocess.run([sys.executable, "-m", "tierlm.cli", "list", "--model-dir",
                             str(models_dir / "models"), "--no-hf-cache"], check=False,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and all(n in listed.stdout for n in ("tiny0", "tiny1", "tiny2", "huge"))


@pytest.mark.slow  # settings-file reloads
def test_per_model_defaults_apply_without_a_restart(pool_server):
    seen = pool_server.log().count("settings reloaded")
    reload_settings(pool_server, '[models."tiny1"]\ndefault_max_tokens = 3\ncontext_limit = 64\n',
                    lambda: pool_server.log().count("settings reloaded") > seen)
    client = pool_server.client()
    reply = client.chat.completions.create(model="tiny1", messages=ASK, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny1", messages=[{"role": "user", "content": "word " * 80}])
    assert "64" in e.value.body["message"]
    reload_settings(pool_server, "", lambda: pool_server.log().count("settings reloaded") > seen + 1)


@pytest.mark.slow  # more loads
def test_a_models_tokenizer_and_turns_come_without_loading_it_and_a_load_reuses_them(models_dir, model_path):
    """turns_for (what /v1/messages/count_tokens asks): the model stays unloaded,
    its tokenizer encodes as mlx-lm's `load` makes it; a load then uses the same
    tokenizer and turns, and they outlive its unload."""
    import asyncio

    from mlx_lm import load

    from tierlm.config import Settings
    from tierlm.serving.assembly import make_pool
    from tierlm.serving.errors import APIError
    from tierlm.serving.leases import turns_for

    settings = Settings(model_dir=str(models_dir / "models"), hf_cache=False, ssd_cache=False)
    pool = make_pool(settings, None)
    _, expected = load(str(model_path))

    async def run():
        with pytest.raises(APIError) as e:
            await turns_for(pool, "gpt-5")
        assert e.value.status == 404 and "tiny1" in str(e.value)
        entry, turns, model_settings = await turns_for(pool, "tiny1")
        assert entry.name == "tiny1" and pool.slots["tiny1"].served is None
        assert model_settings.keep_alive == settings.for_model("tiny1").keep_alive
        text = "Name three colours, please."
        assert turns.tokenizer.encode(text) == expected.encode(text)
        assert turns.tokenizer.eos_token_ids == expected.eos_token_ids
        assert (await turns_for(pool, "tiny1"))[1] is turns  # cached
        lease = await pool.acquire("tiny1")
        try:
            assert lease.served.turns is turns and lease.served.tokenizer is turns.tokenizer
            assert (await turns_for(pool, "tiny1"))[1] is lease.served.turns
        finally:
            lease.release()
            await pool.close()
        assert pool.slots["tiny1"].served is None and (await turns_for(pool, "tiny1"))[1] is turns

    asyncio.run(run())
