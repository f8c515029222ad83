"""The committed gRPC stubs are exactly what grpcio-tools generates from proto/; pyproject admits
no protobuf or grpcio that they refuse at import."""

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} drifted from the .proto: run `make proto`"


def test_stubs_import_from_the_package():
    spec = importlib.util.find_spec("codec_contract.api.codec_pb2_grpc")
    assert spec is not None
    from codec_contract.api import codec_pb2, codec_pb2_grpc

    assert codec_pb2.DESCRIPTOR.package == "megapod.codec.v3"
    assert hasattr(codec_pb2_grpc, "SnacCodecStub")


def _stub_floors() -> dict[str, Version]:
    """The oldest runtimes the committed stubs accept, as they check them at import: codec_pb2.py's
    ValidateProtobufRuntimeVersion(domain, major, minor, patch, suffix, file) and codec_pb2_grpc.py's
    GRPC_GENERATED_VERSION (the grpcio-tools that generated it; older grpcio is refused)."""
    pb2 = ast.parse((ROOT / "codec_contract" / "api" / "codec_pb2.py").read_text())
    calls = [n for n in ast.walk(pb2) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "ValidateProtobufRuntimeVersion"]
    assert len(calls) == 1, "codec_pb2.py checks its protobuf runtime once"
    major, minor, patch, suffix = (ast.literal_eval(a) for a in calls[0].args[1:5])
    grpc_stub = ast.parse((ROOT / "codec_contract" / "api" / "codec_pb2_grpc.py").read_text())
    [grpc_version] = [ast.literal_eval(n.value) for n in grpc_stub.body if isinstance(n, ast.Assign)
                      and [getattr(t, "id", None) for t in n.targets] == ["GRPC_GENERATED_VERSION"]]
    grpc_floor = Version(grpc_version)
    # grpcio's companion packages are released in lockstep with it; older ones require older grpcio/protobuf.
    return {"protobuf": Version(f"{major}.{minor}.{patch}{suffix}"), "grpcio": grpc_floor,
            "grpcio-health-checking": grpc_floor, "grpcio-reflection": grpc_floor, "grpcio-tools": grpc_floor}


def _lowest_allowed(specifier: SpecifierSet) -> Version | None:
    """The lowest version `specifier` admits, from its lower bounds; None if it has none (anything goes)."""
    bounds = [Version(s.version.removesuffix(".*")) for s in specifier if s.operator in (">=", ">", "==", "~=", "===")]
    return max(bounds) if bounds else None


def test_dependency_floors_admit_no_runtime_the_stubs_refuse():
    """An install that resolves at pyproject's floor must import the stubs: every requirement on
    protobuf or grpcio(-*) in every dependency list allows nothing below what the stubs check for."""
    floors = _stub_floors()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project["dependencies"], **project.get("optional-dependencies", {})}
    checked = []
    for where, requirements in lists.items():
        for text in requirements:
            requirement = Requirement(text)
            floor = floors.get(canonicalize_name(requirement.name))
            if floor is None:
                continue
            lowest = _lowest_allowed(requirement.specifier)
            assert lowest is not None and lowest >= floor, (
                f"{where}: {text!r} admits {requirement.name} below {floor}, which the stubs refuse at import")
            checked.append(requirement.name)
    assert {"protobuf", "grpcio"} <= set(checked), "pyproject names both runtimes the stubs check"
