"""The sync detector catches each way a GPU hot path can sync with the host or upload host data,
on CPU tensors, and passes the device-only idioms that replace them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orpheus_common.sync_detector import HostSyncError, host_syncs, no_host_sync

X = torch.arange(12.0).reshape(3, 4)
ROWS = torch.tensor([0, 2])  # built outside the checked code, like a buffer made at start-up


def list_index(x):
    return x[:, [1, 3]]


def numpy_index(x):
    return x[np.array([0, 2])]


def tensor_of_python_data(x):
    return x + torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)


def as_tensor_of_numpy(x):
    return x * torch.as_tensor(np.ones(4, dtype=np.float32), device=x.device)


def item(x):
    return x.sum().item()


def tolist(x):
    return x[0].tolist()


def cpu(x):
    return x.cpu()


def to_numpy(x):
    return x.numpy()


def python_if_on_a_tensor(x):
    return x * 2 if (x > 5).any() else x


def int_of_a_tensor(x):
    return x[: int(x[0, 1])]


def scalar_setitem(x):
    x[1, 2] = 0.0
    return x


def host_tensor_in_the_path(x):
    return x + torch.zeros(4)  # no device=: a host tensor on a GPU


def boolean_mask_index(x):
    return x[x > 3]


def nonzero(x):
    return torch.nonzero(x > 3)


def old_frames_to_levels(frames):
    """The codec's level split before the fix (issue 12, item 1): what made graph capture fail."""
    return frames[..., 0], frames[..., [1, 4]].reshape(-1), frames[..., [2, 3, 5, 6]].reshape(-1)


@pytest.mark.parametrize("bad, expected", [
    (list_index, "indexing with a list"),
    (numpy_index, "indexing with a ndarray"),
    (tensor_of_python_data, "tensor() of list data uploads host data"),
    (as_tensor_of_numpy, "as_tensor() of ndarray data uploads host data"),
    (item, ".item() reads a value back"),
    (tolist, ".tolist() reads values back"),
    (cpu, ".cpu() copies to the host"),
    (to_numpy, ".numpy() needs the data on the host"),
    (python_if_on_a_tensor, "bool() of a tensor"),
    (int_of_a_tensor, "int() of a tensor"),
    (scalar_setitem, "t[i] = <Python scalar>"),
    (host_tensor_in_the_path, "zeros() without device= creates a host tensor"),
    (boolean_mask_index, "boolean mask"),
    (nonzero, "nonzero()'s result size"),
    (old_frames_to_levels, "indexing with a list"),
], ids=lambda v: getattr(v, "__name__", None))
def test_each_host_sync_is_caught_and_located(bad, expected):
    x = torch.arange(7 * 3).reshape(1, 3, 7) if bad is old_frames_to_levels else X.clone()
    findings = host_syncs(bad, x)
    assert findings, f"{bad.__name__} passed the detector"
    assert expected in findings[0].what
    assert findings[0].where.startswith("test_sync_detector.py:"), "the finding names the offending line"


def clean(x):
    """What the bad functions should have written: views, device tensors, masked fills, where."""
    rows = x.index_select(0, ROWS)
    picked = torch.stack([x[:, 1], x[:, 3]], dim=-1)
    masked = x.masked_fill(x > 3, float("-inf"))
    ramp = torch.arange(4, device=x.device)
    chosen = torch.where(x > 5, x * 2, x)
    x[1, 2].fill_(0.0)
    return rows.sum() + picked.sum() + masked.amax() + ramp.sum() + chosen.sum()


def test_device_only_code_passes():
    assert host_syncs(clean, X.clone()) == []


def test_the_context_manager_raises_with_every_finding():
    with pytest.raises(HostSyncError) as caught:
        with no_host_sync():
            item(X)
            list_index(X)
    assert len(caught.value.findings) == 2
    assert "would sync with the host" in str(caught.value)
