"""Orpheus audio frames: 7 SNAC codes per frame, and their validation.

A frame maps onto SNAC's three code levels as (slot -> level[index]):
slot0 -> L0[j]; slot1 -> L1[2j]; slot2 -> L2[4j]; slot3 -> L2[4j+1];
slot4 -> L1[2j+1]; slot5 -> L2[4j+2]; slot6 -> L2[4j+3].
"""

from __future__ import annotations

import numpy as np
import torch

from codec_contract.audio import CODEBOOK_SIZE, CODES_PER_FRAME, FRAME_SAMPLES, unpack_frames

__all__ = ["CODEBOOK_SIZE", "CODES_PER_FRAME", "FRAME_SAMPLES", "InvalidFrames", "frames_to_levels", "levels_to_frames",
           "validate_codes"]

# The slots of each level, in the order their codes follow each other within a frame.
_L1_SLOTS = (1, 4)
_L2_SLOTS = (2, 3, 5, 6)


class InvalidFrames(ValueError):
    """Client-supplied frames that must never reach the model (becomes INVALID_ARGUMENT)."""


def validate_codes(packed: bytes) -> np.ndarray:
    """Frames.codes (14 bytes a frame) as an (n, 7) int32 array, every code in 0..4095.

    Validation happens before batching: one bad index on CUDA is a device-side assert
    that poisons the whole process for every stream.
    """
    try:
        codes = unpack_frames(packed)
    except ValueError as exc:
        raise InvalidFrames(str(exc)) from None
    if codes.size and codes.max() >= CODEBOOK_SIZE:  # uint16 on the wire: never negative
        i, slot = divmod(int(np.flatnonzero(codes >= CODEBOOK_SIZE)[0]), CODES_PER_FRAME)
        raise InvalidFrames(f"frame {i} slot {slot}: code {int(codes[i, slot])} is outside 0..{CODEBOOK_SIZE - 1}")
    return codes


def frames_to_levels(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split (..., n, 7) frames into SNAC levels shaped (..., n), (..., 2n), (..., 4n).

    Integer slots (views) and a stack, never a list index: on a GPU a list index is built on
    the host and uploaded with a blocking copy, which fails CUDA Graph capture.
    """
    lead = frames.shape[:-2]
    n = frames.shape[-2]
    l1 = torch.stack([frames[..., s] for s in _L1_SLOTS], dim=-1).reshape(*lead, 2 * n)
    l2 = torch.stack([frames[..., s] for s in _L2_SLOTS], dim=-1).reshape(*lead, 4 * n)
    return frames[..., 0], l1, l2


def levels_to_frames(l0: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """SNAC's levels shaped (n,), (2n,), (4n,) as (n, 7) frames: frames_to_levels undone."""
    n = l0.shape[-1]
    frames = torch.empty(n, CODES_PER_FRAME, dtype=l0.dtype, device=l0.device)
    frames[:, 0] = l0
    frames[:, list(_L1_SLOTS)] = l1.reshape(n, len(_L1_SLOTS))
    frames[:, list(_L2_SLOTS)] = l2.reshape(n, len(_L2_SLOTS))
    return frames
