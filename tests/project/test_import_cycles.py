"""No import cycles between the modules of schemas/, planner/ and runtime/.

Imports are read as ``tests/project/test_architecture.py`` reads them (``ast``, statements anywhere in a
module, function bodies included), so a cycle closed by an import inside a function counts: it
still means neither module can be understood, tested or moved without the other. An import names
the module it loads: ``from pkg import mod`` depends on ``pkg.mod``, ``from pkg.mod import name``
on ``pkg.mod``, ``from pkg import name`` (a name the package re-exports) on ``pkg``'s ``__init__``.
Imports under ``if TYPE_CHECKING:`` are for annotations only (never executed): not dependencies.
"""

from __future__ import annotations

import ast

import pytest
from tests.project.test_architecture import imports_of, package_modules


def _resolve(names: list[str], modules: set[str]) -> list[str]:
    """The modules one import statement loads, given :func:`imports_of`'s names for it
    (``[stem, stem.a, stem.b, ...]``): the submodules it names, else the stem itself."""
    subs = [n for n in names[1:] if n in modules]
    if subs:
        return subs
    return [names[0]] if names and names[0] in modules else []


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    yield from ast.walk(tree)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the package modules it imports; ``sources``: module -> (source text, is package)."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for module, (source, is_pkg) in sources.items():
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(source)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names = imports_of(f"import {alias.name}", module, is_pkg)
                    deps.update(n for n in names if n in modules)
            elif isinstance(node, ast.ImportFrom):
                deps.update(_resolve(imports_of(ast.unparse(node), module, is_pkg), modules))
        deps.discard(module)
        graph[module] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm, iterative over each node's edges
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_cycle_in(graph, comp) for comp in sorted(components)]


def _cycle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {comp}")  # unreachable for a real component


def test_no_import_cycles():
    sources = {module: (path.read_text(), is_pkg) for module, path, is_pkg in package_modules()}
    cycles = find_cycles(import_graph(sources))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "sources, expected",
    [
        # the cycle this test was written against: a function-level import closes it
        ({"zeppelin.schemas.model": ("def f():\n    from .hf import spec\n", False),
          "zeppelin.schemas.hf": ("from .model import ModelSpec\n", False)},
         [["zeppelin.schemas.hf", "zeppelin.schemas.model", "zeppelin.schemas.hf"]]),
        ({"zeppelin.planner.core.a": ("import zeppelin.planner.core.b\n", False),
          "zeppelin.planner.core.b": ("from zeppelin.planner.core import c\n", False),
          "zeppelin.planner.core.c": ("from . import a\n", False),
          "zeppelin.planner.core": ("", True)},
         [["zeppelin.planner.core.a", "zeppelin.planner.core.b", "zeppelin.planner.core.c",
           "zeppelin.planner.core.a"]]),
        # one way only, and a submodule importing its package's sibling through `from . import`
        ({"zeppelin.schemas.model": ("from .hf import spec\n", False),
          "zeppelin.schemas.hf": ("from .model_spec import ModelSpec\n", False),
          "zeppelin.schemas.model_spec": ("from . import common\n", False),
          "zeppelin.schemas.common": ("", False),
          "zeppelin.schemas": ("", True)},
         []),
        # annotation-only imports close no cycle; the same import executed does
        ({"zeppelin.schemas.plan": ("from .invariants import check\n", False),
          "zeppelin.schemas.invariants": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from .plan import Step\n", False)},
         []),
        ({"zeppelin.schemas.plan": ("from .invariants import check\n", False),
          "zeppelin.schemas.invariants": ("def f():\n    from .plan import Step\n", False)},
         [["zeppelin.schemas.invariants", "zeppelin.schemas.plan", "zeppelin.schemas.invariants"]]),
    ],
)
def test_a_cycle_is_named(sources, expected):
    assert find_cycles(import_graph(sources)) == expected
