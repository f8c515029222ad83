"""How the benchmarks are imported: one way, as the package `benchmarks` (installed with the project), by the
scripts, their tools and the tests alike. No benchmark edits sys.path or imports from tests/, nothing imports a
benchmark module by its bare name (that only works with its folder on the path), and no import runs in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
TESTS = REPO / "tests"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in BENCHMARKS.rglob("*.py")}
BARE = {name.split(".")[1] for name in MODULES if name != "benchmarks"}  # soak, provenance, concurrency_bench ...
TEST_HELPERS = {path.stem for path in TESTS.glob("*.py")} | {"tests"}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, lazy ones inside functions too; `from a import b`
    gives a and, where b is a module, a.b."""
    package = module_name(path).split(".")[: None if path.name == "__init__.py" else -1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, a level up for each dot past the first
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in MODULES]
    return found


def test_no_benchmark_edits_sys_path_or_imports_from_tests():
    wrong = []
    for name, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text())
        wrong += [f"{name}:{node.lineno} uses sys.path" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"]
        wrong += [f"{name}:{line} imports {module} from tests/" for line, module in imported(path)
                  if module.split(".")[0] in TEST_HELPERS]
    assert not wrong, wrong


def test_benchmark_modules_are_imported_by_their_package_name():
    """`from benchmarks.soak import ...`, never `from soak import ...`: the scripts, their tools and the tests."""
    bare = [f"{path.relative_to(REPO)}:{line} imports {module}"
            for path in [*MODULES.values(), *TESTS.glob("*.py")] for line, module in imported(path)
            if module.split(".")[0] in BARE]
    assert not bare, bare


def import_graph() -> dict[str, set[str]]:
    return {name: {module for _, module in imported(path) if module in MODULES and module != name}
            for name, path in MODULES.items()}


def test_the_walk_sees_imports_inside_functions():
    graph = import_graph()
    assert "benchmarks.lora_adapters" in graph["benchmarks.hostile"]  # imported in lora_phases
    assert "benchmarks.concurrency_bench.metrics" in graph["benchmarks.concurrency_bench.load"]  # relative


def test_no_import_circle_among_the_benchmarks():
    graph, circles = import_graph(), []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if name in done:
            return
        for nxt in sorted(graph[name]):
            visit(nxt, [*trail, name])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [])
    assert not circles, circles


def test_the_installed_package_is_this_folder_from_anywhere(tmp_path):
    """The project's install maps `benchmarks` here (pyproject.toml's packages): a process started outside the
    checkout imports the scripts and their tools (after a change there, `make install` installs it again)."""
    code = "import benchmarks.soak, benchmarks.hostile_sockets, benchmarks.serving_cpu; print(benchmarks.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()) == BENCHMARKS / "__init__.py"
