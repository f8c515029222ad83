"""What every benchmark records beside its figures: package versions, the git commit, and the
processes a launched stack is made of."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


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
