"""How the benchmarks are imported: one way, as the package `benchmarks` (installed with the project), by the
scripts, their tools and the tests alike. No benchmark edits sys.path or imports from tests/, nothing imports a
benchmark module by its bare name (that only works with its folder on the path); no import runs in a circle
(tests/test_dependencies.py, over the benchmarks and the product)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from import_graph import import_graph, imports, modules_of

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
TESTS = REPO / "tests"


MODULES = modules_of(["benchmarks"])
BARE = {name.split(".")[1] for name in MODULES if name != "benchmarks"}  # soak, provenance, concurrency_bench ...
TEST_HELPERS = {path.stem for path in TESTS.glob("*.py")} | {"tests"}


def imported(path: Path) -> list[tuple[int, str]]:
    return imports(path, MODULES)


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


def test_the_walk_sees_imports_inside_functions():
    graph = import_graph(["benchmarks"])
    assert "benchmarks.lora_adapters" in graph["benchmarks.hostile"]  # imported in lora_phases
    assert "benchmarks.concurrency_bench.metrics" in graph["benchmarks.concurrency_bench.load"]  # relative


def test_the_installed_package_is_this_folder_from_anywhere(tmp_path):
    """The project's install maps `benchmarks` here (pyproject.toml's packages): a process started outside the
    checkout imports the scripts and their tools (after a change there, `make install` installs it again)."""
    code = "import benchmarks.soak, benchmarks.hostile_sockets, benchmarks.serving_cpu; print(benchmarks.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()) == BENCHMARKS / "__init__.py"
