"""The repository's own import graph, read with ast: each file's imports (lazy ones inside functions too, relative
ones resolved; `from a import b` is the module a.b when b is one), and the circles in it. The layering checks
(tests/test_dependencies.py) and the benchmarks' (tests/test_benchmarks_layout.py) read it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_of(path: Path) -> str:
    """A file's dotted module name (a package's __init__ is the package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(packages) -> dict[str, Path]:
    return {module_of(path): path for package in packages for path in (REPO / package).rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file; `from a import b` gives a, and a.b where that is a
    module of `known`."""
    here = module_of(path)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from the file's package, a level up for each dot past the first
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in known]
    return found


def import_graph(packages) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports."""
    known = modules_of(packages)
    return {name: {m for _, m in imports(path, known) if m in known and m != name} for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found
