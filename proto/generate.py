"""Generate the Python gRPC stubs for every .proto under proto/ with grpcio-tools.

Usage: python proto/generate.py [OUT_DIR]   (default: the repository root)

Proto paths mirror Python package paths (proto/codec_contract/api/codec.proto becomes
codec_contract/api/codec_pb2.py), so the generated imports need no rewriting.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent


def proto_files() -> list[Path]:
    """Every .proto file under proto/, sorted for a stable order."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for each proto file into out_dir."""
    include = Path(protoc.__file__).parent / "_proto"
    for proto in proto_files():
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent)
