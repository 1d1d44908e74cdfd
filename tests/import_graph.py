"""The first-party import graph, read from source (AST: nothing is imported), and its cycles.

``module_files(roots)`` maps module names to files under package directories;
``import_graph(files)`` gives each module the first-party modules it imports (every ``import``
and ``from ... import`` statement, at module level or inside a function, except under
``if TYPE_CHECKING:``); ``cycles(graph)`` names the circles as ``"a -> b -> a"``.

An import is an edge to the most specific first-party module it names: ``import a.b.c`` and
``from a.b import c`` point at ``a.b.c`` when that module exists, else at ``a.b`` (a name in
``a.b``), else at ``a``. Relative imports resolve against the importing module's package.
"""

from __future__ import annotations

import ast
import pathlib
from collections import deque
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Set

__all__ = ["module_files", "import_graph", "cycles"]


def module_files(roots: Iterable[pathlib.Path]) -> Dict[str, pathlib.Path]:
    """Module name -> file for every ``.py`` file under each package directory in ``roots``
    (a root is a top-level package: its name is the first part of its modules' names)."""
    files: Dict[str, pathlib.Path] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement under ``node``, leaving out the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]))
        else:
            yield from _imports(child)


def _most_specific(name: str, modules: Mapping[str, object]) -> Optional[str]:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _targets(statement: ast.stmt, module: str, is_package: bool, modules: Mapping[str, object]) -> Iterator[str]:
    if isinstance(statement, ast.Import):
        for alias in statement.names:
            yield _most_specific(alias.name, modules)
        return
    base = statement.module or ""
    if statement.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (statement.level - 1)]
        base = ".".join(package + ([base] if base else []))
    for alias in statement.names:
        yield _most_specific(f"{base}.{alias.name}" if alias.name != "*" else base, modules)


def import_graph(files: Mapping[str, pathlib.Path]) -> Dict[str, Set[str]]:
    """Module -> the first-party modules its import statements name (no self-edges)."""
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        targets = {t for s in _imports(tree) for t in _targets(s, module, is_package, files)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _components(graph: Mapping[str, Set[str]]) -> List[Set[str]]:
    """Strongly connected components (Tarjan, iterative) with more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _path(graph: Mapping[str, Set[str]], start: str, goal: str, within: Set[str]) -> List[str]:
    """A shortest path ``start -> ... -> goal`` inside ``within`` (breadth first)."""
    before: Dict[str, Optional[str]] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            break
        for child in sorted(graph.get(node, ())):
            if child in within and child not in before:
                before[child] = node
                queue.append(child)
    path = [goal]
    while before[path[-1]] is not None:
        path.append(before[path[-1]])
    return path[::-1]


def cycles(graph: Mapping[str, Set[str]]) -> List[str]:
    """The import circles of ``graph``, each as ``"a -> b -> ... -> a"`` starting at its
    smallest module: for every edge inside a strongly connected component, the shortest circle
    through it (so every edge of a circle is named at least once)."""
    named: Set[str] = set()
    for component in _components(graph):
        for node in component:
            for child in graph[node] & component:
                loop = [node] + _path(graph, child, node, component)[:-1]
                first = loop.index(min(loop))
                loop = loop[first:] + loop[:first]
                named.add(" -> ".join(loop + [loop[0]]))
    return sorted(named)
