"""The package's layers, read from the source: every import of every module under kvferry/
(module level, inside functions and under TYPE_CHECKING alike, parsed with ast, nothing
imported) goes to a lower layer or stays in its own unit. That rules out package cycles.
The benchmarks (kvferry_bench/, beside kvferry/) sit above all of it: the engine never
imports them; only `kvferry bench` hands its arguments over, inside its handler."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvferry"

# Lowest first. A unit is a subpackage or a top-level module of kvferry; units in one layer
# must not import each other. `kvferry` itself (its __init__) and the command line, which
# dispatches to everything, sit above all of them.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "errors",  # the typed errors every layer raises
        "cpu_features ports cache_dir process_name process_exit",
        "json_flags",  # options given as JSON objects, with errors naming the flag
        "kv",  # KV specs, layouts, allocators: the vocabulary both halves share
        # request options sampling_params holds (limits, grammars); speculative decoding's config and rules
        "constraint_params structured spec_decode",
        "config sampling_params",
        "messages",  # what crosses layers: requests, finish reasons, runner and connector outputs
        "outputs",  # the public result types
        "model scheduler",
        "connector",  # scheduler half (scheduler types) and worker half (forward context)
        "worker",
        "executor",
        "engine",
        "entrypoints",
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


def imports_of(path: Path, root: Path, imported: str = "kvferry") -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the package `imported` in the file at `path`."""
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
    return [(line, name) for line, name in found if name == imported or name.startswith(f"{imported}.")]


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


BENCH_PACKAGE = "kvferry_bench"
# The one import of the benchmarks from the engine's tree: `kvferry bench`'s handler.
BENCH_DISPATCH = ("kvferry/entrypoints/cli.py", "kvferry_bench.cli")


def lines_inside_functions(tree: ast.Module) -> set[int]:
    return {
        inner.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Import | ast.ImportFrom)
    }


def bench_imports(root: Path = ROOT) -> list[str]:
    """Every import of the benchmarks under `root`, as 'file: module', '(module level)' added
    where it runs on import."""
    found = []
    for path in sorted(root.rglob("*.py")):
        in_functions = lines_inside_functions(ast.parse(path.read_text(), str(path)))
        for line, target in imports_of(path, root, BENCH_PACKAGE):
            where = "" if line in in_functions else " (module level)"
            found.append(f"{path.relative_to(root.parent)}: {target}{where}")
    return found


def test_the_engine_imports_the_benchmarks_only_in_the_bench_command():
    assert bench_imports() == [": ".join(BENCH_DISPATCH)]
    assert not (ROOT / "bench").exists()


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "engine/x.py",
            "def f():\n    from kvferry_bench import serve\n",
            "kvferry/engine/x.py: kvferry_bench",
        ),
        ("entrypoints/cli.py", "import kvferry_bench.cli\n", "kvferry_bench.cli (module level)"),
    ],
)
def test_an_import_of_the_benchmarks_is_reported(tmp_path, path, source, expected):
    root = tmp_path / "kvferry"
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(source)
    [found] = bench_imports(root)
    assert found.startswith(expected) or found.endswith(expected)


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


# ---- seams inside the layers ---------------------------------------------------------------

# What the rest of the package may import from the scheduler: the Scheduler itself (the
# engine core), Request (connectors' scheduler halves), what it expects of a connector, and
# what a router must share with it: the KV event types the engine publishes and the block
# hash a router recomputes (one function, never re-implemented). Its block pool, KV cache manager and step bookkeeping are its own; the messages it hands
# on live in messages/ and the null-block rule in kv/null_block.py.
SCHEDULER_SURFACE = frozenset(
    {
        "kvferry.scheduler.scheduler",
        "kvferry.scheduler.request",
        "kvferry.scheduler.interfaces",
        "kvferry.scheduler.kv_events",
        "kvferry.scheduler.hashing",
    }
)

# The null-block rule's names: defined in kv/null_block.py alone.
NULL_BLOCK_RULE = frozenset({"NULL_BLOCK_ID", "NO_NULL_BLOCK", "null_block_id", "usable_block_ids"})
NULL_BLOCK_HOME = "kvferry/kv/null_block.py"

NIXL_PACKAGE = "kvferry.connector.nixl"
# Outside connector/nixl/, who may know the NixlConnector by name, and why.
NIXL_AWARE: dict[str, str] = {
    "kvferry/connector/factory.py": "the built-in registry names the class by its module path (a string)",
    "kvferry/entrypoints/disagg.py": "the P/D launcher: starts NixlConnector instances, wires their side channels",
}


def kvferry_files(root: Path = ROOT) -> list[Path]:
    """Every module of the package, benchmarks aside (they drive whole deployments, NIXL too)."""
    return [p for p in sorted(root.rglob("*.py")) if "bench" not in p.relative_to(root).parts]


def nixl_option_names() -> frozenset[str]:
    """The keys of the NixlConnector's kv_connector_extra_config, read from its settings,
    less those another connector has as its own (the offload connector's `layerwise`)."""
    from kvferry.connector.nixl.metadata import NixlSettings
    from kvferry.connector.offload.config import KNOWN_KEYS

    return frozenset(NixlSettings.__dataclass_fields__) - KNOWN_KEYS


