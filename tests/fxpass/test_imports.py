"""No import circle among the modules of ``fxpass`` and ``lowerings``.

A circle works only while every module in it is imported in one lucky order, and an import deferred into a
function body to dodge one hides the same tangle from the reader. So every ``import`` counts here, wherever it
sits (module level, function bodies, ``if TYPE_CHECKING:``), read from the source with ``ast`` without importing
anything.

Packages: ``from pkg import sub`` where ``sub`` is a submodule is an edge to ``pkg.sub`` alone, and any other
import of ``pkg`` (``import pkg``, ``from pkg import name``) is an edge to ``pkg``'s ``__init__``. The import
that Python also makes of every parent package's ``__init__`` is not counted: ``fxpass/__init__.py`` imports
the backend, so counting it would make every module of the package circular and the check say nothing.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fxpass", "lowerings")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``fxpass/rules/cce.py`` → ``fxpass.rules.cce``; a package's ``__init__.py`` is named as the package, so
    that an edge to the package is an edge to its ``__init__``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    return {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from … import`` statement in ``module`` reads from, relative levels resolved
    the way Python does (from the package itself for an ``__init__``, else from the module's parent)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``tree`` (the source of ``module``) imports anywhere in its body; imports of
    anything outside ``known`` (torch, triton, the standard library) are dropped."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known_prefix(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = resolve_from(module, is_package, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else _known_prefix(source, known))
    found.discard("")
    return found


def _known_prefix(name: str, known: set[str]) -> str:
    """The longest leading part of the dotted ``name`` that is a project module, or "" where none is."""
    parts = name.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), "")


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> nx.DiGraph:
    """Modules as nodes; an edge from each module to every project module it imports."""
    modules = project_modules(root, packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in sorted(imported_modules(tree, name, path.name == "__init__.py", set(modules))):
            graph.add_edge(name, target)
    return graph


def describe_cycles(graph: nx.DiGraph, limit: int = 10) -> list[str]:
    """Up to ``limit`` import circles of ``graph``, each as ``a -> b -> a``, so a failure names what to cut;
    each starts at its alphabetically first module, so that the message is the same from run to run."""
    cycles = [_from_first(cycle) for cycle in itertools.islice(nx.simple_cycles(graph), limit)]
    return sorted(" -> ".join([*cycle, cycle[0]]) for cycle in cycles)


def _from_first(cycle: list[str]) -> list[str]:
    """``cycle`` rotated to start at its smallest name (networkx may start it anywhere)."""
    start = cycle.index(min(cycle))
    return cycle[start:] + cycle[:start]


def test_no_import_cycle():
    cycles = describe_cycles(import_graph())
    assert not cycles, "import circles in fxpass/lowerings:\n" + "\n".join(cycles)


def test_graph_covers_the_packages():
    """The graph holds every module and the imports known to exist, so an empty graph cannot pass as clean."""
    graph = import_graph()
    assert set(project_modules()) == set(graph.nodes)
    assert graph.has_edge("fxpass.rewrite", "fxpass.pricing")  # ``from fxpass import pricing``: the submodule
    assert graph.has_edge("fxpass.rewrite", "fxpass.rules")  # ``from fxpass.rules import RULES``: the __init__
    assert graph.has_edge("fxpass.rules", "fxpass.rules.cce")
    assert graph.has_edge("fxpass.rewrite", "lowerings")  # ``import lowerings``
    assert graph.has_edge("fxpass.rules.cce", "lowerings.cce.rowwise")  # deferred into a function body
    assert not graph.has_edge("fxpass.rewrite", "fxpass")  # a parent package's __init__ is not counted


def test_relative_and_deferred_imports_are_edges(tmp_path: Path):
    """Relative imports resolve against the right package, and imports in function bodies count: a circle
    closed by one of them is reported."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("from .b import thing\n")
    (package / "sub" / "b.py").write_text("thing = 1\n\ndef late():\n    from ..a import x\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert set(graph.edges) == {("pkg", "pkg.a"), ("pkg.a", "pkg.sub.b"), ("pkg.sub", "pkg.sub.b"),
                                ("pkg.sub.b", "pkg.a")}
    assert describe_cycles(graph) == ["pkg.a -> pkg.sub.b -> pkg.a"]
