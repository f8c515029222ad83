"""Frame validation and the slot -> SNAC level mapping."""

import numpy as np
import pytest
import torch

from orpheus_common.sync_detector import host_syncs
from codec_contract.audio import pack_frames, unpack_frames
from snac_server.frames import InvalidFrames, frames_to_levels, validate_codes


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
    codes = validate_codes(pack_frames([[0] * 7, [4095] * 7]))
    assert codes.dtype == np.int32 and codes.shape == (2, 7)
    assert codes[0].tolist() == [0] * 7 and codes[1].tolist() == [4095] * 7


def test_packing_round_trips_in_slot_order():
    frames = np.arange(3 * 7).reshape(3, 7) * 190  # up to 3990
    packed = pack_frames(frames)
    assert len(packed) == 3 * 14 and packed[:4] == b"\x00\x00\xbe\x00"  # little-endian uint16: 0, 190
    assert (unpack_frames(packed) == frames).all()


@pytest.mark.parametrize("frames", [[[1] * 6], [[0] * 7, [-1] * 7], [[65536] * 7]])
def test_packing_refuses_what_it_cannot_represent(frames):
    """A wrong shape or a code no uint16 holds is the sender's bug: refused, never wrapped."""
    with pytest.raises(ValueError):
        pack_frames(frames)


@pytest.mark.parametrize(
    "packed, message",
    [
        (pack_frames([[1] * 7])[:12], "12 bytes of codes are not whole frames"),
        (pack_frames([[0] * 7, [1] * 7]) + b"\x00", "29 bytes of codes are not whole frames"),
        (pack_frames([[0, 0, 0, 4096, 0, 0, 0]]), "frame 0 slot 3: code 4096"),
        (pack_frames([[0] * 7, [0, 0, 0, 0, 0, 0, 65535]]), "frame 1 slot 6: code 65535"),
    ],
)
def test_bad_frames_are_named_precisely(packed, message):
    with pytest.raises(InvalidFrames, match=message):
        validate_codes(packed)
