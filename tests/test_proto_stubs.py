"""The committed gRPC stubs are exactly what grpcio-tools generates from proto/."""

import importlib.util
import subprocess
import sys
from pathlib import Path

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