def words_of(path: Path) -> set[str]:
    """Identifiers, attribute and keyword names, and string constants (docstrings aside) of a file."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.add(node.value)
    return found


def seam_violations(root: Path = ROOT, nixl_options: frozenset[str] = frozenset()) -> list[str]:
    """Imports and names that cross the seams above, as 'file: what'."""
    found = []
    for path in kvferry_files(root):
        rel = str(path.relative_to(root.parent))
        in_scheduler = rel.startswith("kvferry/scheduler/")
        in_nixl = rel.startswith("kvferry/connector/nixl/")
        for line, target in imports_of(path, root):
            if (
                target.startswith("kvferry.scheduler.")
                and not in_scheduler
                and target not in SCHEDULER_SURFACE
            ):
                found.append(f"{rel}:{line}: imports the scheduler's own {target}")
            if target.startswith(NIXL_PACKAGE) and not in_nixl and rel not in NIXL_AWARE:
                found.append(f"{rel}:{line}: imports {target}")
        if rel != NULL_BLOCK_HOME:
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                defined = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defined = [t.id for t in targets if isinstance(t, ast.Name)]
                found += [
                    f"{rel}:{node.lineno}: restates the null-block rule ({name})"
                    for name in defined
                    if name in NULL_BLOCK_RULE
                ]
        if not in_nixl and rel not in NIXL_AWARE:
            words = words_of(path)
            named = sorted(w for w in words if w in nixl_options or "Nixl" in w or NIXL_PACKAGE in w)
            found += [f"{rel}: names the NixlConnector's {w!r}" for w in named]
    return found


def test_the_seams_hold():
    assert seam_violations(nixl_options=nixl_option_names()) == []


def test_the_nixl_option_names_are_read_from_its_settings():
    assert {"engine_id", "side_channel_host", "side_channel_port", "secret_file"} <= nixl_option_names()


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        # SchedulerOutput read from where the scheduler used to keep it
        ("engine/x.py", "from kvferry.scheduler.output import SchedulerOutput\n", "scheduler's own"),
        # a connector reaching into the block pool for the null block
        ("connector/x.py", "from kvferry.scheduler.block_pool import null_block_id\n", "scheduler's own"),
        # the null-block rule stated a second time
        ("scheduler/x.py", "NULL_BLOCK_ID = 0\n", "restates the null-block rule"),
        (
            "engine/x.py",
            "def usable_block_ids(n):\n    return list(range(n))\n",
            "restates the null-block rule",
        ),
        # the generic command line knowing NIXL's options or modules
        ("entrypoints/cli.py", "extra = {'side_channel_host': host}\n", "'side_channel_host'"),
        (
            "entrypoints/cli.py",
            "def f():\n    from kvferry.connector.nixl import serving\n",
            "imports kvferry",
        ),
        ("engine/x.py", "if issubclass(cls, NixlConnector):\n    pass\n", "'NixlConnector'"),
    ],
)
def test_a_crossed_seam_is_reported(tmp_path, path, source, expected):
    root = tmp_path / "kvferry"
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(source)
    (root / "kv").mkdir(exist_ok=True)
    (root / "kv" / "null_block.py").write_text("NULL_BLOCK_ID = 0\n")
    (root / "connector" / "nixl").mkdir(parents=True, exist_ok=True)
    (root / "connector" / "nixl" / "serving.py").write_text("extra = {'side_channel_host': 'h'}\n")
    [found] = seam_violations(root, frozenset({"side_channel_host"}))
    assert expected in found and found.startswith(f"kvferry/{path}")


# ---- launchers and proxy without torch or transformers ----------------------------------

# What the launchers and the proxy do before any engine starts: parse the command line, check
# the connector `kvferry disagg` will hand its instances (importing its class), build the proxy.
# None of it needs torch or transformers (seconds of CPU each, paid by every deployment's
# launcher): torch is imported by the engine side alone, and the types the front end shares
# with it (kvferry.config, kvferry.kv.spec, the connector base) name torch only for type checking.
FRONT_END_STEPS = """
import sys
from kvferry.entrypoints.cli import build_parser
from kvferry.entrypoints.disagg import check_connector
from kvferry.entrypoints.proxy.app import build_app
from kvferry.entrypoints.proxy.main import config_from_args
parser = build_parser()
check_connector(parser.parse_args(["disagg", "some-model"]))
build_app(config_from_args(parser.parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d"])))
print(" ".join(sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers"})))
"""


def heavy_imports_of_the_front_end(steps: str = FRONT_END_STEPS) -> list[str]:
    """The heavy packages a fresh interpreter has imported after `steps`."""
    done = subprocess.run(
        [sys.executable, "-c", steps], capture_output=True, text=True, cwd=ROOT.parent, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_launchers_and_the_proxy_import_neither_torch_nor_transformers():
    found = heavy_imports_of_the_front_end()
    assert found == [], f"{found} imported; `python -X importtime -c 'import ...'` names the chain"


def test_a_front_end_step_that_imports_torch_is_reported():
    steps = "import sys, types\nsys.modules['torch'] = types.ModuleType('torch')\n" + FRONT_END_STEPS
    assert heavy_imports_of_the_front_end(steps) == ["torch"]
