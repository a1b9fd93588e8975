"""The package's layers, read from the source: every import of every module under kvferry/
(module level, inside functions and under TYPE_CHECKING alike, parsed with ast, nothing
imported) goes to a lower layer or stays in its own unit. That rules out package cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvferry"

# Lowest first. A unit is a subpackage or a top-level module of kvferry; units in one layer
# must not import each other. `kvferry` itself (its __init__) and the command line, which
# dispatches to everything (benchmarks included), sit above all of them.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "errors cpu_features ports",
        "kv",  # KV specs, layouts, allocators: the vocabulary both halves share
        "config sampling_params",
        "messages",  # what crosses layers: requests, finish reasons, runner and connector outputs
        "outputs",  # the public result types
        "model scheduler",
        "connector",  # scheduler half (scheduler types) and worker half (forward context)
        "worker",
        "executor",
        "engine",
        "entrypoints",
        "bench",
        "kvferry entrypoints.cli",
    )
)

# Known exceptions, by file and unit imported, each with its reason; keep this short.
ALLOWED: set[tuple[str, str]] = set()


def unit_of(module: str) -> str:
    """The layering unit of a dotted module name under kvferry."""
    parts = module.split(".")[1:]
    if parts[:2] == ["entrypoints", "cli"]:
        return "entrypoints.cli"
    return parts[0] if parts else "kvferry"


def rank(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"kvferry unit {unit!r} is in no layer of tests/test_layering.py: place it")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every kvferry import in the file at `path`."""
    module = module_name(path, root)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "kvferry" or name.startswith("kvferry.")]


def violations(root: Path = ROOT) -> list[str]:
    """Every import that goes up or sideways between units, as 'file:line: a -> b'."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = unit_of(module_name(path, root))
        for line, target in imports_of(path, root):
            dest = unit_of(target)
            allowed = (str(path.relative_to(root.parent)), dest) in ALLOWED
            if dest != source and rank(dest) >= rank(source) and not allowed:
                found.append(f"{path.relative_to(root.parent)}:{line}: {source} -> {dest} ({target})")
    return found


def test_every_kvferry_import_goes_down_the_layers():
    assert violations() == []


def test_every_unit_is_placed_in_a_layer():
    units = {unit_of(module_name(p, ROOT)) for p in ROOT.rglob("*.py")}
    for unit in units:
        rank(unit)
    assert {"kv", "scheduler", "worker", "engine", "messages", "outputs"} <= units


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        # the scheduler reaching up into the engine
        ("scheduler/x.py", "from kvferry.engine.core import EngineCore\n", "scheduler -> engine"),
        # the public outputs reaching into the worker, lazily inside a function
        ("outputs.py", "def f():\n    import kvferry.worker.sampler\n", "outputs -> worker"),
        # a cycle: kv importing config, which imports kv
        ("kv/x.py", "from kvferry.config import CacheConfig\n", "kv -> config"),
        # siblings in one layer, relative and under TYPE_CHECKING
        (
            "model/x.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..scheduler import request\n",
            "model -> scheduler",
        ),
    ],
)
def test_an_upward_import_is_reported(tmp_path, path, source, expected):
    root = tmp_path / "kvferry"
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(source)
    (root / "kv").mkdir(exist_ok=True)
    (root / "kv" / "fine.py").write_text("from kvferry.errors import ConfigError\n")
    [found] = violations(root)
    assert expected in found and found.startswith(f"kvferry/{path}:")
