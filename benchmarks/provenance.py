"""What every benchmark records beside its figures: package versions, the git commit, the time,
the CPU, the machine's busy time, and the processes a launched stack is made of."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


def record(packages: Iterable[str]) -> dict[str, object]:
    """The provenance block of a result: machine, commit, time, command line, package versions."""
    return {"machine": f"{cpu_model()}, {os.cpu_count()} cores", "commit": git_commit(), "when": timestamp(),
            "command": " ".join(sys.argv), "versions": versions(packages)}


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


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


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
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal
