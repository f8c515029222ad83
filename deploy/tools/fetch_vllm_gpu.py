"""vLLM's CUDA release (deploy/docker/cuda-pins.txt), its Python files only, into a folder of its own.

The tests build that release's own config objects from the chart's GPU profiles (tests/test_deploy_chart.py)
on a machine without a GPU, where the CPU build of an older vLLM is what runs. The compiled kernels are left out:
they need CUDA's libraries, and building configs does not load them. The wheel is fetched once (pip's cache) and
only its `vllm/` package and metadata are written, ~180 MB.

    python deploy/tools/fetch_vllm_gpu.py .vllm-gpu
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PINS = Path(__file__).resolve().parents[1] / "docker" / "cuda-pins.txt"


def pinned_vllm() -> str:
    """`vllm==X.Y.Z`, as the CUDA image pins it."""
    return next(line.strip() for line in PINS.read_text().splitlines() if line.startswith("vllm=="))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    requirement = pinned_vllm()
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-wheel-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_28_x86_64", "-d", tmp, requirement], check=True)
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        shutil.rmtree(args.target, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            python_files = [name for name in archive.namelist() if not name.endswith(".so")]
            archive.extractall(args.target, python_files)
    print(f"{requirement}: {len(python_files)} files into {args.target} (compiled kernels left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
