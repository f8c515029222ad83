"""A CPU check for GPU hot paths: every call that would sync with the host, or upload host data, on a GPU.

Inside a CUDA Graph capture such a call is an error; in a per-step path it stalls the GPU queue
while the host waits. No GPU is needed to find them: the calls are the same on CPU tensors, so
`no_host_sync()` runs a path under a `torch.overrides.TorchFunctionMode` and records each one:

- reading a value back: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`int()`/`float()` of a tensor;
- host data turned into a tensor: `torch.tensor`/`as_tensor`/`new_tensor` of Python or numpy data;
- a tensor created on the host: a factory (`zeros`, `arange`, …) called without `device=`;
- indexing with Python data (a list or numpy array index is built on the host and uploaded) or a
  boolean mask (its result's size needs the mask's count on the host), `nonzero` and friends;
- writing a Python scalar into a tensor with `t[i] = x`.

The `meta` device cannot do this job: it hides host uploads (a list index becomes a meta tensor too).
What it cannot see: `torch.from_numpy` (not routed through torch functions) and whether a tensor
argument lives on the host; keep host staging out of the checked region and check it by design.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor

_READBACKS = {
    Tensor.item: ".item() reads a value back to the host",
    Tensor.tolist: ".tolist() reads values back to the host",
    Tensor.cpu: ".cpu() copies to the host and waits",
    Tensor.numpy: ".numpy() needs the data on the host",
    Tensor.__bool__: "bool() of a tensor reads it back (Python control flow on device data)",
    Tensor.__int__: "int() of a tensor reads it back",
    Tensor.__float__: "float() of a tensor reads it back",
    Tensor.__index__: "using a tensor as a Python index reads it back",
    Tensor.__complex__: "complex() of a tensor reads it back",
}
_FROM_HOST_DATA = {torch.tensor, torch.as_tensor, Tensor.new_tensor}
_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn, torch.randint,
    torch.linspace, torch.logspace, torch.eye, torch.randperm, torch.scalar_tensor, torch.empty_strided,
}
_DATA_DEPENDENT = {
    torch.nonzero: "nonzero()'s result size is known only on the host",
    Tensor.nonzero: "nonzero()'s result size is known only on the host",
    torch.argwhere: "argwhere()'s result size is known only on the host",
    torch.masked_select: "masked_select()'s result size is known only on the host",
    Tensor.masked_select: "masked_select()'s result size is known only on the host",
    torch.unique: "unique()'s result size is known only on the host",
    Tensor.unique: "unique()'s result size is known only on the host",
    torch.unique_consecutive: "unique_consecutive()'s result size is known only on the host",
}


@dataclass(frozen=True)
class Finding:
    """One call that would sync or upload on a GPU, and the line of the checked code that made it."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


class HostSyncError(AssertionError):
    """A checked GPU path made calls that would sync with the host or upload host data."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        super().__init__("GPU hot path would sync with the host:\n  " + "\n  ".join(map(str, findings)))


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _index_problem(index: object) -> str | None:
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, (list, np.ndarray)):
            return f"indexing with a {type(part).__name__} builds the index on the host and uploads it"
        if isinstance(part, Tensor) and part.dtype == torch.bool:
            return "indexing with a boolean mask needs the mask's count on the host (use masked_fill or where)"
    return None


def _problem(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """Why this call would sync or upload on a GPU, or None when it would not."""
    if func in _READBACKS:
        return _READBACKS[func]
    if func in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[func]
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "where(condition)'s result size is known only on the host"
    if func in _FROM_HOST_DATA:
        data = args[1] if func is Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
        if not isinstance(data, Tensor):
            return f"{_name(func)}() of {type(data).__name__} data uploads host data"
    if func in _FACTORIES and kwargs.get("device") is None:
        return f"{_name(func)}() without device= creates a host tensor"
    if func is Tensor.__getitem__:
        return _index_problem(args[1])
    if func is Tensor.__setitem__:
        problem = _index_problem(args[1])
        if problem is None and isinstance(args[2], (bool, int, float)):
            problem = "t[i] = <Python scalar> writes a host value into the tensor (use fill_/masked_fill_ on a view)"
        return problem
    return None


def _caller() -> str:
    """The innermost frame of the checked code (not torch, not this module)."""
    here = Path(__file__).resolve()
    torch_dir = Path(torch.__file__).resolve().parent
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path != here and torch_dir not in path.parents:
            return f"{path.name}:{frame.lineno} ({frame.name})"
    return "?"


class HostSyncDetector(TorchFunctionMode):
    """Records each torch call that would sync or upload on a GPU; the call itself still runs."""

    def __init__(self) -> None:
        super().__init__()
        self.findings: list[Finding] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = _problem(func, args, kwargs)
        if problem is not None:
            self.findings.append(Finding(problem, _caller()))
        return func(*args, **kwargs)


@contextmanager
def no_host_sync() -> Iterator[HostSyncDetector]:
    """Run the block under the detector; raise HostSyncError at the end if it found anything."""
    detector = HostSyncDetector()
    with detector:
        yield detector
    if detector.findings:
        raise HostSyncError(detector.findings)


def host_syncs(fn: Callable[..., object], *args: object, **kwargs: object) -> list[Finding]:
    """The findings of one call of `fn` (empty when it is clean); the call's own result is dropped."""
    detector = HostSyncDetector()
    with detector:
        fn(*args, **kwargs)
    return detector.findings
