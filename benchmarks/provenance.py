"""What every benchmark records beside its figures (`record`): the machine, the git commit, the time,
the command and package versions; and the machine's busy time, for the cores other processes used."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Variables that change a figure without changing the command: glibc's allocator (a CPU decoder's audio-s/s moved by
# a fifth to a third with MALLOC_MMAP_THRESHOLD_, benchmarks/README.md), OpenMP's and the libraries' threads, Inductor's caches.
ENVIRONMENT_THAT_MATTERS = ("MALLOC_", "OMP_", "MKL_", "TORCH", "CUDA_VISIBLE")


def record(packages: Iterable[str], argv: Sequence[str] | None = None) -> dict[str, object]:
    """The provenance block of a result: machine, commit, time, the command (this script and `argv`, by
    default this process's arguments) and package versions."""
    script = Path(sys.argv[0]).resolve()
    where = script.relative_to(REPO_ROOT) if script.is_relative_to(REPO_ROOT) else script
    return {"machine": machine(), "commit": git_commit(), "when": timestamp(),
            "command": " ".join(["python", str(where), *(sys.argv[1:] if argv is None else argv)]),
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENVIRONMENT_THAT_MATTERS)},
            "versions": versions(packages)}


def machine() -> dict[str, object]:
    """CPU model and usable cores, memory, and the GPUs this machine has (none on CI)."""
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch, or a CUDA that cannot initialize: report no GPU rather than fail
        gpus = []
    return {"cpu": cpu_model(), "cores_usable": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "gpus": gpus, "platform": platform.platform()}


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Python and each installed package's version (absent packages are left out)."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str | None:
    """HEAD, with `+dirty` when tracked files have changed; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def timestamp() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        return re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or "unknown CPU"


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, all processes): /proc/stat's first line
    less idle and iowait."""
    import psutil  # here: record() runs on a bare GPU node too (deploy/gpu/program.sh), which has no psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def write_result(out: Path, result: dict[str, object]) -> None:
    """A result's JSON at `out` (its folder made): a benchmark that writes as it goes calls this after each part."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
