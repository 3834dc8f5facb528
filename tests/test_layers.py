"""The package's imports point downwards only, as the design lays out its rooms:
read from the source (every import, at module level or inside a function),
no room imports one above it, and the four API adapters import nothing from
each other, only the shared parts of tierlm.api."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "tierlm"
ADAPTERS = ("openai", "anthropic", "responses", "ollama", "rerank")

# top to bottom: a room may import the rooms below it
LAYERS = [
    ("tierlm",),  # the package's __init__: the Python API's names, from llm
    ("cli", "llm"),
    ("distributed",),
    ("bench",),
    ("api.app",),
    tuple(f"api.{a}" for a in ADAPTERS),
    ("api",),
    ("admin",),
    ("loadgen",),
    ("serving",),
    ("pool",),
    ("structured",),
    ("engine",),
    ("cache", "models"),
    ("backends",),
    ("settings_watch",),
    ("config",),
]


def room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tierlm":
        return None
    if len(parts) == 1:
        return "tierlm"
    if parts[1] == "api" and len(parts) > 2 and (parts[2] in ADAPTERS or parts[2] == "app"):
        return f"api.{parts[2]}"
    return parts[1]


def imports() -> list[tuple[str, str, str]]:
    """(importing room, imported room, file) for every import of tierlm in tierlm."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                inner = [f"{node.module}.{a.name}" for a in node.names]  # `from tierlm import backends`
                names = [n for n in inner if _is_module(n)] or [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            targets = {room(n) for n in names if _is_module(n)} - {None, room(module)}
            found += [(room(module), target, str(path.relative_to(PACKAGE))) for target in targets]
    return found


def _is_module(name: str) -> bool:
    """Whether `name` is a module or package of tierlm (not a name inside one)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_room_is_in_a_layer():
    rooms = {r for r, _, _ in imports()} | {t for _, t, _ in imports()}
    assert rooms <= {r for layer in LAYERS for r in layer}


def test_imports_point_downwards():
    level = {r: i for i, layer in enumerate(LAYERS) for r in layer}
    upward = sorted(f"{path}: {src} -> {dst}" for src, dst, path in imports() if level[dst] <= level[src])
    assert upward == []


def test_the_adapters_import_nothing_from_each_other():
    crossed = sorted(f"{path}: {src} -> {dst}" for src, dst, path in imports()
                     if src.startswith("api.") and dst.startswith("api.") and "api.app" not in (src, dst))
    assert crossed == []
