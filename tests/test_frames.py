"""Frame validation and the slot -> SNAC level mapping."""

import numpy as np
import pytest
import torch

from megapod.sync_detector import host_syncs
from snac_server.frames import InvalidFrames, frames_to_levels, validate_frames


def test_slot_order_maps_onto_levels():
    frames = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]])
    l0, l1, l2 = frames_to_levels(frames)
    assert l0.tolist() == [0, 10]
    assert l1.tolist() == [1, 4, 11, 14]
    assert l2.tolist() == [2, 3, 5, 6, 12, 13, 15, 16]


def test_levels_of_a_batch_keep_rows_apart():
    frames = torch.arange(2 * 3 * 7).reshape(2, 3, 7)
    l0, l1, l2 = frames_to_levels(frames)
    assert l0.shape == (2, 3) and l1.shape == (2, 6) and l2.shape == (2, 12)
    assert l0[1].tolist() == frames[1, :, 0].tolist()


def test_splitting_levels_never_uploads_host_data():
    """It runs inside the captured SNAC graph: a list index there failed capture on a GPU."""
    assert host_syncs(frames_to_levels, torch.zeros(2, 4, 7, dtype=torch.int64)) == []


def test_code_zero_and_4095_are_valid():
    codes = validate_frames([[0] * 7, [4095] * 7])
    assert codes.dtype == np.int32 and codes.shape == (2, 7)
    assert codes[0].tolist() == [0] * 7


@pytest.mark.parametrize(
    "frames, message",
    [
        ([[1, 2, 3, 4, 5, 6]], "frame 0 has 6 codes"),
        ([[0] * 7, [1] * 8], "frame 1 has 8 codes"),
        ([[0, 0, 0, 4096, 0, 0, 0]], "frame 0 slot 3: code 4096"),
        ([[0] * 7, [0, 0, 0, 0, 0, 0, -1]], "frame 1 slot 6: code -1"),
    ],
)
def test_bad_frames_are_named_precisely(frames, message):
    with pytest.raises(InvalidFrames, match=message):
        validate_frames(frames)
