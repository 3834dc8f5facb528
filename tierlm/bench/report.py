"""Tables (rich, and markdown for the docs) and JSON for benchmark results."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tierlm.loadgen.metrics import geometric_mean_se

console = Console(stderr=True)


def ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.1f}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def pairs_cell(ratios: list[float]) -> str:
    """The pairs' geometric mean ± its standard error: the machine's speed moves
    from one run to the next, and this says how far the mean can be trusted."""
    mean, se = geometric_mean_se(ratios)
    return "-" if math.isnan(mean) else f"{num(mean, 3)} ± {num(se, 3)}"


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


SERVE_COLUMNS = [
    ("req/s", lambda s: num(s["requests_s"], 2)),
    ("out tok/s", lambda s: num(s["output_tok_s"])),
    ("TTFT p50", lambda s: ms(s["ttft_s"]["p50"])),
    ("TTFT p90", lambda s: ms(s["ttft_s"]["p90"])),
    ("TTFT p99", lambda s: ms(s["ttft_s"]["p99"])),
    ("TPOT p50", lambda s: ms(s["tpot_s"]["p50"])),
    ("TPOT p90", lambda s: ms(s["tpot_s"]["p90"])),
    ("TPOT p99", lambda s: ms(s["tpot_s"]["p99"])),
    ("ITL p50", lambda s: ms(s["itl_s"]["p50"])),
    ("ITL p99", lambda s: ms(s["itl_s"]["p99"])),
    ("E2E p50", lambda s: ms(s["e2e_s"]["p50"])),
    ("E2E p99", lambda s: ms(s["e2e_s"]["p99"])),
    ("out/req", lambda s: num(s["mean_output_tokens"])),
    ("fail", lambda s: str(s["failed"])),
]


def serve_rows(runs: list[dict], label_keys: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    header = list(label_keys) + [name for name, _ in SERVE_COLUMNS]
    rows = [[str(run[k]) for k in label_keys] + [f(run["summary"]) for _, f in SERVE_COLUMNS] for run in runs]
    return header, rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    out = Console()
    if not out.is_terminal:  # a log file: no wrapping at 80 columns
        out = Console(width=240)
    out.print(table)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """Yields a callback to call once per finished request."""
    if not enabled:
        yield lambda _record=None: None
        return
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total, failed=0)
        failed = 0

        def done(record=None) -> None:
            nonlocal failed
            failed += bool(record is not None and not record.ok)
            progress.update(task, advance=1, failed=failed)

        yield done


# The instruction sets the CPU kernels (tierlm's, MLX's, llama.cpp's ggml) choose
# between: each result says which of them this CPU has, present or not.
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi",
                "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> dict:
    """The first CPU's fields of /proc/cpuinfo ("model name", "cpu family", "flags", ...);
    empty where there is no such file."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends here
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_features() -> dict[str, bool]:
    """CPU_FEATURES, each present or not, and whether the CPU runs under a hypervisor
    (a VM may report flags it does not carry out); empty where /proc/cpuinfo is not."""
    flags = set(_cpuinfo().get("flags", "").split())
    if not flags:
        return {}
    return {f: f in flags for f in CPU_FEATURES} | {"hypervisor": "hypervisor" in flags}


def cpu_cap() -> str | None:
    """TIERLM_MAX_CPU_ISA when set below the CPU's own features ("avx2", ...):
    tierlm's native kernels then run as on a smaller CPU, so a figure taken
    under it must say so. None when unset or "native"."""
    value = os.environ.get("TIERLM_MAX_CPU_ISA", "").strip()
    return value if value.lower() not in ("", "native") else None


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        info["cpus"] = os.cpu_count()
        cpu = _cpuinfo()
        if cpu.get("model name"):
            info["cpu"] = cpu["model name"]
        if "cpu family" in cpu:  # a VM's model name may say little ("AMD EPYC")
            info["cpu_id"] = (f"{cpu.get('vendor_id', '?')} family {cpu['cpu family']} "
                              f"model {cpu.get('model', '?')}")
        if features := cpu_features():
            info["cpu_features"] = features
        if cap := cpu_cap():
            info["max_cpu_isa"] = cap  # the features above are the CPU's; tierlm's kernels used fewer
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (OSError, ValueError):
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            info["gpu"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("mlx", "mlx-lm", "tierlm"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    info["git"] = os.environ.get("TIERLM_BENCH_GIT")  # for trees copied without .git
    try:
        info["git"] = (
            info["git"]
            or subprocess.run(
                ["git", "describe", "--always", "--dirty"],  # -dirty: uncommitted changes ran
                check=False,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def cpu_flags() -> str:
    """The vector flags of this machine's CPU that the CPU kernels use: every AMX
    and AVX-512 flag, and AVX2, FMA, F16C, AVX-VNNI; and TIERLM_MAX_CPU_ISA when set."""
    flags = set(_cpuinfo().get("flags", "").split())
    if not flags:
        return "?"
    wanted = sorted(
        f for f in flags if f.startswith(("amx", "avx512", "avx_vnni")) or f in ("avx2", "fma", "f16c")
    )
    capped = f" (tierlm's kernels under TIERLM_MAX_CPU_ISA={cap})" if (cap := cpu_cap()) else ""
    return (" ".join(wanted) or "no avx2, no avx512, no amx") + capped


def write_json(path: str | Path, kind: str, data: dict, command: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "kind": kind,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "machine": machine_info(),
        **({"environment": environment} if (environment := run_environment()) else {}),
        **data,
    }
    path.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return path


SECRET_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def run_environment() -> dict[str, str]:
    """The MLX_* and TIERLM_* variables set for this run (the servers it starts
    inherit them: MLX_USE_CUDA_GRAPHS=0 and =1 are two different runs), but
    for secrets (an API key)."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(("MLX_", "TIERLM_")) and not any(part in name for part in SECRET_PARTS)}


def _jsonable(x):
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "__dict__"):
        return x.__dict__
    return str(x)
