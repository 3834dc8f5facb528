"""A bug answers a 500 in the error shape, whole, on a connection the client can
use again; a bug mid-stream ends the stream with an error event and [DONE].

The bugs are injected (a fault we cannot cause for real once validation is
right) into a real server running in this process on a loopback port.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from tierlm.api.app import create_app
from tierlm.bench.servers import free_port
from tierlm.config import Settings
from tierlm.engine.core import EngineCore
from tierlm.serving.served_model import ServedModel

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app_url(model_path):
    settings = Settings(ssd_cache=False, model_dir=str(model_path.parent / ".none"), hf_cache=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, model_path), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    yield url
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def buggy_requests(monkeypatch):
    """A bug in making the engine's request, for requests with seed 666."""
    real = ServedModel.make_request

    def make_request(self, prefix, tokens, body, *args, **kwargs):
        if body.seed == 666:
            raise RuntimeError("injected bug")
        return real(self, prefix, tokens, body, *args, **kwargs)

    monkeypatch.setattr(ServedModel, "make_request", make_request)


def test_a_500_leaves_the_keep_alive_connection_usable(app_url, buggy_requests):
    with httpx.Client(base_url=app_url + "/v1", timeout=60) as client:
        statuses = []
        for i in range(20):
            r = client.post("/chat/completions", json={"messages": MSG, "max_tokens": 2, "temperature": 0,
                                                       "seed": 666 if i % 2 == 0 else 1})
            statuses.append(r.status_code)
            if r.status_code == 500:
                error = r.json()["error"]
                assert error["code"] == "internal_error" and "RuntimeError" in error["message"]
                assert r.headers.get("connection", "").lower() != "close"
        pool = client._transport._pool
        assert len(pool.connections) == 1  # one connection served all twenty
    assert statuses == [500, 200] * 10


def test_a_bug_mid_stream_ends_with_an_error_event_and_done(app_url, monkeypatch):
    real = EngineCore.stream_outputs

    async def broken_after_one(self, request, keepalive_s=None):
        outputs = real(self, request, keepalive_s)
        try:
            yield await anext(outputs)
            raise RuntimeError("injected bug mid-stream")
        finally:
            await outputs.aclose()

    monkeypatch.setattr(EngineCore, "stream_outputs", broken_after_one)
    with httpx.Client(base_url=app_url + "/v1", timeout=60) as client:
        body = {"messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert '"internal_error"' in lines[-2]
        monkeypatch.undo()
        ok = client.post("/chat/completions", json={"messages": MSG, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


def test_health_says_degraded_while_steps_keep_failing_and_recovers(app_url, monkeypatch):
    """A fault we cannot cause for real: every model step (mlx-lm's) raises."""
    from mlx_lm.generate import BatchGenerator

    def broken(self):
        raise RuntimeError("injected step fault")

    monkeypatch.setattr(BatchGenerator, "next", broken)
    with httpx.Client(base_url=app_url, timeout=60) as client:
        body = {"messages": MSG, "max_tokens": 2, "temperature": 0}
        for _ in range(3):  # --degrade-after-failures' default
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and "injected step fault" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "injected step fault" in health.json()["detail"]
        monkeypatch.undo()
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.get("/health").status_code == 200
