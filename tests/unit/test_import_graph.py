"""No import circle under ``src/dsec``.

The test parses every module of the package with :mod:`ast` (nothing is imported), builds
the graph of the imports that run when a module is imported, and fails listing every
circle: a strongly connected component of more than one module, or a module importing
itself.

What counts as an edge (what runs at import time):

* ``import a.b`` and ``from a.b import c`` at module level, also inside a top-level ``if``,
  ``try``, ``with`` or class body; ``from a import b`` is an edge to the submodule ``a.b``
  when there is one, else to ``a``; relative imports (``from . import x``,
  ``from ..m import y``) are resolved against the module's package.

What does not:

* imports inside a function or method: they run when the function is called, not when the
  module is imported (how a module loads a heavy or optional dependency late);
* imports under ``if TYPE_CHECKING:``: only a type checker follows them;
* the implicit import of a package's ``__init__`` before each of its submodules, which
  Python performs for every submodule and which is no design dependency;
* modules outside ``dsec``.

A function-level import can also hide a circle of responsibilities (the layer store once
imported the registry publisher inside a method because the publisher, through the OCI
puller, imported the store). The second test therefore builds the graph with function-level
imports as well and allows only the circles in :data:`KNOWN_DEFERRED_CIRCLES`, each with
its reason; a new one fails, and so does a listed one that is gone (drop it from the list).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "dsec"

KNOWN_DEFERRED_CIRCLES: dict[frozenset[str], str] = {
    frozenset(
        {
            "dsec.sdk.client",
            "dsec.sdk.display",
            "dsec.sdk.group",
            "dsec.sdk.image",
            "dsec.sdk.jobs",
            "dsec.sdk.sandbox",
            "dsec.sdk.sync_api",
        }
    ): (
        "the SDK: the sync API is generated from the async one (sync_api imports the async "
        "classes) and each async object hands out its sync wrapper (``.sync``) and the "
        "sub-APIs and results (a group) it opens late, so that ``import dsec`` stays light"
    ),
}
"""Circles through function-level imports, accepted for now: the modules of each, and why."""


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The import statements of a module that run when it is imported (``deferred``: also
    those in function bodies). Never those under ``if TYPE_CHECKING:``."""

    def __init__(self, deferred: bool) -> None:
        self.deferred = deferred
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        if self.deferred:
            self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """``[base, base.name, ...]`` for ``from base import name, ...``; the modules of an
    ``import a.b, c``. Relative imports resolved against the module's package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(
    src: Path = SRC, package: str = PACKAGE, *, deferred: bool = False
) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports when it is imported (``deferred``:
    or when one of its functions runs)."""
    paths = {_module_name(src, p): p for p in sorted((src / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        visitor = _Imports(deferred)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        edges: set[str] = set()
        for node in visitor.found:
            targets = _targets(name, path.name == "__init__.py", node)
            if isinstance(node, ast.ImportFrom):
                # ``from a import b``: the submodule a.b if there is one, else a itself
                base, names = targets[0], targets[1:]
                subs = [t for t in names if t in paths]
                if len(subs) < len(names) and base in paths:
                    edges.add(base)
                edges.update(subs)
            else:
                edges.update(t for t in targets if t in paths)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, and self-imports
    (Tarjan's algorithm, iterative), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return sorted(found)


def _path_through(graph: dict[str, set[str]], component: list[str]) -> str:
    """The shortest circle through ``component``'s first module, as ``a -> b -> ... -> a``,
    for the failure message."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return " -> ".join([*reversed(path), start])
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return start


def _report(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(f"  {', '.join(c)}\n    e.g. {_path_through(graph, c)}" for c in found)


def test_the_walker_on_a_small_package(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from . import b\nA = 1\n",
        "pkg/b.py": "import os\ndef f():\n    from pkg.a import A\n",
        "pkg/c.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg import a\nelse:\n    import pkg.b\n"
            "try:\n    import pkg.sub.d\nexcept ImportError:\n    pass\n"
        ),
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from .. import c\nfrom ..b import f\nclass K:\n    from pkg import A\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": set(),
        "pkg.c": {"pkg.b", "pkg.sub.d"},
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg", "pkg.b", "pkg.c"},
    }
    assert circles(graph) == [["pkg.c", "pkg.sub.d"]]
    assert _path_through(graph, ["pkg.c", "pkg.sub.d"]) == "pkg.c -> pkg.sub.d -> pkg.c"
    deferred = import_graph(tmp_path, "pkg", deferred=True)
    assert deferred["pkg.b"] == {"pkg.a"}
    assert circles(deferred) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    assert circles({"x": {"x"}, "y": set()}) == [["x"]]


def test_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "dsec.errors" in graph["dsec.edge.core"]  # it sees dsec
    found = circles(graph)
    assert not found, "import circles under src/dsec:\n" + _report(graph, found)


def test_no_new_circle_through_function_imports() -> None:
    graph = import_graph(deferred=True)
    found = circles(graph)
    new = [c for c in found if frozenset(c) not in KNOWN_DEFERRED_CIRCLES]
    assert not new, "import circles under src/dsec through function imports:\n" + _report(
        graph, new
    )
    stale = [sorted(k) for k in KNOWN_DEFERRED_CIRCLES if sorted(k) not in found]
    assert not stale, f"circles that are gone: drop them from KNOWN_DEFERRED_CIRCLES: {stale}"


FLOORS: dict[str, tuple[str, ...]] = {
    # the contract at the bottom: what the tiers, the edge and the guest share
    "dsec.contract": (
        "dsec.edge",
        "dsec.runtimes",
        "dsec.guest",
        "dsec.layers",
        "dsec.apiserver",
        "dsec.cluster",
        "dsec.server",
        "dsec.node",
    ),
    # a tier's runtime is below the edge that drives it
    "dsec.runtimes": ("dsec.edge", "dsec.apiserver", "dsec.cluster", "dsec.server", "dsec.node"),
    # the VM guest's guard reads the isolation policy from the contract, not from a tier
    "dsec.guest": (
        "dsec.runtimes.container",
        "dsec.edge",
        "dsec.apiserver",
        "dsec.cluster",
        "dsec.server",
    ),
}
"""Package -> the packages its modules may not import, even inside a function."""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_floors() -> None:
    """Nothing imports upwards: the contract imports no tier, edge or server; a runtime no
    edge; the guest's guard no tier (issue 33: the contract at the bottom)."""
    graph = import_graph(deferred=True)
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for floor, forbidden in FLOORS.items()
        if _within(module, floor)
        for target in targets
        if any(_within(target, up) for up in forbidden)
    )
    assert not wrong, "imports upwards:\n" + "\n".join(wrong)
    assert any(_within(m, "dsec.contract") for m in graph)  # the floor exists
