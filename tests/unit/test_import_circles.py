"""No import circle inside any package: the modules and subpackages of each package form a
directed graph without a cycle, function-level imports included (a type named only for a
signature is no arrow, as for import-linter's contracts).

import-linter's layers contracts keep the arrows between the top packages one way; this keeps
them one way inside every package too, where no contract names the layers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Set

import grimp
import pytest

ROOTS = ("supervisor", "lucia_kv")


def children_graph(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    """Who imports whom among the direct children of package (a subpackage stands for
    everything under it)."""

    def child(module: str) -> str:
        return f"{package}.{module[len(package) + 1 :].split('.', maxsplit=1)[0]}"

    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        if not module.startswith(package + "."):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith(package + ".") and child(imported) != child(module):
                edges[child(module)].add(child(imported))
    return edges


def circles(edges: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while (other := stack.pop()) != node:
                part.append(other)
            part.append(node)
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted({*edges, *(n for targets in edges.values() for n in targets)}):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({}, []),
        ({"a": {"b"}, "b": {"c"}}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"a"}}, []),  # a module importing itself is no circle between two
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_circles_found(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(circles(edges)) == expected


@pytest.mark.parametrize("root", ROOTS)
def test_no_circle_inside_any_package(root: str) -> None:
    graph = grimp.build_graph(root, exclude_type_checking_imports=True)
    packages = sorted({m.rsplit(".", 1)[0] for m in graph.modules if "." in m} | {root})
    found = [
        (package, part) for package in packages for part in circles(children_graph(graph, package))
    ]
    assert not found, f"import circles inside packages: {found}"
