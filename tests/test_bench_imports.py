"""The benchmark harness imports downward: no module of tierlm/bench (what users
run) or of bench_lab (the lab's instruments) imports one that imports it back,
counting imports inside functions too. The user harness never imports the lab,
and nothing else in tierlm imports either (the command line's parser aside): the
server and the dashboard load neither."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import bench_lab
import tierlm
import tierlm.bench

BENCH = Path(tierlm.bench.__file__).parent
LAB = Path(bench_lab.__file__).parent
PACKAGE = Path(tierlm.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (a from-import's names too, as
    they may be modules)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def package_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """Each module of a flat package -> the modules of the same package it imports."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        found = {m.split(".")[len(package.split("."))] for m in imported_modules(folder / f"{name}.py")
                 if m.startswith(package + ".")}
        graph[name] = (found & modules) - {name}
    return graph


def bench_imports() -> dict[str, set[str]]:
    return package_imports(BENCH, "tierlm.bench")


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_bench_modules_import_each_other_without_a_cycle():
    graph = bench_imports()
    assert {"cli", "compare", "runs", "servers", "engine_overhead",
            "cache_bench", "agents_bench"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert "cli" not in set().union(*graph.values())  # the command line is the top: nothing imports it


def test_the_lab_modules_import_each_other_without_a_cycle():
    graph = package_imports(LAB, "bench_lab")
    assert {"docs", "streaming", "constrained", "soak", "models_bench", "roofline",
            "make_model"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_random_model_factory_and_server_starting_sit_below_the_harness():
    """Tests and benchmarks share them, so they import nothing of the harness's top."""
    factory = PACKAGE / "models" / "random_model.py"
    assert "tierlm.bench" not in factory.read_text()
    assert bench_imports()["servers"] == set()


def test_what_users_run_never_imports_the_lab():
    users = {p.name: imported_modules(p) for p in BENCH.glob("*.py")}
    assert not {name for name, mods in users.items() if any(m.split(".")[0] == "bench_lab" for m in mods)}


def test_nothing_else_in_tierlm_imports_the_harness_or_the_lab():
    """Counting imports inside functions: the dashboard's benchmark runs tierlm.loadgen.
    tierlm/cli.py alone may, for `tierlm bench`'s parser."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if BENCH in path.parents or path == PACKAGE / "cli.py":
            continue
        bad = {m for m in imported_modules(path) if m.startswith(("tierlm.bench", "bench_lab"))}
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not offenders


@pytest.mark.parametrize("module", ["tierlm.api.app", "tierlm.admin.dashboard"])
def test_the_server_and_the_dashboard_load_neither(module):
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['tierlm', 'bench'] "
            "or m.split('.')[0] == 'bench_lab'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
