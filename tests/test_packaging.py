"""Packaging: every module imports, every third-party import is declared, no import cycles.

The import graph is built with ``ast`` from the source files (top-level and
function-level imports, ``TYPE_CHECKING`` blocks excluded since they never run),
so these checks see what a fresh install would import, not what happens to be
in ``sys.modules`` already.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "composer_cloud"
PYPROJECT = ROOT / "pyproject.toml"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> set[str]:
    """Absolute names ``module`` imports anywhere (``from a import b`` yields ``a`` and ``a.b``)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{alias.name}" for alias in node.names}
            out.update(subs)
            # ``from pkg import submodule`` depends on the submodule; the package's __init__ is
            # an edge only when a name of its own is imported.
            if not subs <= MODULES.keys():
                out.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _third_party_roots(module: str) -> set[str]:
    roots = {name.split(".", 1)[0] for name in _imports(module)}
    return {r for r in roots if r and r != "composer_cloud" and r not in sys.stdlib_module_names and r != "__future__"}


def _declared_distributions() -> set[str]:
    """Normalised names of every distribution pyproject declares (dependencies and all extras)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    names = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in reqs}
    return {_normalise(n) for n in names if n}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_module_list_is_not_empty():
    assert "composer_cloud.cli" in MODULES and "composer_cloud.jobs.hf_jobs" in MODULES


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    importlib.import_module(module)


def test_every_third_party_import_is_declared():
    dists = md.packages_distributions()
    declared = _declared_distributions()
    missing: dict[str, list[str]] = {}
    for module in MODULES:
        for root in _third_party_roots(module):
            provided_by = {_normalise(d) for d in dists.get(root, [])}
            assert provided_by, f"{module} imports {root!r}, which no installed distribution provides"
            if not provided_by & declared:
                missing.setdefault(f"{root} ({', '.join(sorted(provided_by))})", []).append(module)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def _top_level_third_party(module: str) -> set[str]:
    """Third-party roots ``module`` imports when it is imported (module level, not inside functions)."""
    tree = ast.parse(MODULES[module].read_text())
    roots = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".", 1)[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".", 1)[0])
    return {r for r in roots if r != "composer_cloud" and r not in sys.stdlib_module_names and r != "__future__"}


#: Modules that need an extra at import time (everything else imports with the core dependencies).
EXTRA_AT_IMPORT = {"composer_cloud.images.modal_image": {"modal"}}


def test_core_modules_import_with_the_core_dependencies_only():
    """`pip install -e .` (no extras) must run the local demo: extras' packages are imported lazily."""
    dists = md.packages_distributions()
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = {_normalise(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in project["dependencies"]}
    wrong = {}
    for module in MODULES:
        for root in _top_level_third_party(module) - EXTRA_AT_IMPORT.get(module, set()):
            if not {_normalise(d) for d in dists.get(root, [])} & core:
                wrong.setdefault(module, []).append(root)
    assert not wrong, f"imported at module level but only in an extra (import it where it is used): {wrong}"


def _graph() -> dict[str, set[str]]:
    """Edges between composer_cloud modules (``from pkg import mod`` resolves to the submodule)."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        edges = set()
        for name in _imports(module):
            # The longest prefix that is one of our modules: "a.b.func" -> "a.b".
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in MODULES:
                    if candidate != module:
                        edges.add(candidate)
                    break
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_composer_cloud():
    graph = _graph()
    # A package's __init__ importing its own submodules is not a cycle of concepts, but a submodule
    # importing its package's __init__ back is; both count here, so keep __init__ files thin.
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_jobs_and_images_import_one_way():
    graph = _graph()
    back = {m: sorted(e for e in edges if e.startswith("composer_cloud.jobs"))
            for m, edges in graph.items() if m.startswith("composer_cloud.images")}
    assert not any(back.values()), f"images must not import jobs (jobs -> images only): {back}"
