"""Layering rules over kiln's own imports, module-level and function-level alike: no import cycles;
only the entry point imports kiln.cli; the contract (kiln.contract) imports nothing else of kiln;
the engines, the runtime and the server never import the compiler (kiln.compiler); the configs
import nothing from the runtime; and no module imports another package's private name.

The graph comes from parsing the source with `ast`, so a lazy (function-level) import counts as
much as a top-level one: it still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphlib

import pytest

import kiln

PACKAGE = Path(kiln.__file__).parent
ENTRY_POINTS = {"kiln.__main__"}       # the console script names kiln.cli:main itself


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """kiln modules that `path` imports anywhere in its body (a package import counts as its __init__)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the kiln modules it imports. NOTE: importing kiln.x.y also runs kiln.x's
    __init__, but only what a source names is an edge."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycles(graph):
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail("an import cycle among kiln modules: " + " -> ".join(e.args[1]))


def test_only_the_entry_point_imports_the_cli(graph):
    importers = {m for m, targets in graph.items() if "kiln.cli" in targets} - ENTRY_POINTS
    assert not importers, f"modules importing kiln.cli: {sorted(importers)}"


def test_configs_import_nothing_from_the_runtime(graph):
    reached = reachable(graph, "kiln.config")
    assert not {m for m in reached if m.startswith(("kiln.runtime", "kiln.serving", "kiln.cli"))}


def test_the_contract_imports_nothing_else_of_kiln(graph):
    outside = {(m, t) for m, targets in graph.items() if m.startswith("kiln.contract")
               for t in targets if not t.startswith("kiln.contract") and t != "kiln"}
    assert not outside, f"kiln.contract reaches above itself: {sorted(outside)}"


@pytest.mark.parametrize("layer", ["kiln.engines", "kiln.runtime", "kiln.serving"])
def test_load_and_run_code_never_imports_the_compiler(graph, layer):
    reached = {m for start in graph if start.startswith(layer) for m in reachable(graph, start)}
    compiler = sorted(m for m in reached if m.startswith("kiln.compiler"))
    assert not compiler, f"{layer} reaches the compiler: {compiler}"


def test_configs_reach_only_the_contract(graph):
    assert {m for m in reachable(graph, "kiln.config") if m.startswith("kiln.")} <= {
        m for m in graph if m.startswith("kiln.contract")} | {"kiln"}


# kiln.scale (Ray Serve) sits on top of the one-process server: it may use these, and nothing of
# kiln imports it back (kiln serve imports it lazily only through the CLI).
SCALE_MAY_IMPORT = ("kiln.scale", "kiln.runtime", "kiln.serving", "kiln.contract", "kiln.config", "kiln.tokenizer",
                    "kiln.units")


def test_scale_imports_only_the_layers_below_it(graph):
    imported = {t for m, targets in graph.items() if m.startswith("kiln.scale") for t in targets}
    outside = sorted(m for m in imported if m != "kiln" and not m.startswith(SCALE_MAY_IMPORT))
    assert not outside, f"kiln.scale imports {outside}"
    assert not any(m.startswith("kiln.compiler") for start in graph if start.startswith("kiln.scale")
                   for m in reachable(graph, start)), "kiln.scale reaches the compiler"


def test_nothing_below_imports_scale(graph):
    importers = sorted(m for m, targets in graph.items() if not m.startswith("kiln.scale")
                       and m != "kiln.cli" and any(t.startswith("kiln.scale") for t in targets))
    assert not importers, f"modules importing kiln.scale: {importers}"


def private_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from kiln.X import _name` whose module lies in another package."""
    own = module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            source_package = node.module.rpartition(".")[0]
            found += [(node.module, a.name) for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and source_package != own]
    return found


def test_nothing_imports_a_private_name_across_packages():
    offenders = {module_name(p): private_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
    offenders = {m: found for m, found in offenders.items() if found}
    assert not offenders, f"private names imported across packages: {offenders}"


def test_the_private_import_check_can_fail(tmp_path):
    global PACKAGE
    (tmp_path / "kiln" / "engines").mkdir(parents=True)
    source = tmp_path / "kiln" / "engines" / "a.py"
    source.write_text("from kiln.compiler.passes.kv_io import _prune\nfrom kiln.engines.b import _ok\n")
    saved, PACKAGE = PACKAGE, tmp_path / "kiln"
    try:
        assert private_imports(source) == [("kiln.compiler.passes.kv_io", "_prune")]
    finally:
        PACKAGE = saved


def test_the_graph_sees_lazy_imports(tmp_path):
    """The checker itself can fail: a function-level import is an edge."""
    (tmp_path / "kiln").mkdir()
    source = tmp_path / "kiln" / "a.py"
    source.write_text("def f():\n    from kiln.b import g\n    from . import c\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "kiln"
    try:
        assert imported_modules(source, {"kiln.a", "kiln.b", "kiln.c"}) == {"kiln.b", "kiln.c"}
    finally:
        PACKAGE = saved
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"kiln.a": {"kiln.b"}, "kiln.b": {"kiln.a"}}).prepare()
