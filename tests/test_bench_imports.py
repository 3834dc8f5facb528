"""The benchmark harness imports downward: no module of tierlm/bench imports one
that imports it back, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import tierlm.bench

BENCH = Path(tierlm.bench.__file__).parent


def bench_imports() -> dict[str, set[str]]:
    """Each bench module's name -> the bench modules it imports, anywhere in it."""
    modules = {p.stem for p in BENCH.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        found: set[str] = set()
        for node in ast.walk(ast.parse((BENCH / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tierlm.bench":
                found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierlm.bench."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("tierlm.bench."))
        graph[name] = found - {name}
    return graph


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
    assert {"cli", "compare", "runs", "docs", "servers"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert "cli" not in set().union(*graph.values())  # the command line is the top: nothing imports it


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_random_model_factory_and_server_starting_sit_below_the_harness():
    """Tests and benchmarks share them, so they import nothing of the harness's top."""
    factory = Path(tierlm.__file__).parent / "models" / "random_model.py"
    assert "tierlm.bench" not in factory.read_text()
    assert bench_imports()["servers"] == set()
