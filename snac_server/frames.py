"""Orpheus audio frames: 7 SNAC codes per frame, and their validation.

A frame maps onto SNAC's three code levels as (slot -> level[index]):
slot0 -> L0[j]; slot1 -> L1[2j]; slot2 -> L2[4j]; slot3 -> L2[4j+1];
slot4 -> L1[2j+1]; slot5 -> L2[4j+2]; slot6 -> L2[4j+3].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CODES_PER_FRAME = 7
CODEBOOK_SIZE = 4096
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 2048
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE

# Column order that gathers a frame's codes into (L0 | L1 L1 | L2 L2 L2 L2).
_L1_SLOTS = [1, 4]
_L2_SLOTS = [2, 3, 5, 6]


class InvalidFrames(ValueError):
    """Client-supplied frames that must never reach the model (becomes INVALID_ARGUMENT)."""


def validate_frames(frames: Sequence[Sequence[int]]) -> np.ndarray:
    """Check that every frame has 7 codes in 0..4095; return them as an (n, 7) int32 array.

    Validation happens before batching: one bad index on CUDA is a device-side assert
    that poisons the whole process for every stream.
    """
    for i, frame in enumerate(frames):
        if len(frame) != CODES_PER_FRAME:
            raise InvalidFrames(f"frame {i} has {len(frame)} codes, expected {CODES_PER_FRAME}")
    codes = np.asarray(frames, dtype=np.int64).reshape(-1, CODES_PER_FRAME)
    bad = np.flatnonzero((codes < 0) | (codes >= CODEBOOK_SIZE))
    if bad.size:
        i, slot = divmod(int(bad[0]), CODES_PER_FRAME)
        raise InvalidFrames(
            f"frame {i} slot {slot}: code {int(codes[i, slot])} is outside 0..{CODEBOOK_SIZE - 1}"
        )
    return codes.astype(np.int32)


def frames_to_levels(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split (..., n, 7) frames into SNAC levels shaped (..., n), (..., 2n), (..., 4n)."""
    lead = frames.shape[:-2]
    n = frames.shape[-2]
    l0 = frames[..., 0]
    l1 = frames[..., _L1_SLOTS].reshape(*lead, 2 * n)
    l2 = frames[..., _L2_SLOTS].reshape(*lead, 4 * n)
    return l0, l1, l2
