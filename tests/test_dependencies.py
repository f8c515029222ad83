"""What the product's code imports: every third-party package declared in pyproject.toml with a floor (an
install from the project's own files gets what the code needs, not what another package happened to pull),
and the layers kept: neither tier imports the other or `megapod`, and the front imports neither tier."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from import_graph import circles, import_graph
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("codec_contract", "orpheus_common", "orpheus_front", "snac_server", "llm_server", "megapod")
# Imported only by an optional backend, behind a clear error when missing (llm_server/engine/trtllm.py).
OPTIONAL = {"tensorrt_llm": "--backend trtllm: NVIDIA's wheel, installed on the GPU hosts that choose it"}


def imports_of(path: Path) -> set[str]:
    """Top-level modules a file imports, anywhere in it (lazy imports in functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_packages() -> dict[str, set[str]]:
    """Top-level third-party modules imported anywhere in the product -> the files."""
    found: dict[str, set[str]] = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            for top in imports_of(path) - set(PRODUCT) - sys.stdlib_module_names:
                found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [*project["dependencies"], *extras["cpu"], *extras["gpu"]]  # the engine: one of the two
    return {canonicalize_name(r.name): r for r in map(Requirement, requirements)}


def test_every_imported_package_is_declared():
    distributions = importlib.metadata.packages_distributions()
    wanted = declared()
    missing = {}
    for module, files in sorted(imported_packages().items()):
        if module in OPTIONAL:
            continue
        names = {canonicalize_name(d) for d in distributions.get(module, [])}
        assert names, f"{module} (imported by {sorted(files)}) is not installed"
        if not names & set(wanted):
            missing[module] = (sorted(names), sorted(files)[:3])
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declared_package_has_a_floor():
    unbounded = [str(r) for r in declared().values() if not any(s.operator in (">=", "==", "~=") for s in r.specifier)]
    assert not unbounded, f"no lower bound: {unbounded}"


def test_the_walk_sees_imports_inside_functions():
    """The lazy imports (the doctor's, the model source's) count: a walk of top-level imports alone would
    have missed transformers, which llm_server imports only when it builds the tiny model."""
    found = imported_packages()
    assert "llm_server/engine/model_source.py" in found["transformers"] and "orpheus_front/front.py" in found["anyio"]


# What each part may import of the project: the shared packages, never a tier beside it or `megapod` above.
LAYERS = {
    "codec_contract": set(),
    "orpheus_common": set(),
    "snac_server": {"codec_contract", "orpheus_common"},
    "llm_server": {"codec_contract", "orpheus_common"},
    "orpheus_front": {"orpheus_common"},  # the front relays; it runs without either tier installed (its own image)
}


def test_no_layer_imports_past_its_own():
    crossings = []
    for part, allowed in LAYERS.items():
        root = REPO / part
        for path in [root] if root.is_file() else root.rglob("*.py"):
            own = {part.split("/")[0]}
            for name in (imports_of(path) & set(PRODUCT)) - allowed - own:
                crossings.append(f"{path.relative_to(REPO)} imports {name}")
    assert not crossings, crossings


def front_files() -> list[Path]:
    """What the front's image runs: its package and the modules of orpheus_common it imports, transitively."""
    files, queue = [], list((REPO / "orpheus_front").rglob("*.py"))
    while queue:
        path = queue.pop()
        if path in files:
            continue
        files.append(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orpheus_common."):
                queue.append(REPO / (node.module.replace(".", "/") + ".py"))
    return files


def test_the_front_extra_is_what_the_front_imports():
    """deploy/docker/front.Dockerfile installs the `front` extra beside the project's code without its
    dependencies: every package the front's modules import is in it, at the same floor as the project's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    front = {canonicalize_name(r.name): r for r in map(Requirement, project["optional-dependencies"]["front"])}
    base = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    distributions = importlib.metadata.packages_distributions()
    imported = {top for path in front_files() for top in imports_of(path) - set(PRODUCT) - sys.stdlib_module_names}
    missing = {m for m in imported if not {canonicalize_name(d) for d in distributions.get(m, [])} & front.keys()}
    assert not missing, f"the front imports {sorted(missing)}, not in the `front` extra"
    assert "torch" not in front and "numpy" not in front
    differ = [str(r) for name, r in front.items() if name in base and str(r) != str(base[name])]
    assert not differ, f"the `front` extra and the dependencies disagree: {differ}"
    assert REPO / "orpheus_common" / "draining.py" in front_files() and REPO / "orpheus_common" / "sync_detector.py" not in front_files()


# -- the rooms of llm_server, and no import circle ---------------------------------------------------------------
# The protocols; http/sockets/models are their kit.
DOORS = ("openai", "cartesia", "deepgram", "elevenlabs", "baseten", "together", "vllm_omni", "slng")


def test_circles_are_found():
    """The check below would see a circle: two modules importing each other, and one through a third."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_product_or_the_benchmarks():
    graph = import_graph([*PRODUCT, "benchmarks"])
    assert "llm_server.speech.stream" in graph["llm_server.speech.session"], "the graph sees relative imports"
    assert not circles(graph), circles(graph)


def test_llm_server_is_in_rooms():
    top = sorted(p.name for p in (REPO / "llm_server").glob("*.py"))
    assert len(top) <= 16, f"{len(top)} modules at llm_server's top level: {top}"
    for room in ("doors", "speech", "engine", "edge"):
        assert (REPO / "llm_server" / room / "__init__.py").is_file(), room
    assert sorted(p.stem for p in (REPO / "llm_server" / "doors").glob("*.py")) == sorted(
        [*DOORS, "__init__", "http", "sockets", "models"])


def test_the_engine_imports_nothing_above_it_and_no_door_another():
    graph = import_graph(PRODUCT)
    engine = {m: deps for m, deps in graph.items() if m == "llm_server.engine" or m.startswith("llm_server.engine.")}
    assert len(engine) >= 8
    above = ("llm_server.voices", "llm_server.clones", "llm_server.doors", "llm_server.speech")
    reaching = {m: sorted(d for d in deps if d.startswith(above)) for m, deps in engine.items()}
    assert not any(reaching.values()), reaching
    doors = {f"llm_server.doors.{d}" for d in DOORS}
    door_to_door = {m: sorted(graph[m] & doors) for m in doors if graph[m] & doors}
    assert not door_to_door, door_to_door
